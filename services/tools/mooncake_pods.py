"""Simulated vLLM / vllm-ascend pods writing KV blocks into a real Mooncake store (local
stack, demos).

``cache-indexer``'s L3 poller reads what vLLM's ``MooncakeStoreConnector`` or vllm-ascend's
``AscendStoreConnector`` writes. Without GPUs/NPUs, this module plays the connector: one
``MooncakeDistributedStore`` client per pod IP (its segment is named ``<ip>:<port>``, as
vLLM's and vllm-ascend's are) puts one small value per block and rank namespace under the
engine's key — vLLM ``{model}@tp_rank:{r}@pcp0@dcp0@pp_rank:0@group:0@{hash hex}``,
vllm-ascend ``{model}@pcp0@dcp0@head_or_tp_rank:{r}@pp_rank:0@{hash hex}`` (or another
layout, layer-wise: one key per layer) — pinned to its own segment with
``preferred_segment`` so that "which pod holds it" is deterministic.

Store clients listen on every interface, so run this only inside a private network
namespace (the local stack starts it under ``unshare -n``).

    python -m services.tools.mooncake_pods --ip 127.0.0.2 --master 127.0.0.1:50051 \\
        --blocks FILE      # JSON: {"model": "...", "tp": 1, "hashes": ["<64 hex>", ...],
                           #  optional "engine": "vllm-ascend", "form": "A", "layers": 24}
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading

from common import logs
from common.lifecycle import install_signal_handlers
from services.simulator.ascend import ascend_store_key

logger = logging.getLogger(__name__)


def vllm_store_key(model: str, tp_rank: int, digest_hex: str, group: int = 0) -> str:
    """vLLM ≥ 0.22 MooncakeStoreConnector key of one block of one rank namespace."""
    return f"{model}@tp_rank:{tp_rank}@pcp0@dcp0@pp_rank:0@group:{group}@{digest_hex}"


def block_keys(spec: dict[str, object], digest_hex: str) -> list[str]:
    """Every key the engine of ``spec`` writes for one block (all ranks, all layers)."""
    model, tp = str(spec["model"]), int(spec.get("tp", 1))  # type: ignore[call-overload]
    if spec.get("engine", "vllm") != "vllm-ascend":
        return [vllm_store_key(model, rank, digest_hex) for rank in range(tp)]
    form = str(spec.get("form", "A"))
    layers = range(int(spec.get("layers", 1))) if form.endswith("LW") else range(1)  # type: ignore[call-overload]
    return [
        ascend_store_key(model, head, digest_hex, form=form, layer=layer)
        for head in range(tp)
        for layer in layers
    ]


def put_blocks(store: object, segment: str, spec: dict[str, object]) -> int:
    """Put every key of each block of ``spec``; returns how many puts failed."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.preferred_segment = segment
    failed = 0
    for digest_hex in spec["hashes"]:  # type: ignore[attr-defined]
        for key in block_keys(spec, digest_hex):
            rc = store.put(key, b"kv" * 64, config)  # type: ignore[attr-defined]
            failed += rc != 0
    return failed


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m services.tools.mooncake_pods")
    p.add_argument("--ip", required=True, help="the pod IP this client's segment is named after")
    p.add_argument("--master", required=True, help="Mooncake master RPC address host:port")
    p.add_argument(
        "--blocks",
        required=True,
        help="JSON file: model, tp, hashes (64-hex)[, engine, form, layers]",
    )
    args = p.parse_args(argv)
    logs.configure("info")
    from mooncake.store import MooncakeDistributedStore

    spec = json.loads(open(args.blocks, encoding="utf-8").read())
    store = MooncakeDistributedStore()
    rc = store.setup(args.ip, "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", args.master)
    if rc != 0:
        logger.error("store client setup for %s failed: rc=%s", args.ip, rc)
        return 1
    segment = store.get_hostname()
    failed = put_blocks(store, segment, spec)
    logger.info(
        "pod %s (segment %s): put %d blocks, %d failures",
        args.ip,
        segment,
        len(spec["hashes"]),
        failed,
    )
    print("ready", flush=True)
    stop = threading.Event()
    install_signal_handlers(stop)
    stop.wait()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
