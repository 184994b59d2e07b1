"""The config file translated, once and at the edge, into one typed settings object per process.

:mod:`common.config` loads and validates the Go-compatible ``config.yaml`` (its sections
follow the original's layout, not ours); this module maps it onto what each process
actually uses, so that a service receives only its own settings and never reads another
section. Every object is a frozen dataclass built by its ``from_config`` classmethod:

* :class:`ProcessSettings` (the shell of every process): ``log.*``, ``metrics.*``,
  ``redis.*``, and ``--metrics-port``;
* :class:`DiscoverySettings`: ``discovery.*``, its reconnect backoff from
  ``ingest.l1.backoffInitial``/``backoffMax``, the master URL scheme from ``ingest.l3.scheme``;
* :class:`L1IngestSettings`: ``ingest.l1.*`` and ``blockKey.*`` (the hash self-check);
* :class:`L3PollerSettings`: ``ingest.l3.*`` and ``discovery.segmentsFetchTimeout``;
* :class:`ProberSettings` (``cache-indexer audit-probe``): ``audit.probe.*``;
* :class:`ApiSettings`: ``http.*``, ``blockKey.*`` (as :class:`~common.blockhash.HashSettings`;
  ``hashLookaheadTokens`` beside it),
  ``ingest.l1.noEventsAfter``/``leaseTTL`` (the instance states it reports), ``log.level``
  (gunicorn's own log level) and ``audit.*`` (the prediction audit).

The cross-section keys keep the original's meaning (the drop-in contract): in the Go
service ``ingest.l1.backoff*`` is the reconnect backoff of every watcher, ``ingest.l3.scheme``
the scheme of the master URLs discovery publishes, ``discovery.segmentsFetchTimeout`` the
timeout of a master's segment query. ``blockKey.useIntBlockHashes`` is accepted and unused:
the event decoder reads both hash forms. Nested sections passed through unchanged
(``discovery.labels``, ``discovery.vllm`` …) stay :mod:`common.config` dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from common.blockhash import HashSettings
from common.config import (
    HTTP,
    Audit,
    AuditProbe,
    KEY_FORMATS,
    Config,
    DiscoveryMode,
    DiscoveryVLLM,
    GapPolicy,
    IngestL1,
    IngestL3,
    L1Model,
    L3Model,
    L3Scope,
    Labels,
    MooncakeMaster,
    Redis,
    Scheme,
    ShardMode,
    Static,
    model_basename,
)
from common.status_report import Limits

# The settings' defaults are the config file's (common.config writes each once); they serve
# code that builds settings without a file: tests, benchmarks and the simulator's tools.
_HTTP, _L1, _L3, _DISCOVERY = HTTP(), IngestL1(), IngestL3(), Config().discovery
_PROBE = AuditProbe()


@dataclass(frozen=True)
class ProcessSettings:
    """What the process shell itself uses: logging, the metrics endpoint, the Redis client."""

    log_level: str
    log_format: str
    metrics_addr: str
    metrics_port: int
    """0 = no metrics endpoint; ``--metrics-port`` overrides ``metrics.port``."""
    liveness_timeout: float
    redis: Redis

    @classmethod
    def from_config(cls, cfg: Config, metrics_port: int | None = None) -> ProcessSettings:
        return cls(
            log_level=cfg.log.level,
            log_format=cfg.log.format,
            metrics_addr=cfg.metrics.addr,
            metrics_port=cfg.metrics.port if metrics_port is None else metrics_port,
            liveness_timeout=float(cfg.metrics.liveness_timeout),
            redis=cfg.redis,
        )


@dataclass(frozen=True)
class DiscoverySettings:
    """The discovery worker's settings."""

    mode: DiscoveryMode
    namespace: str
    kubeconfig: str
    refresh_interval: float
    lease_ttl: float
    labels: Labels
    vllm: DiscoveryVLLM
    mooncake_master: MooncakeMaster
    static: Static
    backoff_initial: float
    """Pod-watch reconnect and registry-write backoff (``ingest.l1.backoffInitial``)."""
    backoff_max: float
    master_scheme: Scheme
    """Scheme of the master URLs discovery publishes (``ingest.l3.scheme``)."""

    @classmethod
    def from_config(cls, cfg: Config) -> DiscoverySettings:
        d, l1 = cfg.discovery, cfg.ingest.l1
        return cls(
            mode=d.mode,
            namespace=d.namespace,
            kubeconfig=d.kubeconfig,
            refresh_interval=float(d.refresh_interval),
            lease_ttl=float(d.lease_ttl),
            labels=d.labels,
            vllm=d.vllm,
            mooncake_master=d.mooncake_master,
            static=d.static,
            backoff_initial=float(l1.backoff_initial),
            backoff_max=float(l1.backoff_max),
            master_scheme=cfg.ingest.l3.scheme,
        )


