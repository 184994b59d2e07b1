"""Edges of the hasher that mutation testing (issue 33) found unpinned: the event checker's
:func:`~common.blockhash.chain_digests` contract, and ids at the CBOR width edges on the
paths that encode a whole chunk at once.

The reference is vLLM's chain spelled with cbor2 / pickle and hashlib (``test_blockhash.py``).
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest

from common.blockhash import BlockHasher, HashSettings, chain_digests
from tests.unit.test_blockhash import reference_digests

pytestmark = pytest.mark.usefixtures("hash_path")  # every test on every hashing path

ALGOS = ("sha256_cbor", "sha256")


def _serialize(algo: str, obj: object) -> bytes:
    if algo == "sha256":
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return bytes(cbor2.dumps(obj, canonical=True))


@pytest.mark.parametrize("algo", ALGOS)
def test_chain_digests_is_vllms_chain_from_the_given_parent(algo: str) -> None:
    parent = hashlib.sha256(b"a parent").digest()
    tokens = [2**64 - 1, 0, 2**32, 23, 24, 70_000, 5, 6]
    got = chain_digests(algo, parent, tokens, 4, [None, ("mm", "img", 0)])
    first = hashlib.sha256(_serialize(algo, (parent, tuple(tokens[:4]), None))).digest()
    second = hashlib.sha256(_serialize(algo, (first, tuple(tokens[4:]), ("mm", "img", 0)))).digest()
    assert got == [first, second]


@pytest.mark.parametrize("algo", ALGOS)
def test_chain_digests_refuses_fewer_tokens_than_blocks(algo: str) -> None:
    """The event checker's chain never hashes a short block: vLLM hashes full blocks only."""
    parent = hashlib.sha256(b"p").digest()
    with pytest.raises(ValueError, match="fewer tokens than blocks"):
        chain_digests(algo, parent, list(range(31)), 16, [None, None])
    with pytest.raises(ValueError, match="fewer tokens than blocks"):
        chain_digests(algo, parent, list(range(15)), 16, [None])
    assert len(chain_digests(algo, parent, list(range(32)), 16, [None, None])) == 2


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("bad", [2**64, 2**65, -1])
def test_chain_digests_refuses_an_id_past_uint64(algo: str, bad: int) -> None:
    """A ValueError (the checker counts a ``bad_tokens`` skip), never a digest nor another
    exception: no vLLM hashes an id of 2**64 or more."""
    parent = hashlib.sha256(b"p").digest()
    with pytest.raises(ValueError, match="token id"):
        chain_digests(algo, parent, [1, 2, 3, bad], 4, [None])


@pytest.mark.parametrize("edge", [2**32 - 1, 2**32, 2**32 + 1])
def test_a_chunk_whose_largest_id_is_at_the_nine_byte_edge(edge: int) -> None:
    """A chunk of at least ``NUMPY_FROM`` ids whose largest id is exactly 2**32 (the first that
    needs CBOR's 9-byte form) must take the per-id encoder, before vLLM 0.34 (uint64 ids)."""
    tokens = [*range(100), edge, *range(27)]  # 128 ids: 8 blocks of 16
    for salt in (None, "s"):
        for version in ((0, 28, 0), (0, 31, 0)):
            settings = HashSettings(vllm_version=version)
            got = BlockHasher(settings).digests(tokens, 16, salt)
            assert got == reference_digests(settings, tokens, 16, salt)
            preimage = BlockHasher(settings).preimages(tokens, 16, salt)[6]
            assert cbor2.loads(preimage)[1][4] == edge


