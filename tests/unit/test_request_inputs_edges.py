"""services.api.request_inputs at edges its other tests left open (mutation testing, issue
33); each test names the wrong versions it kills, applied by hand and seen to fail."""

from __future__ import annotations

import pytest

from common import blockhash_extra as extras
from common.errors import RequestError
from services.api.hit_rate_request import parse_request
from services.api.request_inputs import parse_inputs


def _refusal(body: dict[str, object], n: int = 64, version: tuple[int, ...] = (0, 28)) -> str:
    with pytest.raises(RequestError) as err:
        parse_inputs(body, n, version)
    assert err.value.status == 400
    return err.value.message


def test_exactly_the_item_limit_is_accepted_one_more_is_refused() -> None:
    """Kills ``len(raw) >= MAX_MM_ITEMS``: a prompt may carry exactly the limit."""
    n = extras.MAX_MM_ITEMS
    items = [{"identifier": f"i{k}", "offset": k, "length": 1} for k in range(n)]
    inputs = parse_inputs({"mm_features": items}, n, (0, 28))
    assert len(inputs.mm_items) == n
    message = _refusal({"mm_features": [*items, items[0]]}, n + 1)
    assert message == f"body.mm_features has {n + 1} items, more than the limit of {n}"


def test_each_bad_value_is_named_by_its_own_json_kind() -> None:
    """A refusal names the value that was sent: a number for ``modality`` is "an integer"
    (not "null"); a non-empty string where a list is due is "a string" (not "an empty
    string"), an empty string is "an empty string". Kills ``_kind(None)`` in the modality
    refusal, ``empty or value == ""`` in ``kind`` and the defaults of ``empty`` swapped."""
    item = {"identifier": "img", "offset": 0, "length": 4, "modality": 5}
    assert _refusal({"mm_features": [item]}) == (
        "body.mm_features[0].modality must be a string, got an integer"
    )
    assert _refusal({"mm_features": "abc"}) == (
        "body.mm_features must be a list of objects, got a string"
    )
    assert _refusal({"mm_features": ""}) == (
        "body.mm_features must be a list of objects, got an empty string"
    )
    assert _refusal({"mm_features": [""]}) == (
        "body.mm_features[0] must be an object, got an empty string"
    )
    with pytest.raises(RequestError) as err:  # the request's own fields: a string is a string
        parse_request(b'{"server_ip": "", "body": {}}')
    assert err.value.message == "server_ip must be a list of strings, got a string"


@pytest.mark.parametrize("version", [(0, 11), (0, 11, 0), (0, 10, 2)])
def test_a_two_part_release_is_padded_with_zeros(version: tuple[int, ...]) -> None:
    """``0.11`` is 0.11.0, which keys LoRA blocks by a server-assigned id: refused, naming
    the release. Kills the padding ``(*version, 1, 0, 0)`` and ``(*version, 0, 0, 1)``
    (0.11 taken for 0.11.1, which hashes the name)."""
    message = _refusal({"lora_name": "a"}, version=version)
    assert message.startswith(f"vLLM {'.'.join(map(str, (*version, 0)[:3]))} keys LoRA blocks")
    assert parse_inputs({"lora_name": "a"}, 64, (0, 11, 1)).lora_name == "a"


@pytest.mark.parametrize(
    "body",
    [
        {"lora_name": ""},
        {"lora_name": None, "lora_path": ""},
        {"mm_features": []},
        {"mm_features": None},
    ],
)
def test_fields_that_say_nothing_give_the_plain_inputs_themselves(body: dict[str, object]) -> None:
    """A body whose extra fields are empty hashes as a plain request, through the hasher's
    plain path (the very ``PLAIN`` object it tests for). Kills returning the equal-but-new
    ``HashInputs``."""
    assert parse_inputs(body, 64, (0, 31)) is extras.PLAIN
