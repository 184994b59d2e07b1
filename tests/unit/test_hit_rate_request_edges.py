"""services.api.hit_rate_request at edges its other tests left open (mutation testing, issue
33); each test names the wrong version it kills, applied by hand and seen to fail."""

from __future__ import annotations

import pytest

from common.errors import RequestError
from services.api.hit_rate_request import parse_request


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'""', "the request body must be a JSON object, got a string"),
        (b'{"server_ip": ["a"], "body": ""}', "body must be a JSON object, got a string"),
    ],
)
def test_an_empty_string_for_an_object_is_named_a_string(raw: bytes, message: str) -> None:
    """The request and its ``body`` name a JSON string as "a string", empty or not.
    Kills ``_fields`` passing ``empty=True`` (or leaving the default)."""
    with pytest.raises(RequestError) as err:
        parse_request(raw)
    assert (err.value.status, err.value.message) == (400, message)