@pytest.mark.parametrize("typecode", ["Q", "q", "L", "l", "I", "i", "H"])
@pytest.mark.parametrize("algo", ALGOS)
def test_machine_arrays_of_any_typecode_hash_like_lists(typecode: str, algo: str) -> None:
    """Only an ``array("Q")`` (the API's own conversion) may be read as uint64 words as is;
    an array of another width or sign is a sequence of ids like any other."""
    from array import array

    tokens = [(i * 7919) % 30_000 for i in range(200)]
    hasher = BlockHasher(HashSettings(algo=algo, vllm_version=(0, 34, 0)))
    expected = hasher.digests(tokens, 16)
    assert hasher.digests(array(typecode, tokens), 16) == expected
    assert hasher.digests(array(typecode, tokens[:40]), 16) == expected[:2]
    assert hasher.event_ints(array(typecode, tokens), 16, "s") == hasher.event_ints(tokens, 16, "s")
    parent = hashlib.sha256(b"p").digest()
    assert chain_digests(algo, parent, array(typecode, tokens[:32]), 16, [None, None]) == (
        chain_digests(algo, parent, tokens[:32], 16, [None, None])
    )


@pytest.mark.parametrize("typecode", ["q", "l", "i"])
@pytest.mark.parametrize("algo", ALGOS)
def test_a_negative_id_in_a_signed_array_is_refused(typecode: str, algo: str) -> None:
    from array import array

    hasher = BlockHasher(HashSettings(algo=algo))
    for where in (0, 17, 70):  # a hashed block, a later one, the partial block
        tokens = array(typecode, range(75))
        tokens[where] = -1
        with pytest.raises(ValueError, match="token id -1"):
            hasher.digests(tokens, 16)
    with pytest.raises(ValueError, match="token id -1"):
        chain_digests(algo, hashlib.sha256(b"p").digest(), array(typecode, [1, -1]), 2, [None])


@pytest.mark.parametrize("limit", [2**31, 2**64])
def test_id_array_of_every_kind_of_input_is_uint64_ids_and_their_largest(limit: int) -> None:
    """``id_array``'s contract (the numpy path and the event checker read its result as is):
    a uint64 array of exactly the ids, and the largest id (0 when there is none)."""
    from array import array

    import numpy as np

    from common.blockhash_cbor import id_array

    values = [5, 300, 70_000, 2**31 - 1]
    for tokens in ([], (), array("Q"), array("q"), np.zeros(0, np.int32)):
        ids, largest = id_array(tokens, limit)
        assert ids.dtype == np.uint64 and ids.shape == (0,) and largest == 0
    for kind in (list, tuple, lambda v: array("Q", v), lambda v: array("l", v), np.array):
        ids, largest = id_array(kind(values), limit)
        assert ids.dtype == np.uint64 and ids.tolist() == values and largest == 2**31 - 1


def test_an_api_array_is_range_checked_and_hashed_like_a_list() -> None:
    """The API hands ``array("Q")`` ids to the hasher: ids past the release's limit are
    refused, and ids needing CBOR's 9-byte form are hashed as in a list."""
    from array import array

    tokens = [*range(90), 2**40, 2**32, *range(36)]  # 128 ids, 8 blocks of 16
    old = BlockHasher(HashSettings(vllm_version=(0, 28, 0)))
    assert old.digests(array("Q", tokens), 16) == old.digests(tokens, 16)
    assert old.digests(array("Q", tokens), 16) == reference_digests(old.settings, tokens, 16)
    new = BlockHasher(HashSettings(vllm_version=(0, 34, 0)))
    for algo in ALGOS:
        hasher = BlockHasher(HashSettings(algo=algo, vllm_version=(0, 34, 0)))
        with pytest.raises(ValueError, match=r"token id 2147483648 is out of range"):
            hasher.digests(array("Q", [*range(100), 2**31]), 16)
    assert len(new.digests(array("Q", [*range(100), 2**31 - 1]), 16)) == 6


