"""The C block encoder and chain (common/_cbor_blocks.c through common/blockhash_native.py).

Its output is checked bit for bit by every test of test_blockhash.py and
test_blockhash_properties.py, which run on each hashing path (the ``hash_path`` fixture).
Here: the guards around it — the start-up self-test that refuses SHA-256 functions that do
not agree with hashlib, the switch that turns it off, and what a process says it uses.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import shutil
import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest

from common import blockhash_native as native
from common.blockhash import BlockHasher, HashInputs, HashSettings, MmItem
from tests.conftest import ROOT, require


def _encoder() -> native.Encoder:
    require(
        native.ENCODER is not None,
        f"the C block encoder is not built ({native.status()}); run scripts/setup.sh",
    )
    assert native.ENCODER is not None
    return native.ENCODER


def test_the_built_library_hashes_in_c_and_says_so() -> None:
    encoder = _encoder()
    require(encoder.sha is not None, f"no SHA-256 from libcrypto: {native.status()}")
    assert "C encoder and chain" in native.status()
    assert "libcrypto" in encoder.sha_source


def test_self_test_refuses_sha_functions_that_disagree_with_hashlib(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SHA-224's functions have SHA-256's signatures but other digests: the chain must not
    be used with them (the process falls back to hashlib per block)."""
    encoder = _encoder()
    require(encoder.sha is not None, f"no libcrypto SHA-256: {native.status()}")
    lib = ctypes.CDLL(encoder.sha_source)
    wrong = tuple(
        ctypes.cast(f, ctypes.c_void_p).value or 0
        for f in (lib.SHA224_Init, lib.SHA224_Update, lib.SHA224_Final)
    )
    monkeypatch.setattr(native, "_openssl_sha256", lambda: (wrong, encoder.sha_source))
    refused = native.Encoder(encoder.path)
    assert refused.sha is None
    assert "disagreed with hashlib" in refused.sha_source
    with pytest.raises(RuntimeError, match="no SHA-256"):
        refused.chain(np.zeros(16, np.uint64), 16, b"\xf6", b"\xf6", bytes(32))
    monkeypatch.setattr(native, "ENCODER", refused)
    assert "SHA-256 by hashlib per block" in native.status()
    assert "disagreed" in native.status()


def test_chain_and_per_block_hashing_agree_across_chunks() -> None:
    """A prompt of several 8,192-id chunks with ids of every CBOR width, 2**64 - 1 included:
    the C chain (chunk by chunk, each chained from the last) against the preimages hashed
    one by one in Python."""
    encoder = _encoder()
    require(encoder.sha is not None, f"no libcrypto SHA-256: {native.status()}")
    rng = random.Random(12)
    widths = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
    tokens = [
        rng.choice(widths) if rng.random() < 0.3 else rng.randrange(151_936)
        for _ in range(3 * 8192 + 77)
    ]
    hasher = BlockHasher(HashSettings(vllm_version=(0, 31, 0)))
    digests = hasher.digests(tokens, 48, cache_salt="salt", lora_name="a", lora_path="/p")
    preimages = hasher.preimages(tokens, 48, cache_salt="salt", lora_name="a", lora_path="/p")
    assert digests == [hashlib.sha256(p).digest() for p in preimages]
    assert len(digests) == len(tokens) // 48


