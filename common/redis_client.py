"""The one place a Redis client is made: one server or a Redis Cluster, AUTH, TLS, timeouts.

Every process builds its client with :func:`connect` from the ``redis`` config section:

* ``redis.cluster: true`` → redis-py's :class:`~redis.cluster.RedisCluster`, bootstrapped
  from the node that ``redis.url`` names (any node; the others are discovered). The
  store's scripts touch one instance's keys only, all under the hash tag ``{<ip>}``, so
  each runs on the one node that owns that slot; the API's read pipeline is grouped by
  node (one round trip per node, in parallel) by redis-py's cluster pipeline.
* AUTH: ``redis.username`` (ACL user) and ``redis.password`` / ``redis.passwordFile``
  (a mounted Secret, read at connect time), or ``CACHE_INDEXER_REDIS_USERNAME`` /
  ``CACHE_INDEXER_REDIS_PASSWORD``. Credentials written in the URL take precedence.
* ``redis.sentinel`` (``addresses`` + ``masterName``) → redis-py's
  :class:`~redis.sentinel.Sentinel`: every new connection asks the sentinels where the master
  is now, so a process follows a failover by itself; a pooled connection to a master that was
  demoted answers READONLY, which redis-py turns into a :class:`redis.ConnectionError` (the
  connection is dropped and the next one asks the sentinels again): the callers' usual
  retry and backoff, never a crash loop, and never a write to a replica. ``redis.url`` then
  gives only the database and the data nodes' credentials / TLS; the sentinels have their
  own (``redis.sentinel.password`` / ``passwordFile`` / ``tls``).
* TLS: a ``rediss://`` URL or ``redis.tls.enabled``; ``redis.tls.caFile`` to trust a private
  CA, ``certFile``/``keyFile`` for a client certificate, ``insecureSkipVerify`` for tests.
* Every socket operation is bounded (``socketTimeout``, ``connectTimeout``); idle pooled
  connections are checked after ``healthCheckInterval``; a failed command is retried
  ``retries`` times with jittered exponential backoff (capped at 1 s) on a fresh
  connection, which also covers the stale pooled sockets left by a Redis restart. Callers
  keep their own outer backoff loops for longer outages.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterPipeline, RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from redis.sentinel import Sentinel

from common.config import Redis as RedisConfig
from common.config import RedisTLS
from common.health import Health
from common.lifecycle import Backoff

logger = logging.getLogger(__name__)

Client = redis.Redis | RedisCluster
"""What :func:`connect` returns; :class:`common.store.Store` accepts either."""


CLUSTER_START_ATTEMPTS = 10
"""A cluster client must reach one node to learn the slot map: tries before giving up."""


def connect(cfg: RedisConfig, *, retries: int = 1, stop: threading.Event | None = None) -> Client:
    """A pooled client for ``cfg``. A single-server client connects on its first command; a
    cluster client reads the slot map now, retrying with capped backoff (``stop`` ends the
    wait early), and raises :class:`redis.ConnectionError` if no node answers."""
    url, options = client_options(cfg, retries)
    logger.info("state store: %s", describe(cfg))
    if cfg.sentinel.addresses:
        return _sentinel_master(cfg, url, options)
    if not cfg.cluster:
        return redis.Redis.from_url(url, **options)
    backoff = Backoff(0.2, 5.0)
    waiter = stop or threading.Event()
    for attempt in range(1, CLUSTER_START_ATTEMPTS + 1):
        try:
            return _Cluster.from_url(url, **options)
        except (RedisClusterException, redis.RedisError) as exc:
            if attempt == CLUSTER_START_ATTEMPTS or waiter.wait(backoff.next_delay()):
                raise redis.ConnectionError(f"no Redis Cluster node answered: {exc}") from exc
            logger.warning("Redis Cluster not reachable yet (attempt %d): %s", attempt, exc)
    raise AssertionError("unreachable")


def _sentinel_master(cfg: RedisConfig, url: str, options: dict[str, Any]) -> redis.Redis:
    """A client of whichever node the sentinels call the master now (see the docstring)."""
    parsed: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
    node = {k: v for k, v in parsed.items() if k in ("db", "username", "password")}
    if url.startswith("rediss://"):
        node["ssl"] = True  # the pool picks its TLS connection class from this flag
    s = cfg.sentinel
    sentinel_options: dict[str, Any] = {
        "socket_timeout": cfg.socket_timeout,
        "socket_connect_timeout": cfg.connect_timeout,
    }
    password = _password(s.password, s.password_file)
    if s.username:
        sentinel_options["username"] = s.username
    if password:
        sentinel_options["password"] = password
    if s.tls.enabled:
        sentinel_options.update(ssl=True, **_tls_options(s.tls))
    addresses = [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in s.addresses]
    sentinel = Sentinel(addresses, sentinel_kwargs=sentinel_options, **{**options, **node})
    # check_connection: a PING on every new connection, so a dead address fails at once.
    client: redis.Redis = sentinel.master_for(s.master_name, check_connection=True)
    return client


def role(client: Client) -> str:
    """What the client talks to, for readiness and logs: ``master`` / ``slave`` (ROLE) and
    the address, or ``cluster`` (after a PING: each node's role is the cluster's business).
    A replica refuses every write (READONLY)."""
    if isinstance(client, RedisCluster):
        client.ping()
        return "cluster"
    try:
        name = text(client.role()[0])
    except redis.exceptions.NoPermissionError:  # an ACL without ROLE (@dangerous): ask INFO
        name = str(client.info("replication").get("role", "unknown"))
    pool, kw = client.connection_pool, client.connection_pool.connection_kwargs
    host, port = getattr(pool, "master_address", None) or (kw.get("host"), kw.get("port"))
    where = f"{host}:{port}" if host else kw.get("path")  # a unix socket has a path
    return f"{name} at {where}" if where else name


def is_replica(where: str) -> bool:
    """Whether :func:`role` named a replica."""
    return where.startswith(("slave", "replica"))


def role_problem(where: str) -> str:
    """Why the store :func:`role` named cannot hold the index ("" when it can: a master or a
    cluster): a replica refuses writes and its copy is not kept up to date; a sentinel (a
    ``redis.url`` pointing at one) knows no data commands."""
    if where.startswith(("master", "cluster")):
        return ""
    if where.startswith("sentinel"):
        return "redis.url names a Sentinel: set redis.sentinel (addresses, masterName)"
    return "the state store is a replica: it refuses writes, its copy is not kept up to date"


ROLE_CHECK_INTERVAL = 5.0
"""Seconds between two ROLE checks of a worker's client (:func:`watch_role`)."""


