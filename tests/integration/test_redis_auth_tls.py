"""AUTH (password, ACL user) and TLS (rediss://, CA file, client certificate) on real
servers, single and cluster, through :func:`common.redis_client.connect` — the config keys,
the environment / Secret variables and a real process (the API's /readyz)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from common.config import Redis as RedisConfig
from common.config import RedisTLS, load_config
from common.redis_client import connect
from common.store import Instance, TierOps
from tests.conftest import ROOT, reserve_port, wait_for
from tests.redis_nodes import Cluster, Node
from tests.store_oracle import OracleStore

PASSWORD = "s3cret-pw"


def _exercise(client: redis.Redis | redis.RedisCluster) -> None:
    """The store's three kinds of access: scripts, pipelines, plain commands."""
    store = OracleStore(client)
    ip = "10.3.0.1"
    _, gen = store.upsert_instance(Instance(ip=ip, uid="u"))
    ops = TierOps()
    ops.store("l1", [1, 2])
    assert store.apply_batch(ip, gen, 0, 0, ops).status == "applied"
    assert store.prefix_lengths([ip], [b"1", b"2", b"3"]) == [(2, 0)]
    store.remove_instance(ip)


def _make_certs(d: Path) -> dict[str, str]:
    """A private CA, a server certificate for 127.0.0.1 and a client certificate."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            f"{name}.crt",
        )
    return {
        n: str(d / n) for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")
    }


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _make_certs(tmp_path_factory.mktemp("certs"))


def _tls_args(certs: dict[str, str], port: int, clients: str = "optional") -> list[str]:
    return [
        "--tls-port",
        str(port),
        "--tls-cert-file",
        certs["server.crt"],
        "--tls-key-file",
        certs["server.key"],
        "--tls-ca-cert-file",
        certs["ca.crt"],
        "--tls-auth-clients",
        clients,
    ]


@pytest.fixture()
def started() -> Iterator[list[Node | Cluster]]:
    servers: list[Node | Cluster] = []
    yield servers
    for s in servers:
        s.cleanup()


def test_password_from_config_env_and_file(started: list[Node | Cluster], tmp_path: Path) -> None:
    node = Node(args=["--requirepass", PASSWORD], ping={"password": PASSWORD}).start()
    started.append(node)
    with pytest.raises(redis.AuthenticationError):
        connect(RedisConfig(url=node.url)).ping()
    _exercise(connect(RedisConfig(url=node.url, password=PASSWORD)))  # type: ignore[arg-type]
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    assert connect(RedisConfig(url=node.url, password_file=str(secret))).ping()
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"redis": {"url": node.url}}))
    cfg = load_config(config, env={"CACHE_INDEXER_REDIS_PASSWORD": PASSWORD})
    assert connect(cfg.redis).ping()


def test_acl_user_limited_to_the_project_keys(started: list[Node | Cluster]) -> None:
    acl = ["--user", "default", "off", "--user", "indexer", "on", f">{PASSWORD}", "~ci:*", "+@all"]
    node = Node(args=acl, ping={"username": "indexer", "password": PASSWORD}).start()
    started.append(node)
    cfg = RedisConfig(url=node.url, username="indexer", password=PASSWORD)
    client = connect(cfg)
    _exercise(client)  # type: ignore[arg-type]
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("other:key", "1")
    with pytest.raises(redis.AuthenticationError):
        connect(dataclasses.replace(cfg, password="wrong")).ping()


def test_tls_with_ca_file_and_client_certificate(
    started: list[Node | Cluster], certs: dict[str, str]
) -> None:
    tls_port = reserve_port()
    node = Node(args=_tls_args(certs, tls_port, clients="yes")).start()
    started.append(node)
    url = f"rediss://127.0.0.1:{tls_port}/0"
    mutual = RedisTLS(
        ca_file=certs["ca.crt"], cert_file=certs["client.crt"], key_file=certs["client.key"]
    )
    _exercise(connect(RedisConfig(url=url, tls=mutual)))  # type: ignore[arg-type]
    via_flag = RedisConfig(
        url=f"redis://127.0.0.1:{tls_port}/0", tls=dataclasses.replace(mutual, enabled=True)
    )
    assert connect(via_flag).ping(), "tls.enabled turns a redis:// URL into TLS"
    with pytest.raises(redis.ConnectionError):  # the server's CA is not trusted
        connect(
            RedisConfig(
                url=url, tls=RedisTLS(cert_file=certs["client.crt"], key_file=certs["client.key"])
            )
        ).ping()
    with pytest.raises(redis.ConnectionError):  # no client certificate
        connect(RedisConfig(url=url, tls=RedisTLS(ca_file=certs["ca.crt"]))).ping()


def test_cluster_with_password_and_tls(
    started: list[Node | Cluster], certs: dict[str, str]
) -> None:
    cluster = Cluster(
        3, ping={"password": PASSWORD}, extra=["--requirepass", PASSWORD, "--masterauth", PASSWORD]
    )
    for node in cluster.nodes:
        tls_port = reserve_port()
        node.args += [*_tls_args(certs, tls_port), "--tls-cluster", "yes"]
        node.tls_port = tls_port  # type: ignore[attr-defined]
    started.append(cluster)
    cluster.start(cli_args=["-a", PASSWORD, "--no-auth-warning"])  # over the plain ports
    first = cluster.nodes[0].tls_port  # type: ignore[attr-defined]
    cfg = RedisConfig(
        url=f"rediss://127.0.0.1:{first}/0",
        cluster=True,
        password=PASSWORD,
        tls=RedisTLS(ca_file=certs["ca.crt"]),
    )
    client = connect(cfg, retries=3)
    _exercise(client)  # type: ignore[arg-type]
    ports = {n.port for n in client.get_nodes()}  # type: ignore[union-attr]
    assert ports == {n.tls_port for n in cluster.nodes}, "every node reached over TLS"  # type: ignore[attr-defined]


def test_api_process_takes_the_password_from_the_environment(
    started: list[Node | Cluster],
    tmp_path: Path,
    subprocess_env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """What the chart does: the password comes from a Secret as CACHE_INDEXER_REDIS_PASSWORD."""
    node = Node(args=["--requirepass", PASSWORD], ping={"password": PASSWORD}).start()
    started.append(node)
    api = reserve_port()
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {"redis": {"url": node.url}, "http": {"addr": f"127.0.0.1:{api}", "workers": 1}}
        )
    )
    env = dict(subprocess_env, CACHE_INDEXER_REDIS_PASSWORD=PASSWORD)
    log = open(tmp_path / "api.log", "ab")  # noqa: SIM115 - handed to the child
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", "services.cli", "api", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=log,
        )
    )
    wait_for(
        lambda: httpx.get(f"http://127.0.0.1:{api}/readyz", timeout=1).status_code == 200,
        timeout=30,
        what="the API to be ready with the password from the environment",
    )
    assert PASSWORD not in (tmp_path / "api.log").read_text(), "the password is never logged"