@pytest.mark.parametrize("value", ["1", "yes"])
def test_the_switch_turns_it_off(value: str) -> None:
    env = {**os.environ, native.DISABLE_ENV: value, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from common import blockhash_native as n; print(n.ENCODER is None); print(n.status())",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.splitlines()
    assert out[0] == "True"
    assert native.DISABLE_ENV in out[1]


def test_chain_takes_strided_and_other_dtype_arrays() -> None:
    """A non-contiguous or non-uint64 numpy array is copied (and kept alive) for the call."""
    encoder = _encoder()
    require(encoder.sha is not None, f"no libcrypto SHA-256: {native.status()}")
    ids = np.arange(0, 4 * 300, dtype=np.uint64) * 977 % 151_936
    parent = hashlib.sha256(b"p").digest()
    want = encoder.chain(np.ascontiguousarray(ids[::4]), 20, b"\xf6", b"\xf6", parent)
    assert len(want) == 32 * 15
    assert encoder.chain(ids[::4], 20, b"\xf6", b"\xf6", parent) == want
    assert encoder.chain(ids[::4].astype(np.int64), 20, b"\xf6", b"\xf6", parent) == want
    assert encoder.chain(array("Q", ids[::4].tolist()), 20, b"\xf6", b"\xf6", parent) == want


def test_member_keys_in_c_match_python_formatting() -> None:
    encoder = _encoder()
    edges = [0, 1, 9, 10, 99, 100, 2**32, 10**19 - 1, 10**19, 2**64 - 1]
    rng = random.Random(3)
    values = edges + [rng.getrandbits(64) for _ in range(500)]
    digests = b"".join(rng.randbytes(24) + v.to_bytes(8, "big") for v in values)
    assert encoder.member_keys(digests) == [b"%d" % v for v in values]
    assert encoder.member_keys(b"") == []


def test_chain_with_per_block_tails_matches_hashlib() -> None:
    """ABI 2: every block ends with its own tail (LoRA, multimodal, lookahead keys)."""
    encoder = _encoder()
    require(encoder.sha is not None, f"no libcrypto SHA-256: {native.status()}")
    require(
        encoder.block_tails,
        "the built C library predates per-block tails (ABI 2): rebuild common/_cbor_blocks.c "
        "(pip install -e ., or scripts/setup.sh)",
    )
    rng = random.Random(31)
    ids = np.array([rng.randrange(2**20) for _ in range(16 * 9 + 3)], np.uint64)
    tails = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(9)]
    parent = hashlib.sha256(b"p").digest()
    got = encoder.chain(ids, 16, b"", b"", parent, tails)
    want, link = b"", parent
    for b, tail in enumerate(tails):
        buffer, ends = encoder.preimages(ids[16 * b : 16 * b + 16], 16, tail, tail)
        buffer[native.PARENT_AT : native.PARENT_AT + 32] = link
        link = hashlib.sha256(buffer[: ends[0]]).digest()
        want += link
    assert got == want
    with pytest.raises(RuntimeError, match="one tail per block"):
        encoder.chain(ids, 16, b"", b"", parent, tails[:-1])


@pytest.mark.parametrize("mutation", ["no_abi", "tails_ignored"])
def test_a_library_that_cannot_take_block_tails_is_not_given_any(
    tmp_path: Path, mutation: str
) -> None:
    """A library built from an older _cbor_blocks.c (no ci_abi_version) or one that claims
    ABI 2 but ignores the tails is never given per-block tails: keyed requests then hash in
    Python, still exactly."""
    cc = shutil.which("cc")
    require(cc is not None, "no C compiler to build a mutated library")
    assert cc is not None
    source = (ROOT / "common" / "_cbor_blocks.c").read_text()
    if mutation == "no_abi":
        source = source.replace("int ci_abi_version(void)", "static int unused_abi(void)")
    else:
        source = source.replace("if (tails && tail_ends) {", "if (0) {")
    (tmp_path / "lib.c").write_text(source)
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp_path / "lib.so"), str(tmp_path / "lib.c")],
        check=True,
    )
    mutated = native.Encoder(str(tmp_path / "lib.so"))
    require(mutated.sha is not None, f"no libcrypto SHA-256: {native.status()}")
    assert mutated.block_tails is False
    hasher = BlockHasher(HashSettings(vllm_version=(0, 34, 0)))
    inputs = HashInputs("a", "/p", (MmItem("img", 20, 30),))
    tokens = list(range(100))
    want = hasher.digests(tokens, 16, inputs=inputs)
    saved = native.ENCODER
    native.ENCODER = mutated
    try:
        assert hasher.digests(tokens, 16, inputs=inputs) == want
        assert hasher.digests(tokens, 16) == BlockHasher(hasher.settings).digests(tokens, 16)
    finally:
        native.ENCODER = saved
