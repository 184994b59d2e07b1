"""Benchmark the hit-rate request with and without LoRA and multimodal extra keys (issue 31).

In one process: a real redis-server (started here), the API's Falcon app (``create_app``,
real Store and BlockHasher, vLLM 0.34.0 keys) driven by ``falcon.testing``, 8 candidates
each holding the prompt's chain plus 20,000 unrelated members. Per prompt size it times,
interleaved, ``--requests`` requests of

- ``plain``: token ids and block size only (what every caller sends today; every candidate
  holds the whole chain);
- ``salted``: the same with a ``cache_salt``: a chain no candidate holds (the control for
  the next, whose chain no candidate holds either);
- ``lora+4mm``: the same with ``lora_name``, ``lora_path`` and 4 image items of 64 tokens
  (where the tree has them; an older tree prints ``n/a``),

and the hasher alone (``member_keys``) for plain and lora+4mm. Prints p50/p99 in
microseconds. Two revisions in turns:
``scripts/bench_revs.py --old-rev REV -- scripts/bench_extra_keys.py``. Benchmarks only,
never a test.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import falcon.testing
import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: under bench_revs.py, the tree being measured

from common import blockhash, blockhash_native
from common.blockhash import BlockHasher, HashSettings
from common.settings import ApiSettings
from common.store import Instance, Store, TierOps
from services.api.api_metrics import ApiMetrics
from services.api.app import create_app

from bench_util import free_port, stop, wait_for

CANDIDATES = 8
NOISE = 20_000
SIZES = ((4096, 16), (32768, 128))
PATH = "/kv-cache/hit-rate"
LORA = {"lora_name": "sql-lora", "lora_path": "/adapters/sql-lora"}


def _items(n_tokens: int) -> list[dict[str, Any]]:
    step = n_tokens // 4
    return [{"identifier": f"img-{k}", "offset": k * step + 5, "length": 64} for k in range(4)]


def _keyed_inputs(n_tokens: int) -> Any:
    if not hasattr(blockhash, "HashInputs"):
        return None
    items = tuple(
        blockhash.MmItem(i["identifier"], i["offset"], i["length"]) for i in _items(n_tokens)
    )
    return blockhash.HashInputs(LORA["lora_name"], LORA["lora_path"], items)


def _percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"p50 {p50 * 1e6:8.0f} µs  p99 {p99 * 1e6:8.0f} µs"


def _time(call: Callable[[], object], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


def _populate(store: Store, members: list[bytes], rng: random.Random) -> list[str]:
    ips = [f"10.9.0.{i}" for i in range(CANDIDATES)]
    for ip in ips:
        gen = store.upsert_instance(Instance(ip=ip, uid=f"u-{ip}"))[1]
        ops = TierOps()
        ops.store("l1", [int(m) for m in members] + [rng.getrandbits(63) for _ in range(NOISE)])
        store.apply_batch(ip, gen, 0, 1, ops)
    return ips


def _bench(store: Store, requests: int) -> None:
    print(f"tree: {Path(blockhash.__file__).parent.parent}; {blockhash_native.status()}")
    settings = ApiSettings(hash=HashSettings(vllm_version=(0, 34, 0)))
    hasher = BlockHasher(settings.hash)
    client = falcon.testing.TestClient(create_app(settings, store, hasher, ApiMetrics()))
    rng = random.Random(31)
    for n_tokens, block in SIZES:
        tokens = [rng.randrange(150_000) for _ in range(n_tokens)]
        ips = _populate(store, hasher.member_keys(tokens, block), rng)
        label = f"{n_tokens} tokens, block {block}, {CANDIDATES} candidates"
        _bench_requests(client, ips, tokens, block, requests, label)
        hash_plain = _time(partial(hasher.member_keys, tokens, block), requests)
        print(f"member_keys plain     {label}: {_percentiles(hash_plain)}")
        inputs = _keyed_inputs(n_tokens)
        if inputs is None:
            print(f"member_keys lora+4mm  {label}: n/a")
            continue
        keyed = partial(hasher.member_keys, tokens, block, inputs=inputs)
        print(f"member_keys lora+4mm  {label}: {_percentiles(_time(keyed, requests))}")


def _bench_requests(
    client: falcon.testing.TestClient,
    ips: list[str],
    tokens: list[int],
    block: int,
    requests: int,
    label: str,
) -> None:
    plain = {"token_ids": tokens, "block_size": block}
    salted = {**plain, "cache_salt": "tenant-a"}  # misses like lora+4mm, in every tree
    keyed = {**plain, **LORA, "mm_features": _items(len(tokens))}
    bodies = {
        name: orjson.dumps({"server_ip": ips, "body": body})
        for name, body in (("plain", plain), ("salted", salted), ("lora+4mm", keyed))
    }
    if client.simulate_post(PATH, body=bodies["lora+4mm"]).status_code != 200:
        del bodies["lora+4mm"]  # a tree without the fields: 400
    times: dict[str, list[float]] = {"plain": [], "salted": [], "lora+4mm": []}
    for _ in range(requests):  # interleaved: both see the same load
        for name, body in bodies.items():
            times[name] += _time(partial(client.simulate_post, PATH, body=body), 1)
    for name, samples in times.items():
        print(f"hit-rate {name:9} {label}: " + (_percentiles(samples) if samples else "n/a"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    server = shutil.which("redis-server")
    if server is None:
        print("needs redis-server", file=sys.stderr)
        return 2
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-extra-") as tmp:
        proc = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp],
            stdout=subprocess.DEVNULL,
        )
        try:
            client = redis.Redis(host="127.0.0.1", port=port)
            wait_for(client.ping, "redis-server", 10.0, tolerate=(redis.RedisError,))
            _bench(Store(client), args.requests)
        finally:
            stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
