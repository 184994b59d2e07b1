"""Write block-hash vectors computed by vLLM's own code, for tests/data/vllm_hash_vectors.json.

Run it with the python of a throwaway venv that can import vLLM's hashing modules (see
scripts/setup_vllm_bench_venv.sh); with PYTHONPATH pointing at an unpacked wheel's source
tree the same venv serves other releases::

    PYTHONPATH=/tmp/vw/src-0.34.0 /tmp/vllm-venv/bin/python \
        scripts/make_vllm_hash_vectors.py tests/data/vllm_hash_vectors.json

It adds (or replaces) the imported release's cases in the given JSON file, or prints them
when no file is given. Never imported by the project.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout

from vllm import __version__ as vllm_version
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256, sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

TOKENS = list(range(100_000, 100_040)) + [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1]
LORA = ("sql-lora", "/adapters/sql-lora")
CASES = [  # name, seed, algo, block_size, cache_salt, lora
    ("plain", "0", "sha256_cbor", 16, None, None),
    ("bs3", "0", "sha256_cbor", 3, None, None),
    ("salt", "0", "sha256_cbor", 16, "s", None),
    ("salt_unicode", "0", "sha256_cbor", 16, "租户-α🦙", None),
    ("lora", "0", "sha256_cbor", 16, None, LORA),
    ("lora_salt", "0", "sha256_cbor", 16, "tenant-a", LORA),
    ("empty_seed", "", "sha256_cbor", 16, None, None),
    ("no_seed", None, "sha256_cbor", 16, None, None),
    ("pickle_lora_salt", "0", "sha256", 16, "tenant-a", LORA),
    ("pickle_no_seed", None, "sha256", 16, None, None),
]


def _case(
    name: str,
    seed: str | None,
    algo: str,
    block_size: int,
    salt: str | None,
    lora: tuple[str, str] | None,
) -> dict[str, object]:
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    hash_fn = sha256 if algo == "sha256" else sha256_cbor
    kv_cache_utils.init_none_hash(hash_fn)  # reads PYTHONHASHSEED now
    first = bytes(kv_cache_utils.NONE_HASH)
    kv_cache_utils.init_none_hash(hash_fn)
    if bytes(kv_cache_utils.NONE_HASH) != first:  # unset seed before 0.29: random per init
        return {"name": name, "seed": seed, "algo": algo, "deterministic": False}
    hasher = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
    lora_request = LoRARequest(lora[0], 1, lora[1]) if lora else None
    request = Request(
        name,
        TOKENS,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=hasher,
        cache_salt=salt,
        lora_request=lora_request,
    )
    return {
        "name": name,
        "seed": seed,
        "algo": algo,
        "block_size": block_size,
        "cache_salt": salt,
        "lora_name": lora and lora[0],
        "lora_path": lora and lora[1],
        "token_ids": TOKENS,
        "deterministic": True,
        "none_hash_hex": bytes(kv_cache_utils.NONE_HASH).hex(),
        "block_hashes_hex": [bytes(block_hash).hex() for block_hash in request.block_hashes],
    }


ABOUT = (
    "Block hashes computed by vLLM's own code (get_request_block_hasher on a real Request, "
    "init_none_hash) from the PyPI wheels, with no engine, by scripts/make_vllm_hash_vectors.py "
    "(see docs/benchmarks.md). Complements vllm_golden.json with 0.31/0.34 (tagged extra keys, "
    "default seed). A case with deterministic=false had a random NONE_HASH in that release."
)


def main(argv: list[str]) -> int:
    cases = [_case(*case) for case in CASES]
    if not argv:
        print(json.dumps({vllm_version: cases}, ensure_ascii=False))
        return 0
    path = argv[0]
    data = {"about": ABOUT, "versions": {}}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    data["versions"][vllm_version] = cases
    data["versions"] = dict(sorted(data["versions"].items()))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{path}: vLLM {vllm_version}, {len(cases)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