@pytest.mark.parametrize("algo", ALGOS)
def test_numpy_arrays_that_are_not_a_row_of_integer_ids_are_refused(algo: str) -> None:
    """A float array (vLLM rejects 1.0 as a token id) and a tokenizer's batch of shape
    (1, n) are refused, not hashed as if they were ids."""
    import numpy as np

    hasher = BlockHasher(HashSettings(algo=algo))
    for tokens in (np.ones(80, np.float64), np.arange(80, dtype=np.float32)):
        with pytest.raises(ValueError, match="is not an integer"):
            hasher.digests(tokens, 16)
    with pytest.raises(ValueError, match="is not an integer"):
        hasher.digests(np.arange(80, dtype=np.int64).reshape(1, 80), 16)
    assert len(hasher.digests(np.arange(80, dtype=np.int64), 16)) == 5


@pytest.mark.parametrize("algo", ALGOS)
def test_a_numpy_array_is_range_checked_like_a_list(algo: str) -> None:
    """vLLM >= 0.34 keeps ids as int32: 2**31 in a numpy array is refused as in a list."""
    import numpy as np

    hasher = BlockHasher(HashSettings(algo=algo, vllm_version=(0, 34, 0)))
    for dtype in (np.int64, np.uint64, np.uint32):
        tokens = np.arange(100, dtype=dtype)
        tokens[50] = 2**31
        with pytest.raises(ValueError, match=r"token id 2147483648 is out of range"):
            hasher.digests(tokens, 16)
        tokens[50] = 2**31 - 1
        assert hasher.digests(tokens, 16) == hasher.digests(tokens.tolist(), 16)


EVENT_KEYS = [
    (-1,),
    (-24, -25, -256, -257, -65537, -(2**32) - 1, -(2**64)),
    (0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1),
    (True, False, None),
    (b"", b"\x00" * 23, b"\xff" * 24, b"x" * 256),
    ("", "a" * 24, "租户-α🦙"),
    (("mm", "img", 0), ("lora", "ad", "/p"), ((1, (2, (3,))),)),
    tuple(range(30)),
]


@pytest.mark.parametrize("extra", EVENT_KEYS)
def test_event_extra_keys_of_every_cbor_shape_are_serialized_as_cbor2_does(
    extra: tuple[object, ...],
) -> None:
    """The event checker hashes the extra keys an event states: ints of either sign, bytes,
    bools, None, str and nested tuples, each as ``cbor2.dumps(canonical=True)``."""
    parent = hashlib.sha256(b"p").digest()
    tokens = [1, 2, 3, 4]
    want = hashlib.sha256(_serialize("sha256_cbor", (parent, tuple(tokens), extra))).digest()
    assert chain_digests("sha256_cbor", parent, tokens, 4, [extra]) == [want]


@pytest.mark.parametrize(("key", "named"), [(1.5, "float"), ([1], "list"), ({"a": 1}, "dict")])
def test_an_extra_key_cbor_cannot_hash_is_refused_naming_its_type(key: object, named: str) -> None:
    parent = hashlib.sha256(b"p").digest()
    with pytest.raises(ValueError, match=f"cannot hash {named} extra key"):
        chain_digests("sha256_cbor", parent, [1, 2], 2, [(key,)])


@pytest.mark.parametrize("key", [2**64, -(2**64) - 1])
def test_an_int_key_past_cbors_heads_is_refused(key: int) -> None:
    parent = hashlib.sha256(b"p").digest()
    with pytest.raises(ValueError, match="does not fit in a CBOR head"):
        chain_digests("sha256_cbor", parent, [1, 2], 2, [(key,)])


@pytest.mark.parametrize("version", [(0, 28, 0), (0, 34, 0)])
def test_an_empty_prompt_has_no_blocks_on_every_release(version: tuple[int, int, int]) -> None:
    """vLLM >= 0.34 checks ids against 2**31: an empty prompt has none to check."""
    from array import array

    import numpy as np

    for algo in ALGOS:
        hasher = BlockHasher(HashSettings(algo=algo, vllm_version=version))
        for tokens in ([], array("Q"), np.zeros(0, np.int64)):
            assert hasher.digests(tokens, 16) == []
            assert hasher.member_keys(tokens, 16, "s") == []
