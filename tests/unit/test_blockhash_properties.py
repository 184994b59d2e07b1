"""Property tests: BlockHasher and the vectorised CBOR encoder against a plain reference.

Hypothesis draws prompts (ids biased to every CBOR width boundary: 23/24, 255/256,
65535/65536, 2**32-1/2**32, and up to 2**64-1 where the vLLM version allows them), block sizes
from 1 to 300 (odd ones, sizes around 24 and 256, which change the array head's width) and
extra keys (salt, LoRA name and path, unicode, empty) for vLLM versions on both sides of
every extra-key rule. The reference is vLLM's algorithm written out with
``cbor2.dumps(canonical=True)`` (or ``pickle``) and ``hashlib``, per spec §4.2-§4.4; the
digests, preimages, event ints and member keys must match it bit for bit.
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from common import blockhash_cbor
from common.blockhash import BlockHasher, HashSettings

pytestmark = pytest.mark.usefixtures("hash_path")  # every test on every hashing path

BOUNDARIES = [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**32 - 1, 2**32, 2**64 - 1]
VERSIONS = [(0, 12, 0), (0, 28, 0), (0, 30, 9), (0, 31, 0), (0, 34, 0)]
PROPERTY = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def token_ids(limit: int, max_size: int = 400) -> st.SearchStrategy[list[int]]:
    edges = sorted({v + d for v in BOUNDARIES for d in (-1, 0, 1) if 0 <= v + d < limit})
    one = st.one_of(
        st.sampled_from(edges),
        st.integers(0, 151_935),  # a real vocabulary (Qwen)
        st.integers(0, limit - 1),
    )
    return st.lists(one, max_size=max_size)


block_sizes = st.one_of(
    st.sampled_from([1, 2, 3, 16, 23, 24, 25, 128, 255, 256]), st.integers(1, 300)
)
salts = st.one_of(st.none(), st.just(""), st.text(max_size=40))
loras = st.one_of(st.none(), st.tuples(st.text(min_size=1, max_size=20), st.text(min_size=1)))


def reference(
    settings_: HashSettings,
    tokens: list[int],
    block_size: int,
    salt: str | None,
    lora: tuple[str, str] | None,
) -> tuple[list[bytes], list[bytes]]:
    """(digests, preimages) of vLLM's chain, spelled with cbor2/pickle and hashlib."""

    def serialize(obj: object) -> bytes:
        if settings_.algo == "sha256":
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return bytes(cbor2.dumps(obj, canonical=True))

    tagged = settings_.vllm_version >= (0, 31, 0)
    lora_keys: list[object] = [] if lora is None else [("lora", *lora) if tagged else lora[0]]
    salt_keys: list[object] = [("cache_salt", salt) if tagged else salt] if salt else []
    assert settings_.seed is not None
    parent = hashlib.sha256(serialize(settings_.seed)).digest()
    digests, preimages = [], []
    for i in range(len(tokens) // block_size):
        extra = tuple(lora_keys + salt_keys) if i == 0 else tuple(lora_keys)
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        preimage = serialize((parent, block, extra or None))
        parent = hashlib.sha256(preimage).digest()
        digests.append(parent)
        preimages.append(preimage)
    return digests, preimages


@PROPERTY
@given(
    data=st.data(),
    version=st.sampled_from(VERSIONS),
    block_size=block_sizes,
    salt=salts,
    lora=loras,
)
@example(data=None, version=(0, 28, 0), block_size=16, salt=None, lora=None)
def test_cbor_hashes_match_the_reference_bit_for_bit(
    data: st.DataObject | None,
    version: tuple[int, int, int],
    block_size: int,
    salt: str | None,
    lora: tuple[str, str] | None,
) -> None:
    settings_ = HashSettings(vllm_version=version)
    limit = 2**31 if version >= (0, 34, 0) else 2**64
    tokens = BOUNDARIES * 3 if data is None else data.draw(token_ids(limit))
    tokens = [t for t in tokens if t < limit]
    hasher = BlockHasher(settings_)
    args = (tokens, block_size, salt, *(lora or (None, None)))
    digests, preimages = reference(settings_, tokens, block_size, salt, lora)
    assert hasher.preimages(*args) == preimages
    assert hasher.digests(*args) == digests
    ints = [int.from_bytes(d[-8:], "big") for d in digests]
    assert hasher.event_ints(*args) == ints
    assert hasher.member_keys(*args) == [str(i).encode() for i in ints]


@PROPERTY
@given(tokens=token_ids(2**64, max_size=200), block_size=block_sizes, salt=salts, lora=loras)
def test_pickle_hashes_match_the_reference(
    tokens: list[int], block_size: int, salt: str | None, lora: tuple[str, str] | None
) -> None:
    settings_ = HashSettings(algo="sha256", vllm_version=(0, 31, 0))
    args = (tokens, block_size, salt, *(lora or (None, None)))
    digests, preimages = reference(settings_, tokens, block_size, salt, lora)
    assert BlockHasher(settings_).digests(*args) == digests
    assert BlockHasher(settings_).preimages(*args) == preimages


EDGES = sorted({v + d for v in BOUNDARIES for d in (-1, 0, 1) if 0 <= v + d < 2**64})


@PROPERTY
@given(tokens=token_ids(2**64, max_size=300), block_size=block_sizes)
@example(tokens=EDGES, block_size=1)  # every boundary, every time
@example(tokens=[t for t in EDGES if t < 2**32] * 4, block_size=1)  # numpy: >= NUMPY_FROM ids
def test_encoder_is_cbor2_id_by_id(tokens: list[int], block_size: int) -> None:
    tokens = tokens[: len(tokens) - len(tokens) % block_size]
    ids, largest = blockhash_cbor.id_array(tokens, 2**64)
    assert ids.tolist() == tokens and largest == max(tokens, default=0)
    per_id = blockhash_cbor.encode_blocks_per_id(ids, block_size)
    expected = [cbor2.dumps(token) for token in tokens]
    ends = [sum(map(len, expected[: i + block_size])) for i in range(0, len(tokens), block_size)]
    assert per_id == (b"".join(expected), ends)
    if largest < blockhash_cbor.ITEM_IDS_BELOW:
        assert blockhash_cbor.encode_blocks(ids, block_size) == per_id


@PROPERTY
@given(
    tokens=token_ids(2**31, max_size=300),
    block_size=block_sizes,
    dtype=st.sampled_from([np.int64, np.uint64, np.int32, np.uint32]),
)
def test_numpy_and_tuple_inputs_hash_like_lists(
    tokens: list[int], block_size: int, dtype: type[np.integer]
) -> None:
    hasher = BlockHasher(HashSettings())
    expected = hasher.digests(tokens, block_size)
    assert hasher.digests(np.array(tokens, dtype=dtype), block_size) == expected
    assert hasher.digests(tuple(tokens), block_size) == expected
