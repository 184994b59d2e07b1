"""``cache-indexer hash``: print vLLM block hashes of the token ids on stdin.

    echo '[1, 2, 3, ...]' | cache-indexer hash --block-size 16 [--seed 0 | --no-seed]
        [--algo sha256_cbor|sha256] [--cache-salt S] [--lora-name NAME --lora-path PATH]
        [--mm-feature IDENTIFIER:OFFSET:LENGTH ...] [--lookahead L]
        [--vllm-version 0.28.0] [--hex]

stdin is a JSON array of token ids, or a JSON object with the hit-rate request body's fields
(``token_ids``, and optionally ``block_size``, ``cache_salt``, ``lora_name``, ``lora_path``,
``mm_features``: a list of ``{"identifier", "offset", "length"}``) plus ``lookahead`` (the
instance's speculative-decoding L, vLLM >= 0.33). A value may be given as a flag or in the
document, not both. Prints a JSON array of the event integers (what BlockStored carries), or
of 64-hex digests with ``--hex``. A bad flag or bad input prints one line on stderr and
exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from common.blockhash import ALGOS, BlockHasher, HashInputs, HashSettings, MmItem
from common.errors import ConfigError

_DOC_FIELDS = (
    "token_ids",
    "block_size",
    "cache_salt",
    "lora_name",
    "lora_path",
    "mm_features",
    "lookahead",
)
_ITEM_FIELDS = ("identifier", "offset", "length", "modality")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cache-indexer hash",
        description="Print vLLM block hashes of a JSON array of token ids read on stdin.",
    )
    parser.add_argument("--block-size", type=int, help="tokens per block (or block_size on stdin)")
    seed = parser.add_mutually_exclusive_group()
    seed.add_argument("--seed", default="0", help='the engine\'s PYTHONHASHSEED (default "0")')
    seed.add_argument(
        "--no-seed", action="store_true", help="PYTHONHASHSEED unset (needs vLLM >= 0.29)"
    )
    parser.add_argument("--algo", choices=ALGOS, default="sha256_cbor")
    parser.add_argument("--cache-salt", help="the request's cache_salt")
    parser.add_argument("--lora-name", help="the LoRA adapter's name")
    parser.add_argument("--lora-path", help="the LoRA adapter's path (vLLM >= 0.31)")
    parser.add_argument(
        "--mm-feature",
        action="append",
        metavar="IDENTIFIER:OFFSET:LENGTH",
        help="a multimodal item (repeatable): the identifier vLLM hashes and its token range",
    )
    parser.add_argument(
        "--lookahead", type=int, help="speculative-decoding lookahead tokens L (vLLM >= 0.33)"
    )
    parser.add_argument("--vllm-version", default="0.28.0", help="default 0.28.0")
    parser.add_argument("--hex", action="store_true", help="print 64-hex digests instead")
    return parser


def _read_document(text: str) -> dict[str, Any]:
    """stdin as a document: a bare array is ``{"token_ids": array}``."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"stdin is not JSON: {exc}") from None
    if isinstance(doc, list):
        doc = {"token_ids": doc}
    shape = "stdin must be a JSON array of integer token ids or an object with token_ids"
    if not isinstance(doc, dict) or "token_ids" not in doc:
        raise ValueError(shape)
    unknown = sorted(set(doc) - set(_DOC_FIELDS))
    if unknown:
        raise ValueError(f"{shape} (unknown field {unknown[0]!r})")
    tokens = doc["token_ids"]
    if not isinstance(tokens, list) or not all(
        type(token) is int
        for token in tokens  # JSON true/1.0 are not token ids
    ):
        raise ValueError(shape)
    return doc


def _merge(args: argparse.Namespace, doc: dict[str, Any]) -> dict[str, Any]:
    """Flags and document fields in one dict; a value given both ways is an error."""
    flags = {
        "block_size": args.block_size,
        "cache_salt": args.cache_salt,
        "lora_name": args.lora_name,
        "lora_path": args.lora_path,
        "mm_features": _flag_items(args.mm_feature),
        "lookahead": args.lookahead,
    }
    merged = dict(doc)
    for name, value in flags.items():
        if value is None:
            continue
        if doc.get(name) is not None:
            raise ValueError(f"{name} is given both as a flag and on stdin")
        merged[name] = value
    if merged.get("block_size") is None:
        raise ValueError("--block-size is required (or block_size in the JSON document)")
    return merged


def _flag_items(values: list[str] | None) -> list[dict[str, Any]] | None:
    if not values:
        return None
    items = []
    for value in values:
        identifier, _, numbers = value.rpartition(":")
        identifier, _, offset = identifier.rpartition(":")
        try:
            items.append({"identifier": identifier, "offset": int(offset), "length": int(numbers)})
        except ValueError:
            raise ValueError(f"--mm-feature {value!r} is not IDENTIFIER:OFFSET:LENGTH") from None
    return items


def _inputs(fields: dict[str, Any]) -> HashInputs:
    raw = fields.get("mm_features") or []
    if not isinstance(raw, list):
        raise ValueError("mm_features must be a list of objects")
    items = []
    for i, item in enumerate(raw):
        if (
            not isinstance(item, dict)
            or set(item) - set(_ITEM_FIELDS)
            or any(name not in item for name in _ITEM_FIELDS[:3])
        ):
            raise ValueError(f"mm_features[{i}] must be an object with identifier, offset, length")
        items.append(MmItem(item["identifier"], item["offset"], item["length"]))
    return HashInputs(
        lora_name=fields.get("lora_name"),
        lora_path=fields.get("lora_path"),
        mm_items=tuple(items),
        lookahead=fields.get("lookahead") or 0,
    )


def main(argv: list[str], stdin: TextIO | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return exc.code if isinstance(exc.code, int) else 2
    try:
        seed = None if args.no_seed else args.seed
        hasher = BlockHasher(HashSettings.from_strings(args.algo, seed, args.vllm_version))
        fields = _merge(args, _read_document((stdin or sys.stdin).read()))
        tokens, block_size, salt = (
            fields["token_ids"],
            fields["block_size"],
            fields.get("cache_salt"),
        )
        if salt is not None and not isinstance(salt, str):
            raise ValueError("cache_salt must be a string")
        inputs = _inputs(fields)
        if args.hex:
            result: list[int] | list[str] = [
                digest.hex() for digest in hasher.digests(tokens, block_size, salt, inputs=inputs)
            ]
        else:
            result = hasher.event_ints(tokens, block_size, salt, inputs=inputs)
    except (ConfigError, ValueError) as exc:
        print(f"cache-indexer hash: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
