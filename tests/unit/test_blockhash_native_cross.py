"""The C block encoder on other CPUs: aarch64 (Ascend hosts) and s390x (big-endian).

``common/_cbor_blocks.c`` is compiled with Debian's cross compilers into a small test program
and run under qemu's user-mode emulator. The program reads ids, block size and tails from
stdin, writes ``ci_block_preimages``' bytes and ends and ``ci_decimal_keys``' output, and the
test compares them with cbor2's canonical encoding and Python's decimal formatting. (The
SHA-256 of the chain is libcrypto's, not this file's, so it is not cross-tested; the chain's
C is the same code path on every CPU.) ``scripts/setup.sh`` installs the compilers and qemu.
"""

from __future__ import annotations

import random
import shutil
import struct
import subprocess
from pathlib import Path

import cbor2
import pytest

from tests.conftest import ROOT, require

SOURCE = ROOT / "common" / "_cbor_blocks.c"
TARGETS = {"aarch64": "aarch64-linux-gnu-gcc", "s390x": "s390x-linux-gnu-gcc"}

MAIN = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
size_t ci_block_preimages(const uint64_t *, size_t, size_t, const uint8_t *, size_t,
                          const uint8_t *, size_t, uint8_t *, size_t, uint64_t *);
size_t ci_decimal_keys(const uint8_t *, size_t, uint8_t *);
/* stdin, big-endian u64 words: n_ids, block_size, first_tail_len, tail_len, ids..., then
 * the tails' bytes, then n_digests and 32 bytes per digest. */
static uint64_t word(void) {
    unsigned char b[8]; uint64_t v = 0;
    if (fread(b, 1, 8, stdin) != 8) exit(3);
    for (int i = 0; i < 8; i++) v = v << 8 | b[i];
    return v;
}
int main(void) {
    uint64_t n = word(), bs = word(), ftl = word(), tl = word();
    uint64_t *ids = malloc(8 * (n + 1));
    for (uint64_t i = 0; i < n; i++) ids[i] = word();
    uint8_t *ft = malloc(ftl + 1), *t = malloc(tl + 1);
    if (fread(ft, 1, ftl, stdin) != ftl || fread(t, 1, tl, stdin) != tl) return 3;
    uint64_t blocks = n / bs, cap = blocks * (52 + 9 * bs + ftl + tl) + 8;
    uint8_t *out = malloc(cap); uint64_t *ends = malloc(8 * (blocks + 1));
    size_t written = ci_block_preimages(ids, blocks, bs, ft, ftl, t, tl, out, cap, ends);
    uint64_t digests = word();
    uint8_t *d = malloc(32 * digests + 1), *keys = malloc(21 * digests + 1);
    if (fread(d, 1, 32 * digests, stdin) != 32 * digests) return 3;
    /* out: "<ends...>\n<keys>\n<preimage bytes>" */
    for (uint64_t b = 0; b < blocks; b++) printf("%llu ", (unsigned long long)ends[b]);
    printf("\n");
    fwrite(keys, 1, ci_decimal_keys(d, digests, keys), stdout);
    printf("\n");
    fwrite(out, 1, written, stdout);
    return 0;
}
"""


@pytest.fixture(scope="module", params=sorted(TARGETS))
def program(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    """(the qemu emulator, the test program built for its CPU)."""
    arch = request.param
    compiler, emulator = TARGETS[arch], f"qemu-{arch}"
    require(
        shutil.which(compiler) and shutil.which(emulator),
        f"{compiler} and {emulator} are needed (Debian: gcc-{arch}-linux-gnu, qemu-user)",
    )
    work = tmp_path_factory.mktemp(arch)
    (work / "main.c").write_text(MAIN)
    binary = work / "encode"
    subprocess.run(
        [
            compiler,
            "-O2",
            "-static",
            "-Wall",
            "-Werror",
            "-o",
            str(binary),
            str(work / "main.c"),
            str(SOURCE),
        ],
        check=True,
    )
    return emulator, binary


def _run(
    program: tuple[str, Path],
    ids: list[int],
    block_size: int,
    first: bytes,
    tail: bytes,
    digests: bytes,
) -> tuple[bytes, list[int], list[bytes]]:
    words = [len(ids), block_size, len(first), len(tail), *ids]
    stdin = (
        struct.pack(f">{len(words)}Q", *words)
        + first
        + tail
        + struct.pack(">Q", len(digests) // 32)
        + digests
    )
    emulator, binary = program
    out = subprocess.run(
        [emulator, str(binary)], input=stdin, capture_output=True, check=True, timeout=60
    ).stdout
    ends, keys, body = out.split(b"\n", 2)
    return body, [int(e) for e in ends.split()], keys.split()


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_preimages_and_keys_on_other_cpus(program: tuple[str, Path], block_size: int) -> None:
    rng = random.Random(block_size)
    edges = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
    ids = [
        rng.choice(edges) if rng.random() < 0.3 else rng.randrange(151_936)
        for _ in range(block_size * 5 + 3)
    ]
    first, tail = cbor2.dumps(("salt",), canonical=True), cbor2.dumps(None)
    values = edges + [rng.getrandbits(64) for _ in range(50)]
    digests = b"".join(rng.randbytes(24) + v.to_bytes(8, "big") for v in values)
    body, ends, keys = _run(program, ids, block_size, first, tail, digests)
    want, expected_ends = b"", []
    for b in range(len(ids) // block_size):
        extra = ("salt",) if b == 0 else None
        block = tuple(ids[b * block_size : (b + 1) * block_size])
        want += cbor2.dumps((bytes(32), block, extra), canonical=True)
        expected_ends.append(len(want))
    assert body == want
    assert ends == expected_ends
    assert keys == [b"%d" % v for v in values]
