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
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from common.config import Redis as RedisConfig
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
    password = cfg.password
    if cfg.password_file:
        password = Path(cfg.password_file).read_text(encoding="utf-8").strip()
    if cfg.username:
        options["username"] = cfg.username
    if password:
        options["password"] = password
    if cfg.tls.enabled and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://") :]
    if url.startswith("rediss://"):
        options.update(_tls_options(cfg))
    return url, options


def _tls_options(cfg: RedisConfig) -> dict[str, Any]:
    tls = cfg.tls
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
    return (
        f"{'cluster' if cfg.cluster else 'redis'} {host} (tls {'on' if tls else 'off'}, "
        f"auth {auth})"
    )


def text(value: Any) -> str:
    """A reply value as text (replies are bytes unless the client decodes them)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def text_dict(raw: dict[Any, Any]) -> dict[str, str]:
    """An HGETALL reply as text keys and values."""
    return {text(k): text(v) for k, v in raw.items()}
