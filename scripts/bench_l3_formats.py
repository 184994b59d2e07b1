"""L3 poll cost per key family, side by side: vLLM in-tree keys vs vllm-ascend keys.

Used by ``python scripts/bench_l3_poll.py --formats [--sizes 1000000]``: for each family a
fake master process (tests/fake_master.py, 0.3.13 wire format, 16 segments = 8 pods × 2,
every key on a random segment) serves N keys of one family:

* ``vllm``          ``Bench-Model@tp_rank:{0,1}@pcp0@dcp0@pp_rank:0@group:0@{sha256 hex}``
* ``ascend``        vllm-ascend v0.13–v0.19 TP2: ``…@head_or_tp_rank:{0,1}@pp_rank:0@{hex}``
* ``ascend-lw``     v0.21+ layer-wise, TP2 × 24 layers: ``…@layer_id:{L}@{hex}``
* ``ascend-lw-old`` v0.13–v0.20 layer-wise, TP2 × 24 layers: ``…@{hex}@{L}`` (the layer id
  after the hash: the poller's second split)

One process polls all of them with scope-segment defaults: the first poll of each (every
key located), then rounds of steady-state polls taken **round-robin** (so load from other
processes on the machine hits every family alike). Reported: median wall and CPU of a
steady poll (``MasterPoller.poll_once``: listing, parsing, completeness, result arrays;
the Redis write is left out — it depends on the number of blocks, 48× fewer for
layer-wise keys) and its ratio to the vLLM family.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from common.settings import L3PollerSettings
from services.l3_poller.client import MasterClient, MasterError
from services.l3_poller.metrics import PollerMetrics
from services.l3_poller.poller import MasterPoller
from services.l3_poller.writer import L3Writer
from services.simulator.ascend import ascend_store_key

FAMILIES = ("vllm", "ascend", "ascend-lw", "ascend-lw-old")
_LAYERS = 24


def block_keys(family: str, digest: str) -> list[str]:
    """Every key of one block (TP2; × 24 layers for the layer-wise families)."""
    if family == "vllm":
        return [f"Bench-Model@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:0@{digest}" for tp in (0, 1)]
    if family == "ascend":
        return [ascend_store_key("Bench-Model", h, digest, form="A") for h in (0, 1)]
    form = "E-LW" if family == "ascend-lw" else "C-LW"
    return [
        ascend_store_key("Bench-Model", h, digest, form=form, layer=ly)
        for h in (0, 1)
        for ly in range(_LAYERS)
    ]


def family_keys(
    rng: random.Random, family: str, n_keys: int, eps: list[str]
) -> dict[str, tuple[str, ...]]:
    keys: dict[str, tuple[str, ...]] = {}
    while len(keys) < n_keys:
        for key in block_keys(family, rng.randbytes(32).hex()):
            keys[key] = (rng.choice(eps),)
    return keys


def compare(n_keys: int, script: str, rounds: int = 5) -> dict[str, Any]:
    """Spawn one fake master per family (``script --serve N --family F``) and poll them."""
    servers = {
        f: subprocess.Popen(
            [sys.executable, script, "--serve", str(n_keys), "--family", f],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for f in FAMILIES
    }
    try:
        urls = {f: s.stdout.readline().strip() for f, s in servers.items()}  # type: ignore[union-attr]
        return _measure(urls, n_keys, rounds)
    finally:
        for s in servers.values():
            assert s.stdin is not None
            s.stdin.close()
            s.wait(60)


def _measure(urls: dict[str, str], n_keys: int, rounds: int) -> dict[str, Any]:
    from common.store import Store
    from tests.conftest import RedisServer

    import redis

    server = RedisServer().start()
    try:
        store = Store(redis.Redis.from_url(server.url))
        metrics = PollerMetrics.register()
        cfg = L3PollerSettings(http_timeout=60.0, poll_interval=60.0)
        pollers = {}
        out: dict[str, Any] = {"keys": n_keys}
        for family, url in urls.items():
            writer = L3Writer(store, "segment", metrics)
            pollers[family] = MasterPoller(
                url, cfg, MasterClient(url, 60.0, 60.0), writer, metrics, threading.Event()
            )
            t = time.perf_counter()
            view = _first_poll(pollers[family])
            out[family] = {
                "first_wall_s": time.perf_counter() - t,
                "blocks": view.blocks.complete,
                "wall": [],
                "cpu": [],
            }
        for _ in range(rounds):
            for family, poller in pollers.items():
                wall, cpu = time.perf_counter(), time.process_time()
                view = poller.poll_once()
                out[family]["wall"].append(time.perf_counter() - wall)
                out[family]["cpu"].append(time.process_time() - cpu)
                assert view.blocks.complete == out[family]["blocks"]
        for family in pollers:
            row = out[family]
            row["steady_wall_s"] = statistics.median(row.pop("wall"))
            row["steady_cpu_s"] = statistics.median(row.pop("cpu"))
        return out
    finally:
        server.cleanup()


def _first_poll(poller: MasterPoller) -> Any:
    """The first poll locates every key (5,000 requests for 1 M keys); on a loaded machine
    one can fail (the poller would retry with backoff): retry, the index keeps what it has."""
    for attempt in range(3):
        try:
            return poller.poll_once()
        except MasterError as exc:
            print(f"first poll of {poller.url} failed ({exc}); retrying", file=sys.stderr)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def report(rows: list[dict[str, Any]]) -> None:
    print(
        "| keys | family | blocks | first poll s | steady poll wall s (median) | "
        "steady CPU s | steady wall vs vllm | steady CPU vs vllm |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = r["vllm"]
        for family in FAMILIES:
            f = r[family]
            print(
                f"| {r['keys']:,} | {family} | {f['blocks']:,} | {f['first_wall_s']:.2f} | "
                f"{f['steady_wall_s']:.2f} | {f['steady_cpu_s']:.2f} | "
                f"{f['steady_wall_s'] / base['steady_wall_s']:.2f}× | "
                f"{f['steady_cpu_s'] / base['steady_cpu_s']:.2f}× |"
            )
