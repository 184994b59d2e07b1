"""Capture KV-event payloads made by vLLM's own KVCacheManager / BlockPool and sent by its own
ZmqEventPublisher, hashed with a non-default PYTHONHASHSEED, for tests/data/.

Run it with the python of a throwaway venv that has vLLM installed (no GPU, no engine)::

    PYTHONHASHSEED=1 /tmp/vllm-venv/bin/python scripts/make_vllm_event_vectors.py \
        tests/data/vllm_event_vectors.json

For each hash algo it builds a one-group full-attention KVCacheManager (events enabled,
a small pool so blocks get evicted), hashes requests with ``get_request_block_hasher`` after
``init_none_hash`` (which reads PYTHONHASHSEED, here "1"), schedules a few requests (plain,
shared prefix, salted, LoRA, evicting), publishes each step's ``take_events()`` as a
``KVEventBatch`` through a real ``ZmqEventPublisher`` and records the ``[topic, seq, payload]``
frames received by a SUB socket bound on loopback (vLLM connects a non-wildcard endpoint).
The JSON keeps the frames and the settings; the tests never import vLLM. Never imported by
the project.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout
SEED = os.environ.setdefault("PYTHONHASHSEED", "1")

import torch  # noqa: E402
import zmq  # noqa: E402
from vllm import __version__ as vllm_version  # noqa: E402
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256, sha256_cbor  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402

from bench_util import free_port  # noqa: E402  (the script's own directory is on sys.path)

BLOCK_SIZE = 16
NUM_BLOCKS = 12
TOPIC = "kv-events"
PREFIX = list(range(1000, 1032))  # two blocks shared by A and C


def _manager() -> KVCacheManager:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=1024,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
        enable_kv_cache_events=True,
    )


def _requests(hasher: object) -> list[Request]:
    lora = LoRARequest("sql-lora", 1, "/adapters/sql-lora")
    specs = [  # id, tokens, salt, lora
        ("A", PREFIX + list(range(5000, 5010)), None, None),
        ("B", list(range(7000, 7048)), "tenant-a", None),
        ("C", PREFIX + list(range(6000, 6020)), None, None),
        ("D", list(range(8000, 8040)), None, lora),
        ("E", list(range(9000, 9100)), None, None),  # evicts most of the pool
    ]
    return [
        Request(
            rid,
            tokens,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=hasher,
            cache_salt=salt,
            lora_request=lr,
        )  # type: ignore[arg-type]
        for rid, tokens, salt, lr in specs
    ]


def _join(publisher: ZmqEventPublisher, sub: zmq.Socket[bytes]) -> None:
    """Slow joiner (spec §1.2; here the first batch is lost every time): publish empty
    batches until one arrives, so that none of the recorded ones is lost."""
    for _ in range(100):
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        if sub.poll(100):
            while sub.poll(200):
                sub.recv_multipart()
            return
    raise SystemExit("the publisher never reached the SUB socket")


def _capture(algo: str) -> dict[str, object]:
    hash_fn = sha256 if algo == "sha256" else sha256_cbor
    kv_cache_utils.init_none_hash(hash_fn)  # reads PYTHONHASHSEED now
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, hash_fn)
    manager = _manager()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = free_port()
    sub.bind(f"tcp://127.0.0.1:{port}")
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{port}", topic=TOPIC)
    _join(publisher, sub)
    steps = []
    for request in _requests(hasher):
        computed, n_computed = manager.get_computed_blocks(request)[:2]
        blocks = manager.allocate_slots(
            request, request.num_tokens - n_computed, n_computed, computed
        )
        assert blocks is not None, f"request {request.request_id} did not fit"
        events = manager.take_events()
        manager.free(request)
        if events:
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
            steps.append(request.request_id)
    frames = []
    for _ in steps:
        if not sub.poll(5000):
            raise SystemExit("the publisher sent fewer batches than published")
        topic, seq, payload = sub.recv_multipart()
        frames.append(
            {
                "topic": topic.decode(),
                "seq": int.from_bytes(seq, "big"),
                "payload_hex": payload.hex(),
            }
        )
    publisher.shutdown()
    sub.close(linger=0)
    return {
        "algo": algo,
        "python_hash_seed": SEED,
        "block_size": BLOCK_SIZE,
        "requests": steps,
        "none_hash_hex": bytes(kv_cache_utils.NONE_HASH).hex(),
        "frames": frames,
    }


ABOUT = (
    "KV-event batches built by vLLM's own KVCacheManager/BlockPool (take_events) and sent by "
    "its own ZmqEventPublisher over real ZMQ, with PYTHONHASHSEED != the project default, made "
    "by scripts/make_vllm_event_vectors.py. Frames are [topic, seq (8 bytes BE), payload]."
)


def main(argv: list[str]) -> int:
    captures = [_capture(algo) for algo in ("sha256_cbor", "sha256")]
    doc = {"about": ABOUT, "vllm_version": vllm_version, "topic": TOPIC, "captures": captures}
    text = json.dumps(doc, indent=1) + "\n"
    if not argv:
        print(text)
        return 0
    with open(argv[0], "w", encoding="utf-8") as f:
        f.write(text)
    print(
        f"{argv[0]}: vLLM {vllm_version}, seed {SEED!r}, "
        f"{sum(len(c['frames']) for c in captures)} batches"
    )  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
