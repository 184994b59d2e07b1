"""common.blockhash against vLLM's own vectors and against a cbor2/pickle reference.

Vectors: tests/data/vllm_golden.json (0.28.0, 0.23.0, with preimages) and
tests/data/vllm_hash_vectors.json (0.28.0, 0.31.0, 0.34.0; scripts/make_vllm_hash_vectors.py).
The reference below is vLLM's algorithm spelled with cbor2.dumps(canonical=True) / pickle
and hashlib, with extra keys written out from spec §4.4.
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

from common import blockhash_cbor
from common.blockhash import (
    BlockHasher,
    HashSettings,
    none_hash,
    parse_vllm_version,
    to_event_int,
)
from common.errors import ConfigError

pytestmark = pytest.mark.usefixtures("hash_path")  # every test on every hashing path

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = json.loads((DATA / "vllm_golden.json").read_text())["versions"]
VECTORS = json.loads((DATA / "vllm_hash_vectors.json").read_text(encoding="utf-8"))["versions"]
CBOR_WIDTHS = [0, 23, 24, 255, 256, 65535, 65536, 2**18 - 1, 2**18, 2**32 - 1, 2**32, 2**40]


def _cases(versions: dict[str, Any], key: str) -> list[Any]:
    return [
        pytest.param(version, case, id=f"{version}-{case['name']}")
        for version, data in versions.items()
        for case in (data[key] if key else data)
        if case["deterministic"]
    ]


def reference_digests(
    settings: HashSettings,
    tokens: list[int],
    block_size: int,
    salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[bytes]:
    """vLLM's chain with cbor2/pickle, per spec §4.2-§4.4."""

    def serialize(obj: object) -> bytes:
        if settings.algo == "sha256":
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return bytes(cbor2.dumps(obj, canonical=True))

    tagged = settings.vllm_version >= (0, 31, 0)
    seed = "vllm-none-hash" if settings.seed is None else settings.seed
    lora_keys: list[object] = [] if lora is None else [("lora", *lora) if tagged else lora[0]]
    salt_keys: list[object] = [("cache_salt", salt) if tagged else salt] if salt else []
    parent, out = hashlib.sha256(serialize(seed)).digest(), []
    for i in range(len(tokens) // block_size):
        extra = tuple(lora_keys + salt_keys) if i == 0 else tuple(lora_keys)
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(serialize((parent, block, extra or None))).digest()
        out.append(parent)
    return out


@pytest.mark.parametrize(("version", "case"), _cases(GOLDEN, "hash_cases"))
def test_golden_hash_cases(version: str, case: dict[str, Any]) -> None:
    hasher = BlockHasher(HashSettings.from_strings(case["algo"], case["seed"], version))
    lora = case["lora"] or {}
    args = (
        case["token_ids"],
        case["block_size"],
        case["cache_salt"],
        lora.get("name"),
        lora.get("path"),
    )
    assert none_hash(hasher.settings).hex() == case["none_hash_hex"]
    assert [d.hex() for d in hasher.digests(*args)] == case["block_hashes_hex"]
    assert hasher.event_ints(*args) == case["block_hashes_event_int"]
    assert hasher.member_keys(*args) == [b"%d" % i for i in case["block_hashes_event_int"]]
    preimages = hasher.preimages(*args)
    assert len(preimages) == case["num_full_blocks"]
    for block in case.get("blocks") or []:
        assert preimages[block["index"]].hex() == block["preimage_hex"]
        assert to_event_int(bytes.fromhex(block["hash_hex"])) == block["event_int"]


@pytest.mark.parametrize(("version", "case"), _cases(VECTORS, ""))
def test_vllm_made_vectors(version: str, case: dict[str, Any]) -> None:
    hasher = BlockHasher(HashSettings.from_strings(case["algo"], case["seed"], version))
    args = (
        case["token_ids"],
        case["block_size"],
        case["cache_salt"],
        case["lora_name"],
        case["lora_path"],
    )
    assert none_hash(hasher.settings).hex() == case["none_hash_hex"]
    assert [d.hex() for d in hasher.digests(*args)] == case["block_hashes_hex"]


@pytest.mark.parametrize("version", sorted(GOLDEN))
def test_golden_none_hash_rows(version: str) -> None:
    rows = GOLDEN[version]["none_hash"]
    for row in rows:
        settings = HashSettings(row["algo"], row["PYTHONHASHSEED"], parse_vllm_version(version))
        if row["none_hash_hex"] is None:  # unset seed: vLLM < 0.29 drew a random NONE_HASH
            with pytest.raises(ConfigError, match=r"random.*blockKey\.pythonHashSeed"):
                none_hash(settings)
            with pytest.raises(ConfigError):
                BlockHasher(settings)
        else:
            assert none_hash(settings).hex() == row["none_hash_hex"]
    assert sum(row["none_hash_hex"] is None for row in rows) == 2  # both algos


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
@pytest.mark.parametrize("version", [(0, 29, 0), (0, 34, 0)])
def test_unset_seed_from_029_is_vllm_none_hash(algo: str, version: tuple[int, int, int]) -> None:
    unset = HashSettings(algo, None, version)
    fixed = HashSettings(algo, "vllm-none-hash", version)
    assert none_hash(unset) == none_hash(fixed)
    if algo == "sha256_cbor":
        assert none_hash(unset) == hashlib.sha256(cbor2.dumps("vllm-none-hash")).digest()
    tokens = list(range(1000, 1048))
    assert BlockHasher(unset).digests(tokens, 16) == BlockHasher(fixed).digests(tokens, 16)


def test_empty_seed_is_the_empty_string() -> None:
    settings = HashSettings(seed="")
    assert none_hash(settings) == hashlib.sha256(b"\x60").digest()
    assert none_hash(settings) != none_hash(HashSettings(seed="0"))
    tokens = list(range(64))
    assert BlockHasher(settings).digests(tokens, 16) == reference_digests(settings, tokens, 16)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256, 24, 3000])
