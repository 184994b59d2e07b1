"""The real ``cache-indexer l1-ingest`` process: its metrics port's ``/healthz`` fails while
its main loop is wedged and ``/readyz`` fails while it cannot reach Redis.

The wedge is real, not injected: the config gives Redis calls no practical timeout
(``redis.socketTimeout: 1h``) and the test freezes the redis-server process (SIGSTOP; not
the ingester, whose HTTP thread must keep answering), so the ingester's registry read
blocks inside the Redis call. SIGCONT lets the call finish and the probe recovers. (Redis'
own ``CLIENT PAUSE`` would do, but ``CLIENT UNPAUSE`` then queues behind the paused calls
on Redis 7.0, and ``DEBUG SLEEP`` is disabled by default.)"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import ROOT, RedisServer, reserve_port, wait_for

LIVENESS = 3  # metrics.livenessTimeout, seconds


@pytest.fixture()
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        resp = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2)
    except httpx.HTTPError as exc:
        return 0, repr(exc)
    return resp.status_code, resp.text


def test_l1_ingest_probes_follow_its_loop_and_redis(
    own_redis: RedisServer,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    port = reserve_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "redis": {"url": own_redis.url, "socketTimeout": "1h", "connectTimeout": "1s"},
                "metrics": {"port": port, "livenessTimeout": f"{LIVENESS}s"},
                "ingest": {"l1": {"backoffInitial": "50ms", "backoffMax": "200ms"}},
            }
        )
    )
    log = (tmp_path / "ingester.log").open("ab")
    procs.append(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "l1-ingest",
                "--config",
                str(config),
                "--shard",
                "0",
                "--shards",
                "1",
            ],
            cwd=ROOT,
            env=subprocess_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    )
    # readiness names the role of the Redis it talks to (issue 19)
    ready = (200, f"ok (redis role: master at 127.0.0.1:{own_redis.port})\n")
    wait_for(lambda: _get(port, "/readyz") == ready, timeout=30, what="ready")
    assert _get(port, "/healthz") == (200, "ok\n")
    assert "cache_indexer_l1_subscribed_ranks" in _get(port, "/metrics")[1]

    assert own_redis.proc is not None
    own_redis.proc.send_signal(signal.SIGSTOP)  # the redis-server this test started
    try:
        status, text = wait_for(
            lambda: (r := _get(port, "/healthz"))[0] == 503 and r,
            timeout=LIVENESS + 20,
            what="/healthz to fail",
        )
        assert "assignment loop" in text
        assert _get(port, "/readyz")[0] == 503
        assert procs[0].poll() is None
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: _get(port, "/healthz") == (200, "ok\n"), timeout=20, what="recovery")
    wait_for(lambda: _get(port, "/readyz") == ready, timeout=20, what="ready again")

    own_redis.stop()
    try:
        status, text = wait_for(
            lambda: (r := _get(port, "/readyz"))[0] == 503 and "registry" in r[1] and r,
            timeout=20,
            what="/readyz to fail without Redis",
        )
        assert "cannot read the registry" in text
        assert _get(port, "/healthz")[0] == 200, "failing fast is progress: live, not ready"
    finally:
        own_redis.start()
    wait_for(lambda: _get(port, "/readyz") == ready, timeout=30, what="ready again")

    procs[0].send_signal(signal.SIGTERM)
    assert procs[0].wait(15) == 0
    log.close()