class HashUnitSettings(NamedTuple):
    """An instance's hash-unit settings (``ingest.l1.prefixMatchUnit`` and
    ``attentionChunkSize``, or its model's entry in ``ingest.l1.models``)."""

    prefix_match_unit: int
    """vLLM's ``--prefix-match-unit`` (0 = derive it from the events' block sizes)."""
    attention_chunk_size: int
    """Chunk size of chunked-local attention groups (0 = unknown: a lower bound)."""


@dataclass(frozen=True)
class L1IngestSettings:
    """An L1 ingester's settings (``ingest.l1``)."""

    topic: str = _L1.topic
    on_unrecoverable_gap: GapPolicy = _L1.on_unrecoverable_gap
    shard_mode: ShardMode = _L1.shard_mode
    lease_ttl: float = float(_L1.lease_ttl)
    heartbeat_interval: float = float(_L1.heartbeat_interval)
    replay_timeout: float = float(_L1.replay_timeout)
    backoff_initial: float = float(_L1.backoff_initial)
    backoff_max: float = float(_L1.backoff_max)
    hash_check_rate: int = _L1.hash_check_rate
    """Blocks per second and instance the hash self-check may recompute (0 = off)."""
    hash: HashSettings = HashSettings()
    """How the vLLM instances hash blocks (``blockKey``), for the hash self-check."""
    prefix_match_unit: int = _L1.prefix_match_unit
    """vLLM's ``--prefix-match-unit`` of hybrid models (0 = derive it from the events)."""
    attention_chunk_size: int = _L1.attention_chunk_size
    """Chunk size of chunked-local attention groups (0 = unknown: answers a lower bound)."""
    models: tuple[L1Model, ...] = ()
    """Per-model overrides of the two above (``ingest.l1.models``), by the instance's model."""

    def hybrid_settings(self, model: str) -> HashUnitSettings:
        """The hash-unit settings of an instance serving ``model``: its entry in
        ``ingest.l1.models`` (matched as given or by basename), else the defaults."""
        base = model_basename(model) if model else ""
        for entry in self.models:
            if model and (entry.name == model or model_basename(entry.name) == base):
                return HashUnitSettings(
                    entry.prefix_match_unit or self.prefix_match_unit,
                    entry.attention_chunk_size or self.attention_chunk_size,
                )
        return HashUnitSettings(self.prefix_match_unit, self.attention_chunk_size)

    @classmethod
    def from_config(cls, cfg: Config) -> L1IngestSettings:
        """Raises ConfigError for block-key values that cannot be hashed with."""
        l1 = cfg.ingest.l1
        return cls(
            topic=l1.topic,
            on_unrecoverable_gap=l1.on_unrecoverable_gap,
            shard_mode=l1.shard_mode,
            lease_ttl=float(l1.lease_ttl),
            heartbeat_interval=float(l1.heartbeat_interval),
            replay_timeout=float(l1.replay_timeout),
            backoff_initial=float(l1.backoff_initial),
            backoff_max=float(l1.backoff_max),
            hash_check_rate=l1.hash_check_rate,
            hash=hash_settings(cfg),
            prefix_match_unit=l1.prefix_match_unit,
            attention_chunk_size=l1.attention_chunk_size,
            models=tuple(l1.models),
        )


@dataclass(frozen=True)
class L3PollerSettings:
    """The L3 poller's settings (``ingest.l3``, plus the segment query's timeout)."""

    scheme: Scheme = _L3.scheme
    poll_interval: float = float(_L3.poll_interval)
    http_timeout: float = float(_L3.http_timeout)
    segments_timeout: float = float(_DISCOVERY.segments_fetch_timeout)
    """Timeout of a master's segment query (``discovery.segmentsFetchTimeout``)."""
    scope: L3Scope = _L3.scope
    stale_after: float = float(_L3.stale_after)
    batch_size: int = _L3.batch_size
    key_formats: tuple[str, ...] = KEY_FORMATS
    models: tuple[L3Model, ...] = ()

    @classmethod
    def from_config(cls, cfg: Config) -> L3PollerSettings:
        l3 = cfg.ingest.l3
        return cls(
            scheme=l3.scheme,
            poll_interval=float(l3.poll_interval),
            http_timeout=float(l3.http_timeout),
            segments_timeout=float(cfg.discovery.segments_fetch_timeout),
            scope=l3.scope,
            stale_after=float(l3.stale_after),
            batch_size=l3.batch_size,
            key_formats=tuple(l3.key_formats),
            models=tuple(l3.models),
        )