def watch_role(client: Client, health: Health, stop: threading.Event) -> threading.Thread:
    """Keep the readiness condition ``redis role`` up to date from a daemon thread: ready with
    the role named while the client talks to a master (or a cluster), not ready on a replica
    or no answer. On a replica the pool is emptied, so a Sentinel client asks the sentinels
    again at once even if this process has nothing to write (a quiet worker follows too)."""
    cond = health.condition("redis role")

    def check() -> None:
        try:
            where = role(client)
        except redis.RedisError as exc:
            cond.set(False, f"no answer: {type(exc).__name__}: {exc}")
            return
        problem = role_problem(where)
        cond.set(not problem, f"{where} ({problem})" if problem else where)
        if is_replica(where) and isinstance(client, redis.Redis):
            logger.warning("the state store is a replica (%s): reconnecting", where)
            client.connection_pool.disconnect()

    def loop() -> None:
        while True:
            try:
                check()
            except Exception:  # the top of the loop: log, keep checking
                logger.exception("checking the Redis role failed")
                cond.set(False, "the role check failed (see the log)")
            if stop.wait(ROLE_CHECK_INTERVAL):
                return

    thread = threading.Thread(target=loop, name="redis-role", daemon=True)
    thread.start()
    return thread


class _Cluster(RedisCluster):
    """RedisCluster whose cluster-level failures (e.g. a slot no known node covers, while a
    node is away) are :class:`redis.ConnectionError`: callers handle ``redis.RedisError``
    alone, as with one server, and back off instead of dying."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]
        except RedisClusterException as exc:
            raise redis.ConnectionError(f"Redis Cluster: {exc}") from exc

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe: ClusterPipeline = super().pipeline(  # type: ignore[no-untyped-call]
            transaction, shard_hint
        )
        pipe.__class__ = _ClusterPipeline
        return pipe


class _ClusterPipeline(ClusterPipeline):
    def execute(self, raise_on_error: bool = True) -> list[Any]:
        try:
            return super().execute(raise_on_error)
        except RedisClusterException as exc:
            raise redis.ConnectionError(f"Redis Cluster: {exc}") from exc


def client_options(cfg: RedisConfig, retries: int = 1) -> tuple[str, dict[str, Any]]:
    """The URL (``rediss://`` when TLS is on) and the keyword options for redis-py."""
    url = cfg.url
    options: dict[str, Any] = {
        "socket_timeout": cfg.socket_timeout,
        "socket_connect_timeout": cfg.connect_timeout,
        "health_check_interval": cfg.health_check_interval,
        "retry": Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), retries),
    }
    password = _password(cfg.password, cfg.password_file)
    if cfg.username:
        options["username"] = cfg.username
    if password:
        options["password"] = password
    if cfg.tls.enabled and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://") :]
    if url.startswith("rediss://"):
        options.update(_tls_options(cfg.tls))
    return url, options


def _password(password: str, password_file: str) -> str:
    """The password, read from its file (a mounted Secret) when one is named."""
    if password_file:
        return Path(password_file).read_text(encoding="utf-8").strip()
    return password


def _tls_options(tls: RedisTLS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if tls.ca_file:
        out["ssl_ca_certs"] = tls.ca_file
    if tls.cert_file:
        out["ssl_certfile"] = tls.cert_file
        out["ssl_keyfile"] = tls.key_file
    if tls.insecure_skip_verify:
        out["ssl_cert_reqs"] = "none"
        out["ssl_check_hostname"] = False
    return out


def describe(cfg: RedisConfig) -> str:
    """For logs: where and how we connect, never the credentials."""
    host = cfg.url.split("@")[-1].split("://")[-1]
    tls = cfg.tls.enabled or cfg.url.startswith("rediss://")
    auth = (
        "acl user"
        if cfg.username
        else ("password" if cfg.password or cfg.password_file or "@" in cfg.url else "none")
    )
    if cfg.sentinel.addresses:
        mode = "sentinel"
        host = f"{cfg.sentinel.master_name} via {','.join(cfg.sentinel.addresses)}"
    else:
        mode = "cluster" if cfg.cluster else "redis"
    return f"{mode} {host} (tls {'on' if tls else 'off'}, auth {auth})"


def text(value: Any) -> str:
    """A reply value as text (replies are bytes unless the client decodes them)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def text_dict(raw: dict[Any, Any]) -> dict[str, str]:
    """An HGETALL reply as text keys and values."""
    return {text(k): text(v) for k, v in raw.items()}
