"""The ``cache-indexer`` command: one entry point, one subcommand per process or tool.

Each subcommand lives in its own module with a ``main(argv: list[str]) -> int``; this
module only dispatches, importing the chosen module lazily so that ``cache-indexer hash``
does not pay for Falcon, the Kubernetes client or ZMQ.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "api": ("services.api.main", "serve POST /kv-cache/hit-rate under gunicorn"),
    "discovery": ("services.discovery.main", "find vLLM pods and Mooncake masters"),
    "l1-ingest": ("services.l1_ingest.main", "index vLLM GPU blocks from ZMQ KV events"),
    "l3-poll": ("services.l3_poller.main", "index Mooncake (L3) blocks by polling masters"),
    "simulate-vllm": ("services.simulator.main", "a vLLM KV-event publisher simulator"),
    "local-stack": ("services.tools.local_stack", "run the whole system locally"),
    "hash": ("services.tools.hash_cmd", "print vLLM block hashes of token ids on stdin"),
    "decode": ("services.tools.decode_cmd", "decode one KV-event payload on stdin"),
    "inspect": ("services.tools.inspect_cmd", "every instance's freshness, hash check and L3"),
    "audit": ("services.tools.audit_cmd", "hit-rate answers vs what the engines reused"),
}


def _usage() -> str:
    lines = ["usage: cache-indexer <command> [options]", "", "commands:"]
    lines += [f"  {name:<14} {doc}" for name, (_, doc) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"cache-indexer: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
