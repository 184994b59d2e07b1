"""The API's metrics under the real gunicorn (2 workers): prometheus_client's multiprocess
mode sums every worker, and a worker that dies keeps its counts in the sum."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RedisServer, wait_for
from tests.integration.test_api_gunicorn import Api


@pytest.fixture()
def api(tmp_path: Path) -> Iterator[Api]:
    redis_srv = RedisServer().start()
    try:
        server = Api(tmp_path, redis_srv.url)
        yield server
        server.stop()
    finally:
        redis_srv.cleanup()


def _workers(api: Api) -> set[int]:
    text = Path(f"/proc/{api.proc.pid}/task/{api.proc.pid}/children").read_text()
    return {int(pid) for pid in text.split()}


def _count(api: Api, path: str, status: str) -> float:
    text = httpx.get(f"{api.url}/metrics").text
    m = re.search(
        rf'^cache_indexer_api_requests_total\{{path="{re.escape(path)}",'
        rf'status="{status}"\}} (\S+)$',
        text,
        re.MULTILINE,
    )
    return float(m.group(1)) if m else 0.0


def test_a_dead_workers_counts_stay_in_the_sum(api: Api) -> None:
    served_by: list[int] = []

    def both_workers_served() -> bool:  # a new connection each time, so both take some
        resp = httpx.get(f"{api.url}/healthz")
        assert resp.status_code == 200
        served_by.append(int(resp.headers["x-served-by"]))
        return len(served_by) >= 30 and len(set(served_by)) == 2

    wait_for(both_workers_served, timeout=60, interval=0, what="both workers to answer")
    n = len(served_by)
    wait_for(lambda: _count(api, "/healthz", "200") >= n, timeout=10, what="the counts")
    victim = min(served_by)  # it answered some of the n: its counts must survive it
    assert victim in _workers(api)
    os.kill(victim, signal.SIGKILL)  # no exit hook runs: only what it wrote to its files
    wait_for(
        lambda: len(_workers(api)) == 2 and victim not in _workers(api),
        timeout=20,
        what="gunicorn to replace the killed worker",
    )
    for _ in range(6):  # whichever worker answers, the dead one's requests are still counted
        assert _count(api, "/healthz", "200") >= n
    total = _count(api, "/healthz", "200")
    assert httpx.get(f"{api.url}/healthz").status_code == 200
    wait_for(
        lambda: _count(api, "/healthz", "200") == total + 1,
        timeout=15,
        what="the new worker to count on top",
    )
