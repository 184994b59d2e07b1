"""The config's value checks: every rule a loaded :class:`~common.config.Config` must meet
beyond its types (positive sizes, readable files, URL schemes, sentinel addresses, …).

:func:`check_values` appends one message per problem, naming the key; the loader
(:func:`common.config.load_config`) raises them together as one ``ConfigError``.
"""

from __future__ import annotations

import os

from common.config_schema import (
    KEY_FORMATS,
    AuditProbe,
    BlockKey,
    Config,
    IngestL1,
    IngestL3,
    L1Model,
    Redis,
    RedisTLS,
    model_basename,
)
from common.event_types import MAX_LOOKAHEAD


def _check_token_counts(cfg: Config, problems: list[str]) -> None:
    l1 = cfg.ingest.l1
    entries: list[tuple[str, IngestL1 | L1Model]] = [("ingest.l1", l1)]
    entries += [(f"ingest.l1.models[{i}]", m) for i, m in enumerate(l1.models)]
    for where, entry in entries:
        for camel, value in (
            ("prefixMatchUnit", entry.prefix_match_unit),
            ("attentionChunkSize", entry.attention_chunk_size),
        ):
            if value < 0:
                problems.append(f"{where}.{camel}: must be 0 (unknown) or a number of tokens")
    names = [m.name for m in l1.models]
    for i, name in enumerate(names):
        if not name:
            problems.append(f"ingest.l1.models[{i}].name: must be the served model's name")
        elif name in names[:i]:
            problems.append(f"ingest.l1.models[{i}].name: {name!r} is listed twice")


def check_values(cfg: Config, problems: list[str]) -> None:
    for dotted, value in (
        ("http.maxHitRateBodyBytes", cfg.http.max_hit_rate_body_bytes),
        ("http.maxHeaderBytes", cfg.http.max_header_bytes),
        ("http.maxCandidates", cfg.http.max_candidates),
        ("http.workers", cfg.http.workers),
        ("http.threads", cfg.http.threads),
        ("ingest.l3.batchSize", cfg.ingest.l3.batch_size),
        ("ingest.l1.noEventsAfter", cfg.ingest.l1.no_events_after),
        ("audit.ttl", cfg.audit.ttl),
        ("audit.maxRecordsPerSecond", cfg.audit.max_records_per_second),
        ("audit.queueSize", cfg.audit.queue_size),
        ("audit.raceWindow", cfg.audit.race_window),
        ("audit.maxReportBytes", cfg.audit.max_report_bytes),
        ("audit.recent", cfg.audit.recent),
        ("audit.worstInstances", cfg.audit.worst_instances),
    ):
        if value <= 0:
            problems.append(f"{dotted}: must be > 0, got {value}")
    if cfg.ingest.l1.backoff_initial > cfg.ingest.l1.backoff_max:
        problems.append("ingest.l1.backoffInitial: must not exceed ingest.l1.backoffMax")
    l1 = cfg.ingest.l1
    if not 0 < l1.heartbeat_interval <= l1.lease_ttl / 2:
        problems.append("ingest.l1.heartbeatInterval: must be > 0 and at most half of leaseTTL")
    _check_token_counts(cfg, problems)
    if cfg.ingest.l1.hash_check_rate < 0:
        problems.append("ingest.l1.hashCheckRate: must be >= 0 (0 = off)")
    _check_lookahead(cfg.block_key, problems)
    if cfg.ingest.l3.poll_interval <= 0:
        problems.append("ingest.l3.pollInterval: must be > 0")
    if cfg.metrics.liveness_timeout <= 0:
        problems.append("metrics.livenessTimeout: must be > 0")
    _check_probe(cfg.audit.probe, problems)
    _check_redis(cfg.redis, problems)
    _check_l3_keys(cfg.ingest.l3, problems)