@dataclass(frozen=True)
class ApiSettings:
    """The API's settings: the HTTP server (``http``) and the block hashing (``blockKey``)."""

    addr: str = _HTTP.addr
    workers: int = _HTTP.workers
    threads: int = _HTTP.threads
    shutdown_timeout: float = float(_HTTP.shutdown_timeout)
    read_header_timeout: float = float(_HTTP.read_header_timeout)
    read_timeout: float = float(_HTTP.read_timeout)
    write_timeout: float = float(_HTTP.write_timeout)
    idle_timeout: float = float(_HTTP.idle_timeout)
    max_header_bytes: int = _HTTP.max_header_bytes
    max_hit_rate_body_bytes: int = _HTTP.max_hit_rate_body_bytes
    max_candidates: int = _HTTP.max_candidates
    hash: HashSettings = HashSettings()
    hash_lookahead: int = Config().block_key.hash_lookahead_tokens
    """L of instances whose events have not said theirs (``blockKey.hashLookaheadTokens``)."""
    instance_limits: Limits = Limits()
    """What ``GET /kv-cache/instances`` judges the ingesters' reports by."""
    log_level: str = Config().log.level
    """gunicorn's own log level (the process's ``log.level``)."""
    audit: Audit = field(default_factory=Audit)
    """The prediction audit (``audit``): recording answers, outcome reports."""

    @classmethod
    def from_config(cls, cfg: Config) -> ApiSettings:
        """Raises ConfigError for block-key values that cannot be hashed with."""
        h = cfg.http
        return cls(
            addr=h.addr,
            workers=h.workers,
            threads=h.threads,
            shutdown_timeout=float(h.shutdown_timeout),
            read_header_timeout=float(h.read_header_timeout),
            read_timeout=float(h.read_timeout),
            write_timeout=float(h.write_timeout),
            idle_timeout=float(h.idle_timeout),
            max_header_bytes=h.max_header_bytes,
            max_hit_rate_body_bytes=h.max_hit_rate_body_bytes,
            max_candidates=h.max_candidates,
            hash=hash_settings(cfg),
            hash_lookahead=cfg.block_key.hash_lookahead_tokens,
            instance_limits=instance_limits(cfg),
            log_level=cfg.log.level,
            audit=cfg.audit,
        )


@dataclass(frozen=True)
class ProberSettings:
    """The audit prober's settings (``audit.probe``; seconds for the durations)."""

    enabled: bool = _PROBE.enabled
    api_url: str = _PROBE.api_url
    """Base URL of the hit-rate API the prober asks and reports to."""
    interval: float = float(_PROBE.interval)
    """At most one probe per instance per interval."""
    concurrency: int = _PROBE.concurrency
    timeout: float = float(_PROBE.timeout)
    """One probe's whole budget (its HTTP calls and its wait for the index)."""
    index_deadline: float = float(_PROBE.index_deadline)
    """How long the index may take to show the probe's blocks ("events_missing" after)."""
    model: str = _PROBE.model
    """The served model name ('' = the instance's ``GET /v1/models``)."""
    prompt_blocks: int = _PROBE.prompt_blocks
    block_size: int = _PROBE.block_size
    """Block size when the index has not learned the instance's (no events yet)."""
    cache_salt: str = _PROBE.cache_salt

    @classmethod
    def from_config(cls, cfg: Config) -> ProberSettings:
        p = cfg.audit.probe
        return cls(
            enabled=p.enabled,
            api_url=p.api_url.rstrip("/"),
            interval=float(p.interval),
            concurrency=p.concurrency,
            timeout=float(p.timeout),
            index_deadline=float(p.index_deadline),
            model=p.model,
            prompt_blocks=p.prompt_blocks,
            block_size=p.block_size,
            cache_salt=p.cache_salt,
        )


def hash_settings(cfg: Config) -> HashSettings:
    """``blockKey`` as the block hasher takes it; raises ConfigError."""
    bk = cfg.block_key
    return HashSettings.from_strings(
        bk.prefix_caching_hash_algo, bk.python_hash_seed, bk.vllm_version
    )


def instance_limits(cfg: Config) -> Limits:
    """What an instance's state is judged by (the API's instances report, ``inspect``): the
    ingesters' ``ingest.l1.noEventsAfter`` and ``leaseTTL``."""
    l1 = cfg.ingest.l1
    return Limits(
        no_events_after=float(l1.no_events_after),
        lease_ttl=float(l1.lease_ttl),
        vllm_version=hash_settings(cfg).vllm_version,
        lookahead=cfg.block_key.hash_lookahead_tokens,
    )