def test_long_prompt_matches_cbor2_reference(block_size: int) -> None:
    rng = random.Random(block_size)
    tokens = [rng.randrange(151_936) for _ in range(131_072 + 7)]
    settings = HashSettings()
    digests = BlockHasher(settings).digests(tokens, block_size)
    assert len(digests) == 131_072 // block_size
    assert digests == reference_digests(settings, tokens, block_size)


@pytest.mark.parametrize("block_size", [1, 3, 16, 23, 24, 255, 256])
def test_cbor_integer_width_boundaries(block_size: int) -> None:
    rng = random.Random(7)
    tokens = CBOR_WIDTHS * 30
    rng.shuffle(tokens)
    settings = HashSettings()
    hasher = BlockHasher(settings)
    assert hasher.digests(tokens, block_size) == reference_digests(settings, tokens, block_size)
    parent = none_hash(settings)
    for i, preimage in enumerate(hasher.preimages(tokens, block_size)):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        assert preimage == cbor2.dumps((parent, block, None), canonical=True)
        parent = hashlib.sha256(preimage).digest()


def test_encoder_matches_cbor2_value_by_value() -> None:
    edges = CBOR_WIDTHS + [2**16, 2**31, 2**64 - 1]
    ids = sorted({v + d for v in edges for d in (-1, 0, 1) if 0 <= v + d < 2**64})
    small = [v for v in ids if v < 2**32]
    assert len(small) * 3 >= blockhash_cbor.NUMPY_FROM
    for values in (ids, small, small * 3, [70_000]):  # per id, and numpy (small * 3)
        ids, largest = blockhash_cbor.id_array(values, 2**64)
        assert largest == max(values)
        per_id = largest >= blockhash_cbor.ITEM_IDS_BELOW
        encode = blockhash_cbor.encode_blocks_per_id if per_id else blockhash_cbor.encode_blocks
        encoded, ends = encode(ids, 1)
        assert [encoded[a:b] for a, b in zip([0, *ends], ends)] == [cbor2.dumps(v) for v in values]
    for text in ["", "a" * 23, "a" * 24, "a" * 255, "a" * 256, "a" * 65536, "租户-α🦙"]:
        assert blockhash_cbor.encode(text) == cbor2.dumps(text, canonical=True)
    keys = (("lora", "ad", "/p"), ("cache_salt", "s"), "bare")
    assert blockhash_cbor.encode(keys) == cbor2.dumps(keys, canonical=True)
    assert blockhash_cbor.encode(None) == cbor2.dumps(None)


def test_ids_past_the_table_mixed_with_table_ids() -> None:
    tokens = [5, 300_000, 2**31 - 1, 2**63, 2**64 - 1, 7] * 8
    settings = HashSettings()
    assert BlockHasher(settings).digests(tokens, 16) == reference_digests(settings, tokens, 16)


@pytest.mark.parametrize("salt", ["租户-α", "🦙 tenant", "x" * 300, "a\u0000b"])
@pytest.mark.parametrize("version", [(0, 12, 0), (0, 28, 0), (0, 30, 9), (0, 31, 0), (0, 34, 0)])
def test_salts_and_lora_match_reference(salt: str, version: tuple[int, int, int]) -> None:
    settings = HashSettings(vllm_version=version)
    hasher = BlockHasher(settings)
    tokens = list(range(50_000, 50_070))
    lora = ("sql-lora", "/adapters/sql-lora")
    assert hasher.digests(tokens, 16, salt) == reference_digests(settings, tokens, 16, salt)
    assert hasher.digests(tokens, 16, salt, *lora) == reference_digests(
        settings, tokens, 16, salt, lora
    )
    assert hasher.digests(tokens, 16, None, *lora) == reference_digests(
        settings, tokens, 16, None, lora
    )