def _check_probe(p: AuditProbe, problems: list[str]) -> None:
    for name, value in (
        ("interval", p.interval),
        ("timeout", p.timeout),
        ("indexDeadline", p.index_deadline),
        ("concurrency", p.concurrency),
        ("promptBlocks", p.prompt_blocks),
        ("blockSize", p.block_size),
    ):
        if value <= 0:
            problems.append(f"audit.probe.{name}: must be > 0, got {value}")
    if not p.api_url.startswith(("http://", "https://")):
        problems.append(f"audit.probe.apiUrl: {p.api_url!r} is not an http(s):// URL")
    if not p.cache_salt:
        problems.append("audit.probe.cacheSalt: the probes need a salt of their own")


def _check_lookahead(bk: BlockKey, problems: list[str]) -> None:
    lookahead, where = bk.hash_lookahead_tokens, "blockKey.hashLookaheadTokens"
    if not 0 <= lookahead <= MAX_LOOKAHEAD:
        problems.append(f"{where}: must be 0 (none) to {MAX_LOOKAHEAD} tokens, got {lookahead}")
    elif lookahead and _version_tuple(bk.vllm_version) < (0, 33):
        problems.append(f"{where}: vLLM hashes lookahead tokens from 0.33 on (vllmVersion)")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _check_redis(r: Redis, problems: list[str]) -> None:
    if not r.url.startswith(("redis://", "rediss://", "unix://")):
        hint = " (for Sentinel set redis.sentinel)" if "sentinel" in r.url.split("://")[0] else ""
        problems.append(f"redis.url: {r.url!r} is not a redis://, rediss:// or unix:// URL{hint}")
    if r.cluster and r.url.startswith("unix://"):
        problems.append("redis.cluster: a cluster is reached over TCP, not a unix:// URL")
    _check_files("redis", r.password_file, r.tls, problems)
    _check_sentinel(r, problems)


def _check_files(where: str, password_file: str, tls: RedisTLS, problems: list[str]) -> None:
    for name, path in (
        ("passwordFile", password_file),
        ("tls.caFile", tls.ca_file),
        ("tls.certFile", tls.cert_file),
        ("tls.keyFile", tls.key_file),
    ):
        if path and not os.access(path, os.R_OK):
            problems.append(f"{where}.{name}: cannot read {path}")
    if bool(tls.cert_file) != bool(tls.key_file):
        problems.append(f"{where}.tls: certFile and keyFile go together (client certificate)")


def _check_sentinel(r: Redis, problems: list[str]) -> None:
    s = r.sentinel
    if not s.addresses:
        if s.master_name:
            problems.append("redis.sentinel.addresses: name the sentinels (host:port)")
        return
    if not s.master_name:
        problems.append("redis.sentinel.masterName: the name the sentinels monitor")
    if r.cluster:
        problems.append("redis.sentinel: a Redis Cluster fails over by itself, no Sentinel")
    for i, address in enumerate(s.addresses):
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit()):
            problems.append(f"redis.sentinel.addresses[{i}]: {address!r} is not host:port")
    _check_files("redis.sentinel", s.password_file, s.tls, problems)


def _check_l3_keys(l3: IngestL3, problems: list[str]) -> None:
    formats = l3.key_formats
    if not formats:
        problems.append(f"ingest.l3.keyFormats: must name at least one of {list(KEY_FORMATS)}")
    for i, name in enumerate(formats):
        if name not in KEY_FORMATS:
            problems.append(
                f"ingest.l3.keyFormats[{i}]: {name!r} is not one of {list(KEY_FORMATS)}"
            )
    seen: set[str] = set()
    for i, model in enumerate(l3.models):
        where = f"ingest.l3.models[{i}]"
        base = model_basename(model.name)
        if not base:
            problems.append(f"{where}.name: must be the model (the key's model field or --model)")
        elif base in seen:
            problems.append(f"{where}.name: {model.name!r} is pinned twice")
        seen.add(base)
        for field_name, value in (
            ("heads", model.heads),
            ("ppRanks", model.pp_ranks),
            ("layers", model.layers),
        ):
            if value < 0:
                problems.append(f"{where}.{field_name}: must be >= 0 (0 = inferred), got {value}")
