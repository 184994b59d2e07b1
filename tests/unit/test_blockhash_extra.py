"""LoRA, multimodal and lookahead extra keys (spec vllm-extra-keys.md) on every hashing path.

Vectors: tests/data/extra-keys/ (vLLM's own request block hasher, 0.12.0 - 0.34.0; lookahead
0.33.0 and 0.34.0), copied from the shared golden data. The reference below is the spec's
rule spelled with cbor2/pickle and hashlib, for the random cases the vectors do not cover.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
from pathlib import Path
from typing import Any

import cbor2
import pytest

from common.blockhash import BlockHasher, HashInputs, HashSettings, MmItem, none_hash
from common.blockhash_extra import MAX_MM_ITEMS

pytestmark = pytest.mark.usefixtures("hash_path")  # every test on every hashing path

DATA = Path(__file__).resolve().parents[1] / "data" / "extra-keys"
VECTOR_FILES = sorted(DATA.glob("vectors_*.json"))
LOOKAHEAD_FILES = sorted(DATA.glob("lookahead_*.json"))


def _version(text: str) -> tuple[int, int, int]:
    major, minor, patch = (int(part) for part in text.split("."))
    return major, minor, patch


def _cases(files: list[Path]) -> list[Any]:
    out = []
    for path in files:
        doc = json.loads(path.read_text(encoding="utf-8"))
        for case in doc["cases"]:
            out.append(pytest.param(case, id=f"{doc['release']}-{case['name']}"))
    return out


def case_inputs(case: dict[str, Any]) -> tuple[BlockHasher, HashInputs]:
    """The hasher and inputs of a golden case (public: the API and CLI tests use it too)."""
    settings = HashSettings(case["algo"], case["seed"], _version(case["release"]))
    lora = case["lora"] or {}
    items = tuple(MmItem(f["identifier"], f["offset"], f["length"]) for f in case["mm_features"])
    inputs = HashInputs(
        lora_name=lora.get("name"),
        lora_path=lora.get("path"),
        mm_items=items,
        lookahead=case.get("lookahead_tokens", 0),
    )
    return BlockHasher(settings), inputs


def _tuples(value: Any) -> Any:
    """JSON arrays back to tuples, as vLLM's extra keys are."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


@pytest.mark.parametrize("case", _cases(VECTOR_FILES + LOOKAHEAD_FILES))
def test_golden_vectors(case: dict[str, Any]) -> None:
    hasher, inputs = case_inputs(case)
    tokens, block, salt = case["token_ids"], case["block_size"], case["cache_salt"]
    assert none_hash(hasher.settings).hex() == case["none_hash_hex"]
    digests = hasher.digests(tokens, block, salt, inputs=inputs)
    assert [d.hex() for d in digests] == case["block_hashes_hex"]
    assert hasher.event_ints(tokens, block, salt, inputs=inputs) == case["block_hashes_event_int"]
    members = hasher.member_keys(tokens, block, salt, inputs=inputs)
    assert members == [b"%d" % v for v in case["block_hashes_event_int"]]
    preimages = hasher.preimages(tokens, block, salt, inputs=inputs)
    loads = pickle.loads if case["algo"] == "sha256" else cbor2.loads
    got = [_tuples(loads(p)[2]) for p in preimages]
    assert got == [_tuples(b["extra_keys"]) for b in case["blocks"]]


def test_vectors_cover_what_the_spec_names() -> None:
    names = {c.values[0]["name"] for c in _cases(VECTOR_FILES)}
    for name in (
        "bs16_mm_adjacent_pair",
        "bs16_mm_spanning_4_blocks",
        "bs16_mm_in_partial_last_block",
        "bs16_same_identifier_twice",
        "bs16_mm_lora_salt_4items",
        "sha256_pickle_mm_lora_salt",
    ):
        assert name in names
    releases = {c.values[0]["release"] for c in _cases(VECTOR_FILES + LOOKAHEAD_FILES)}
    assert releases == {"0.12.0", "0.24.0", "0.28.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"}


# --- the spec's rule, spelled out with cbor2 / pickle -------------------------------------


