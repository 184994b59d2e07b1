"""``cache-indexer hash``: print vLLM block hashes of a JSON array of token ids on stdin.

    echo '[1, 2, 3, ...]' | cache-indexer hash --block-size 16 [--seed 0 | --no-seed]
        [--algo sha256_cbor|sha256] [--cache-salt S] [--lora-name NAME --lora-path PATH]
        [--vllm-version 0.28.0] [--hex]

Prints a JSON array of the event integers (what BlockStored carries), or of 64-hex digests
with ``--hex``. A bad flag or bad input prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from common.blockhash import ALGOS, BlockHasher, HashSettings
from common.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cache-indexer hash",
        description="Print vLLM block hashes of a JSON array of token ids read on stdin.",
    )
    parser.add_argument("--block-size", type=int, required=True, help="tokens per block")
    seed = parser.add_mutually_exclusive_group()
    seed.add_argument("--seed", default="0", help='the engine\'s PYTHONHASHSEED (default "0")')
    seed.add_argument(
        "--no-seed", action="store_true", help="PYTHONHASHSEED unset (needs vLLM >= 0.29)"
    )
    parser.add_argument("--algo", choices=ALGOS, default="sha256_cbor")
    parser.add_argument("--cache-salt", help="the request's cache_salt")
    parser.add_argument("--lora-name", help="the LoRA adapter's name")
    parser.add_argument("--lora-path", help="the LoRA adapter's path (vLLM >= 0.31)")
    parser.add_argument("--vllm-version", default="0.28.0", help="default 0.28.0")
    parser.add_argument("--hex", action="store_true", help="print 64-hex digests instead")
    return parser


def _read_tokens(text: str) -> list[int]:
    try:
        tokens = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"stdin is not JSON: {exc}") from None
    if not isinstance(tokens, list) or not all(
        type(token) is int
        for token in tokens  # JSON true/1.0 are not token ids
    ):
        raise ValueError("stdin must be a JSON array of integer token ids")
    return tokens


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return exc.code if isinstance(exc.code, int) else 2
    try:
        seed = None if args.no_seed else args.seed
        hasher = BlockHasher(HashSettings.from_strings(args.algo, seed, args.vllm_version))
        tokens = _read_tokens(sys.stdin.read())
        keys = (args.cache_salt, args.lora_name, args.lora_path)
        if args.hex:
            result: list[int] | list[str] = [
                digest.hex() for digest in hasher.digests(tokens, args.block_size, *keys)
            ]
        else:
            result = hasher.event_ints(tokens, args.block_size, *keys)
    except (ConfigError, ValueError) as exc:
        print(f"cache-indexer hash: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