def test_tagged_extra_keys_preimage_structure_from_031() -> None:
    settings = HashSettings(vllm_version=(0, 31, 0))
    tokens = list(range(100, 148))
    blocks = [cbor2.loads(p) for p in BlockHasher(settings).preimages(tokens, 16, "s")]
    assert blocks[0] == [none_hash(settings), tokens[:16], [["cache_salt", "s"]]]
    assert blocks[1][2] is None and blocks[2][2] is None
    with_lora = BlockHasher(settings).preimages(tokens, 16, "s", "ad", "/p")
    assert cbor2.loads(with_lora[0])[2] == [["lora", "ad", "/p"], ["cache_salt", "s"]]
    assert cbor2.loads(with_lora[1])[2] == [["lora", "ad", "/p"]]


def test_untagged_extra_keys_before_031() -> None:
    settings = HashSettings(vllm_version=(0, 30, 0))
    preimages = BlockHasher(settings).preimages(list(range(32)), 16, "s", "ad", "/ignored")
    assert cbor2.loads(preimages[0])[2] == ["ad", "s"]
    assert cbor2.loads(preimages[1])[2] == ["ad"]
    # 0.10.2-0.11 key salts the same way; LoRA there is the server's int id (refused)
    old = BlockHasher(HashSettings(vllm_version=(0, 11, 0)))
    assert old.digests(list(range(32)), 16, "s") == BlockHasher(settings).digests(
        list(range(32)), 16, "s"
    )
    with pytest.raises(ValueError, match="lora_int_id"):
        old.digests(list(range(32)), 16, lora_name="ad")


@pytest.mark.parametrize("version", [(0, 28, 0), (0, 34, 0)])
def test_pickle_algo_matches_pickle_dumps(version: tuple[int, int, int]) -> None:
    settings = HashSettings(algo="sha256", vllm_version=version)
    hasher = BlockHasher(settings)
    tokens = CBOR_WIDTHS[:8] * 9
    lora = ("sql-lora", "/adapters/sql-lora")
    assert hasher.digests(tokens, 16, "租户-α", *lora) == reference_digests(
        settings, tokens, 16, "租户-α", lora
    )
    preimages = hasher.preimages(tokens, 16, "t")
    parent, block, extra = pickle.loads(preimages[0])
    assert (parent, block) == (none_hash(settings), tuple(tokens[:16]))
    assert extra == ((("cache_salt", "t"),) if version >= (0, 31, 0) else ("t",))
    # bools and tuples are ids too, but pickled as the plain ints vLLM would hold
    assert hasher.digests(tuple(True if t == 1 else t for t in tokens), 16) == hasher.digests(
        tokens, 16
    )


def test_falsy_salt_and_lora_name_mean_none() -> None:
    hasher = BlockHasher(HashSettings())
    tokens = list(range(40))
    plain = hasher.digests(tokens, 16)
    assert hasher.digests(tokens, 16, "") == plain
    assert hasher.digests(tokens, 16, None, "") == plain
    assert hasher.digests(tokens, 16, "s") != plain
    assert hasher.digests(tokens, 16, "s")[1:] != plain[1:]  # the salt reaches later blocks


def test_short_and_empty_prompts_have_no_blocks() -> None:
    hasher = BlockHasher(HashSettings())
    for tokens in ([], list(range(15))):
        assert hasher.digests(tokens, 16) == []
        assert hasher.event_ints(tokens, 16) == []
        assert hasher.member_keys(tokens, 16) == []
    assert len(hasher.digests([7], 1)) == 1
    assert hasher.digests([True] * 16, 16) == hasher.digests([1] * 16, 16)


@pytest.mark.parametrize(
    "tokens",
    [
        [-1] * 16,
        [1.0] * 16,
        ["1"] * 16,
        [None] * 16,
        [2**64] * 16,
        list(range(16)) + [-5],
        list(range(16)) + [0.5],
        [1] * 15 + [-(2**18) - 1],
    ],
)
@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_bad_token_ids_raise_value_error(tokens: list[Any], algo: str) -> None:
    with pytest.raises(ValueError, match="token id"):
        BlockHasher(HashSettings(algo=algo)).digests(tokens, 16)


@pytest.mark.parametrize("where", [0, 5000, 9999, 10_005])
def test_bad_id_anywhere_in_a_long_prompt(where: int) -> None:
    tokens = list(range(10_010))  # 1,000 blocks of 10 and a partial block of 10
    tokens[where] = -1
    with pytest.raises(ValueError, match="token id -1"):
        BlockHasher(HashSettings()).member_keys(tokens, 10)