def reference(
    settings: HashSettings,
    tokens: list[int],
    block: int,
    salt: str | None,
    lora: tuple[str, str] | None,
    items: list[tuple[str, int, int]],
    lookahead: int = 0,
) -> list[bytes]:
    version, tagged = settings.vllm_version, settings.vllm_version >= (0, 31, 0)

    def serialize(obj: object) -> bytes:
        if settings.algo == "sha256":
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return bytes(cbor2.dumps(obj, canonical=True))

    items = sorted(items, key=lambda item: item[1])
    parent = none_hash(settings)
    out = []
    for i in range(max(len(tokens) - lookahead, 0) // block):
        s, e = i * block, (i + 1) * block
        keys: list[object] = []
        if lora:
            keys.append(("lora", *lora) if tagged else lora[0])
        for ident, offset, length in items:
            if offset < e + lookahead and offset + length > s:
                if tagged:
                    keys.append(("mm", ident, offset - s))
                elif version >= (0, 19, 0):
                    keys.append((ident, offset - s))
                else:
                    keys.append(ident)
        if i == 0 and salt:
            keys.append(("cache_salt", salt) if tagged else salt)
        extra: object = tuple(keys) or None
        if lookahead:
            extra = (extra, *tokens[e : e + lookahead])
        parent = hashlib.sha256(serialize((parent, tuple(tokens[s:e]), extra))).digest()
        out.append(parent)
    return out


def _random_items(rng: random.Random, n_tokens: int, count: int) -> list[tuple[str, int, int]]:
    starts = sorted(rng.sample(range(n_tokens), count))
    items = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else n_tokens
        length = rng.randint(1, end - start)
        ident = rng.choice(["img-a", "img-b", "图像", "x" * 70, f"{k:064x}"])
        items.append((ident, start, length))
    rng.shuffle(items)  # the request may list them in any order
    return items


RELEASES = [(0, 12, 0), (0, 18, 3), (0, 19, 0), (0, 30, 1), (0, 31, 0), (0, 34, 0)]


@pytest.mark.parametrize("seed", range(12))
def test_random_requests_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    version = RELEASES[seed % len(RELEASES)]
    algo = "sha256" if seed % 5 == 4 else "sha256_cbor"
    settings = HashSettings(algo, "0", version)
    block = rng.choice([1, 4, 16, 64])
    tokens = [rng.randrange(200_000) for _ in range(rng.randint(1, 700))]
    items = _random_items(rng, len(tokens), rng.randint(0, min(30, len(tokens))))
    lora = ("ad", "/a/p") if seed % 2 else None
    salt = rng.choice([None, "", "s", "租户"])
    lookahead = rng.choice([0, 0, 1, 3]) if version >= (0, 33, 0) else 0
    inputs = HashInputs(
        lora_name=lora and lora[0],
        lora_path=lora and lora[1],
        mm_items=tuple(MmItem(*item) for item in items),
        lookahead=lookahead,
    )
    want = reference(settings, tokens, block, salt, lora, items, lookahead)
    assert BlockHasher(settings).digests(tokens, block, salt, inputs=inputs) == want


@pytest.mark.parametrize("count", [1, 15, 16, 17, 40])
def test_few_and_many_keyed_blocks_agree(count: int) -> None:
    """Up to 16 blocks with their own keys run as C calls per run, more in Python: both are
    the reference chain, whatever the count."""
    settings = HashSettings(vllm_version=(0, 34, 0))
    tokens = list(range(1000, 1000 + 16 * 50 + 5))
    items = [(f"i{k}", 16 * k + 3, 2) for k in range(count)]
    inputs = HashInputs(mm_items=tuple(MmItem(*item) for item in items))
    want = reference(settings, tokens, 16, "s", None, items)
    assert BlockHasher(settings).digests(tokens, 16, "s", inputs=inputs) == want


# --- the traps ---------------------------------------------------------------------------


def test_negative_relative_offsets_are_cbor_negative_ints() -> None:
    hasher = BlockHasher(HashSettings(vllm_version=(0, 28, 0)))
    inputs = HashInputs(mm_items=(MmItem("id", 10, 50),))
    preimages = hasher.preimages(list(range(64)), 16, inputs=inputs)
    rels = [cbor2.loads(p)[2][0][1] for p in preimages]
    assert rels == [10, -6, -22, -38]
    assert preimages[1].endswith(b"\x81\x82\x62id\x25")  # -6: major type 1, value 5
    assert preimages[3].endswith(b"\x81\x82\x62id\x38\x25")  # -38: 0x38 then 37


@pytest.mark.parametrize(
    ("version", "key"),
    [
        ((0, 11, 1), "id"),
        ((0, 18, 0), "id"),
        ((0, 19, 0), ["id", 3]),
        ((0, 30, 0), ["id", 3]),
        ((0, 31, 0), ["mm", "id", 3]),
        ((0, 34, 0), ["mm", "id", 3]),
    ],
)
def test_per_release_item_forms(version: tuple[int, int, int], key: object) -> None:
    inputs = HashInputs(mm_items=(MmItem("id", 3, 4),))
    preimage = BlockHasher(HashSettings(vllm_version=version)).preimages(
        list(range(16)), 16, inputs=inputs
    )[0]
    assert cbor2.loads(preimage)[2] == [key]


def test_item_only_in_the_partial_block_changes_nothing() -> None:
    hasher = BlockHasher(HashSettings(vllm_version=(0, 34, 0)))
    tokens = list(range(40))
    plain = hasher.digests(tokens, 16)
    inputs = HashInputs(mm_items=(MmItem("tail", 32, 8),))
    assert hasher.digests(tokens, 16, inputs=inputs) == plain
    ending_on_edge = HashInputs(mm_items=(MmItem("x", 8, 8),))  # [8, 16): block 0 only
    keyed = hasher.preimages(tokens, 16, inputs=ending_on_edge)
    assert [cbor2.loads(p)[2] for p in keyed] == [[["mm", "x", 8]], None]


def test_same_identifier_twice_keys_each_occurrence() -> None:
    hasher = BlockHasher(HashSettings(vllm_version=(0, 24, 0)))
    inputs = HashInputs(mm_items=(MmItem("img", 2, 3), MmItem("img", 9, 3)))
    preimage = hasher.preimages(list(range(16)), 16, inputs=inputs)[0]
    assert cbor2.loads(preimage)[2] == [["img", 2], ["img", 9]]


def test_unsorted_items_are_sorted_by_offset() -> None:
    hasher = BlockHasher(HashSettings(vllm_version=(0, 34, 0)))
    a, b = MmItem("a", 20, 4), MmItem("b", 3, 17)
    tokens = list(range(48))
    assert hasher.digests(tokens, 16, inputs=HashInputs(mm_items=(a, b))) == hasher.digests(
        tokens, 16, inputs=HashInputs(mm_items=(b, a))
    )
    first = hasher.preimages(tokens, 16, inputs=HashInputs(mm_items=(a, b)))[1]
    assert cbor2.loads(first)[2] == [["mm", "b", -13], ["mm", "a", 4]]


def test_lookahead_window_and_rewind() -> None:
    hasher = BlockHasher(HashSettings(vllm_version=(0, 33, 0)))
    tokens = list(range(100, 150))  # 50 tokens: 3 full blocks, 3 hashed with L=1
    inputs = HashInputs(mm_items=(MmItem("p", 16, 1),), lookahead=1)
    keys = [cbor2.loads(p)[2] for p in hasher.preimages(tokens, 16, inputs=inputs)]
    # the item at 16 lies in block 0's lookahead (rel 16) and is keyed again in block 1
    assert keys == [[[["mm", "p", 16]], 116], [[["mm", "p", 0]], 132], [None, 148]]
    # 48 tokens with L=1: the last full block has no token after it, so it is not hashed
    assert len(hasher.digests(tokens[:48], 16, inputs=HashInputs(lookahead=1))) == 2
    assert len(hasher.digests(tokens[:49], 16, inputs=HashInputs(lookahead=1))) == 3
    assert hasher.digests(tokens[:2], 16, inputs=HashInputs(lookahead=3)) == []
    # an item in the trailing partial block enters the last hashed block if it starts < e+L
    tail = HashInputs(mm_items=(MmItem("t", 49, 1),), lookahead=2)
    last = hasher.preimages(tokens, 16, inputs=tail)[-1]
    assert cbor2.loads(last)[2] == [[["mm", "t", 17]], 148, 149]


def test_lookahead_differs_from_none_and_between_values() -> None:
    hasher = BlockHasher(HashSettings(vllm_version=(0, 34, 0)))
    tokens = list(range(70))
    chains = [hasher.digests(tokens, 16, inputs=HashInputs(lookahead=n)) for n in (0, 1, 2)]
    assert chains[0][0] != chains[1][0] != chains[2][0] != chains[0][0]


def test_lookahead_before_033_and_lora_before_0111_are_refused() -> None:
    with pytest.raises(ValueError, match="vLLM < 0.33"):
        BlockHasher(HashSettings(vllm_version=(0, 32, 0))).digests(
            list(range(32)), 16, inputs=HashInputs(lookahead=1)
        )
    old = BlockHasher(HashSettings(vllm_version=(0, 11, 0)))
    with pytest.raises(ValueError, match=r"vLLM 0\.11\.0 keys LoRA .* lora_int_id"):
        old.digests(list(range(32)), 16, inputs=HashInputs(lora_name="ad"))
    new = BlockHasher(HashSettings(vllm_version=(0, 11, 1)))
    keyed = new.preimages(list(range(32)), 16, inputs=HashInputs(lora_name="ad"))
    assert [cbor2.loads(p)[2] for p in keyed] == [["ad"], ["ad"]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mm_items": (MmItem("", 0, 1),)}, r"mm_features\[0\]\.identifier must be a non-empty"),
        ({"mm_items": (MmItem("a", 0, 0),)}, r"mm_features\[0\]\.length must be an integer >= 1"),
        ({"mm_items": (MmItem("a", -1, 2),)}, r"offset must be an integer >= 0"),
        ({"mm_items": (MmItem("a", 4, 4), MmItem("b", 0, 5))}, r"\[0\] overlaps .*\[1\]"),
        ({"mm_items": (MmItem(1, 0, 1),)}, "identifier must be a non-empty string"),  # type: ignore[arg-type]
        ({"mm_items": (MmItem("a", 0, True),)}, "length must be an integer"),
        ({"lora_name": 3}, "lora_name must be a string"),
        ({"lookahead": -1}, "lookahead must be"),
        ({"mm_items": tuple(MmItem("a", k, 1) for k in range(MAX_MM_ITEMS + 1))}, "limit of"),
    ],
)
def test_bad_inputs(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HashInputs(**kwargs)


def test_item_outside_the_prompt_is_refused() -> None:
    hasher = BlockHasher(HashSettings())
    inputs = HashInputs(mm_items=(MmItem("a", 0, 2), MmItem("b", 30, 3)))
    with pytest.raises(ValueError, match=r"mm_features\[1\] covers tokens \[30, 33\), outside"):
        hasher.digests(list(range(32)), 16, inputs=inputs)


def test_lora_arguments_and_inputs_are_exclusive() -> None:
    with pytest.raises(ValueError, match="not both"):
        BlockHasher(HashSettings()).digests(
            list(range(16)), 16, lora_name="a", inputs=HashInputs(lora_name="a")
        )


def test_plain_inputs_hash_as_before() -> None:
    hasher = BlockHasher(HashSettings(vllm_version=(0, 34, 0)))
    tokens = list(range(90))
    assert hasher.digests(tokens, 16, "s", inputs=HashInputs()) == hasher.digests(tokens, 16, "s")
    lora = hasher.digests(tokens, 16, "s", "ad", "/p")
    assert hasher.digests(tokens, 16, "s", inputs=HashInputs("ad", "/p")) == lora


def test_replace_keeps_items_sorted_and_checked() -> None:
    """What a caller deriving one instance's inputs does (e.g. its lookahead)."""
    import dataclasses

    inputs = HashInputs(mm_items=(MmItem("b", 40, 2), MmItem("a", 3, 4)))
    derived = dataclasses.replace(inputs, lookahead=2)
    assert [i.identifier for i in derived.mm_items] == ["a", "b"] and derived.lookahead == 2
    assert derived == HashInputs(mm_items=inputs.mm_items, lookahead=2)
    with pytest.raises(ValueError, match=r"mm_features\[1\] covers tokens \[40, 42\)"):
        derived.check_prompt(41)