def test_int32_token_limit_from_034() -> None:
    tokens = list(range(15)) + [2**31]
    assert len(BlockHasher(HashSettings(vllm_version=(0, 33, 0))).digests(tokens, 16)) == 1
    for algo in ("sha256_cbor", "sha256"):
        hasher = BlockHasher(HashSettings(algo=algo, vllm_version=(0, 34, 0)))
        assert len(hasher.digests(tokens[:-1] + [2**31 - 1], 16)) == 1
        with pytest.raises(ValueError, match=r"2\*\*31"):
            hasher.digests(tokens, 16)
        with pytest.raises(ValueError):  # the unhashed partial block is checked too
            hasher.digests(list(range(16)) + [2**31], 16)


@pytest.mark.parametrize("block_size", [0, -16, True, 1.5, "16", None])
def test_bad_block_size(block_size: Any) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(HashSettings()).digests(list(range(32)), block_size)


@pytest.mark.parametrize(
    ("version", "kwargs", "match"),
    [
        ((0, 34, 0), {"lora_name": "ad"}, "lora_path is required"),
        ((0, 28, 0), {"lora_path": "/p"}, "without lora_name"),
        ((0, 28, 0), {"cache_salt": 5}, "cache_salt must be a string"),
        ((0, 28, 0), {"lora_name": b"ad"}, "lora_name must be a string"),
        ((0, 28, 0), {"cache_salt": "\ud800"}, "surrogate"),
    ],
)
def test_bad_extra_keys(version: tuple[int, int, int], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BlockHasher(HashSettings(vllm_version=version)).digests(list(range(32)), 16, **kwargs)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.28.0", (0, 28, 0)),
        ("0.28", (0, 28, 0)),
        ("v0.34.1", (0, 34, 1)),
        ("0.29.0rc1", (0, 29, 0)),
        ("0.28.0+cpu", (0, 28, 0)),
        (" 0.10.2 ", (0, 10, 2)),
        ("0.11.0.post1", (0, 11, 0)),
    ],
)
def test_parse_vllm_version(text: str, expected: tuple[int, int, int]) -> None:
    assert parse_vllm_version(text) == expected


@pytest.mark.parametrize(
    ("algo", "seed", "version"),
    [
        ("xxhash", "0", "0.28.0"),
        ("sha256_cbor", "0", "0.10.1"),
        ("sha256_cbor", "0", "abc"),
        ("sha256_cbor", "0", "0.28.x"),
        ("sha256_cbor", 0, "0.28.0"),
        ("sha256_cbor", "0", None),
        ("", "0", "0.28.0"),
    ],
)
def test_bad_settings_raise_config_error(algo: str, seed: Any, version: str) -> None:
    with pytest.raises(ConfigError):
        HashSettings.from_strings(algo, seed, version)


def test_settings_defaults_and_hashable() -> None:
    settings = HashSettings()
    assert (settings.algo, settings.seed, settings.vllm_version) == ("sha256_cbor", "0", (0, 28, 0))
    assert HashSettings.from_strings("sha256_cbor", "0", "0.28.0") == settings
    assert len({settings, HashSettings()}) == 1
    assert none_hash(settings).hex().startswith("4e1195df")


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_the_bad_id_is_named_even_after_a_zero(algo: str) -> None:
    """0 is a valid id on the slow (checked) path too: the error names the bad id."""
    for version, bad in (((0, 28, 0), -1), ((0, 34, 0), 2**31)):
        hasher = BlockHasher(HashSettings(algo=algo, vllm_version=version))
        with pytest.raises(ValueError, match=rf"token id {bad} "):
            hasher.digests([0, 1, 0, bad], 2)


@pytest.mark.parametrize("version", ["0.28.0", "0.31.0"])
def test_event_ints_and_member_keys_carry_salt_and_lora(version: str) -> None:
    case = next(c for c in VECTORS[version] if c["name"] == "lora_salt")
    hasher = BlockHasher(HashSettings.from_strings(case["algo"], case["seed"], version))
    args = (
        case["token_ids"],
        case["block_size"],
        case["cache_salt"],
        case["lora_name"],
        case["lora_path"],
    )
    ints = [int(h[-16:], 16) for h in case["block_hashes_hex"]]  # vLLM's, from the file
    assert hasher.event_ints(*args) == ints
    assert hasher.member_keys(*args) == [str(i).encode() for i in ints]


def test_oldest_supported_vllm_is_0_10_2() -> None:
    assert BlockHasher(HashSettings(vllm_version=(0, 10, 2))).digests(list(range(16)), 16)
    with pytest.raises(ConfigError, match="0.10.2 or newer"):
        HashSettings(vllm_version=(0, 10, 1))
