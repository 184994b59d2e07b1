"""The runtime config's schema: every key's dataclass, its type and its default.

Loading, environment overrides and validation are in :mod:`common.config`, which re-exports
every name here (callers import from ``common.config``). A new key is a field here with its
default; the choices of a key are the ``Literal`` aliases below (the loader checks them, the
chart's values.schema.json is generated from them: ``scripts/make_values_schema.py``).
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field
from typing import Any


# Every allowed choice of the config file, written once: the loader checks a value against its
# field's Literal (``_convert``), the settings and the chart's values.schema.json read the same
# aliases (scripts/make_values_schema.py).
LogLevel = typing.Literal["debug", "info", "warn", "warning", "error"]
LogFormat = typing.Literal["text", "json"]
HashAlgo = typing.Literal["sha256_cbor", "sha256"]
DiscoveryMode = typing.Literal["kubernetes", "static"]
GapPolicy = typing.Literal["keep", "clear"]
ShardMode = typing.Literal["lease", "static"]
Scheme = typing.Literal["http", "https"]
L3Scope = typing.Literal["segment", "pool"]


class Duration(float):
    """Seconds, parsed from a Go duration string."""


_DUR_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DUR_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> Duration:
    """Parse ``1m30s``/``500ms``/``0`` like Go's time.ParseDuration (no negatives)."""
    s = text.strip()
    if s == "0":
        return Duration(0.0)
    pos, total = 0, 0.0
    for m in _DUR_PART.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DUR_UNIT[m.group(2)]
        pos = m.end()
    if pos != len(s) or not s:
        raise ValueError(f"invalid duration {text!r} (use e.g. 10s, 1m30s, 500ms)")
    return Duration(total)


def _f(default: Any, yaml_name: str | None = None) -> Any:
    meta = {"yaml": yaml_name} if yaml_name else {}
    if callable(default):  # a class or a factory: a fresh mutable default per instance
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class HTTP:
    addr: str = ":28080"
    shutdown_timeout: Duration = _f(Duration(10))
    read_header_timeout: Duration = _f(Duration(10))
    read_timeout: Duration = _f(Duration(30))
    write_timeout: Duration = _f(Duration(30))
    idle_timeout: Duration = _f(Duration(120))
    max_header_bytes: int = 1048576
    max_hit_rate_body_bytes: int = 4194304
    max_candidates: int = 1024
    workers: int = 2
    threads: int = 4


@dataclass
class Log:
    level: LogLevel = "info"
    format: LogFormat = "text"


@dataclass
class BlockKey:
    python_hash_seed: str | None = "0"
    prefix_caching_hash_algo: HashAlgo = "sha256_cbor"
    use_int_block_hashes: bool = True
    vllm_version: str = "0.28.0"
    hash_lookahead_tokens: int = 0
    """vLLM's ``num_hash_lookahead_tokens`` (EAGLE/MTP speculative decoding, >= 0.33) for
    instances whose events have not shown theirs yet; an instance's events override it."""


@dataclass
class RedisTLS:
    """TLS to Redis (also on with a ``rediss://`` URL); files are PEM paths."""

    enabled: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure_skip_verify: bool = False


@dataclass
class RedisSentinel:
    """Redis Sentinel: where the sentinels are and which master they watch. The data nodes
    use ``redis.url``'s database and the data node's ``username``/``password``/``tls``; the
    sentinels have their own credentials and TLS (they are often set up apart)."""

    addresses: list[str] = _f(list)
    master_name: str = ""
    username: str = ""
    password: str = ""
    password_file: str = ""
    tls: RedisTLS = _f(RedisTLS)


@dataclass
class Redis:
    url: str = "redis://127.0.0.1:6379/0"
    socket_timeout: Duration = _f(Duration(2))
    connect_timeout: Duration = _f(Duration(2))
    cluster: bool = False
    username: str = ""
    password: str = ""
    password_file: str = ""
    health_check_interval: Duration = _f(Duration(30))
    tls: RedisTLS = _f(RedisTLS)
    sentinel: RedisSentinel = _f(RedisSentinel)


@dataclass
class Labels:
    engine_key: str = "openfuyao.com/engine"
    engine_value: str = "vllm"
    pd_role_key: str = "openfuyao.com/pdRole"
    pd_role_value: list[str] = _f(lambda: ["prefill", "aggregate"])
    kv_manager_key: str = "openfuyao.com/kvmanager"
    kv_manager_value: str = "mooncake"
    model_key: str = ""
    """This project's own: the pod label naming the served model (matched against
    ``ingest.l1.models``); empty = not read."""


@dataclass
class DiscoveryVLLM:
    zmq_port_name: str = "zmq-pub"
    zmq_port: int = 5557
    replay_port_name: str = ""
    replay_port: int = 0
    data_parallel_size: int = 1
    http_port_name: str = "http"
    """This project's own: the container port name of vLLM's OpenAI-compatible server (what
    the audit probes send requests to), else ``httpPort``; ``httpPort: 0`` = none."""
    http_port: int = 8000


@dataclass
class MooncakeMaster:
    http_port_name: str = "http"
    rpc_port_name: str = "rpc"
    http_port: int = 9003
    rpc_port: int = 0


@dataclass
class StaticVLLM:
    ip: str = ""
    zmq_endpoint: str = ""
    replay_endpoint: str = ""
    data_parallel_size: int = 1
    name: str = ""
    role: str = ""
    model: str = ""
    http_endpoint: str = ""
    """``http://host:port`` of the instance's OpenAI-compatible server (audit probes)."""


@dataclass
class StaticMaster:
    url: str = ""
    name: str = ""


@dataclass
class Static:
    vllm: list[StaticVLLM] = _f(list)
    mooncake_masters: list[StaticMaster] = _f(list)


@dataclass
class Discovery:
    mode: DiscoveryMode = "kubernetes"
    namespace: str = ""
    kubeconfig: str = ""
    refresh_interval: Duration = _f(Duration(10))
    segments_fetch_timeout: Duration = _f(Duration(2))
    lease_ttl: Duration = _f(Duration(15), "leaseTTL")
    labels: Labels = _f(Labels)
    vllm: DiscoveryVLLM = _f(DiscoveryVLLM)
    mooncake_master: MooncakeMaster = _f(MooncakeMaster)
    static: Static = _f(Static)


@dataclass
class IngestL1:
    backoff_initial: Duration = _f(Duration(1))
    backoff_max: Duration = _f(Duration(30))
    topic: str = ""
    on_unrecoverable_gap: GapPolicy = "keep"
    shard_mode: ShardMode = "lease"
    lease_ttl: Duration = _f(Duration(5), "leaseTTL")
    heartbeat_interval: Duration = _f(Duration(1))
    replay_timeout: Duration = _f(Duration(5))
    hash_check_rate: int = 100
    no_events_after: Duration = _f(Duration(30))
    prefix_match_unit: int = 0
    attention_chunk_size: int = 0
    models: list[L1Model] = _f(list)


@dataclass
class L1Model:
    """``ingest.l1.models[]``: hybrid-model settings for the instances serving one model."""

    name: str = ""
    prefix_match_unit: int = 0
    attention_chunk_size: int = 0


KEY_FORMATS = ("vllm", "vllm-ascend")
"""Mooncake key families the L3 poller understands (``ingest.l3.keyFormats``)."""


@dataclass
class L3Model:
    """``ingest.l3.models[]``: pinned counts for one model (0 = inferred from the keys)."""

    name: str = ""
    heads: int = 0
    pp_ranks: int = 0
    layers: int = 0


@dataclass
class IngestL3:
    scheme: Scheme = "http"
    poll_interval: Duration = _f(Duration(10))
    http_timeout: Duration = _f(Duration(5))
    scope: L3Scope = "segment"
    stale_after: Duration = _f(Duration(60))
    batch_size: int = 200
    key_formats: list[str] = _f(lambda: list(KEY_FORMATS))
    models: list[L3Model] = _f(list)


@dataclass
class Ingest:
    l1: IngestL1 = _f(IngestL1)
    l3: IngestL3 = _f(IngestL3)


@dataclass
class AuditProbe:
    """``audit.probe``: the active audit (``cache-indexer audit-probe``), off by default."""

    enabled: bool = False
    api_url: str = "http://127.0.0.1:28080"
    interval: Duration = _f(Duration(60))
    concurrency: int = 4
    timeout: Duration = _f(Duration(30))
    index_deadline: Duration = _f(Duration(10))
    model: str = ""
    prompt_blocks: int = 4
    block_size: int = 16
    cache_salt: str = "cache-indexer-probe"


@dataclass
class Metrics:
    port: int = 0
    addr: str = "127.0.0.1"
    liveness_timeout: Duration = _f(Duration(60))


@dataclass
class Audit:
    """``audit``: recording hit-rate answers and comparing them with outcome reports
    (``services/api/audit_record.py``, ``audit_outcome.py``)."""

    enabled: bool = True
    ttl: Duration = _f(Duration(600))
    max_records_per_second: int = 2000
    queue_size: int = 10000
    race_window: Duration = _f(Duration(30))
    max_report_bytes: int = 4096
    recent: int = 100
    worst_instances: int = 100
    probe: AuditProbe = _f(AuditProbe)


@dataclass
class Config:
    http: HTTP = _f(HTTP)
    log: Log = _f(Log)
    block_key: BlockKey = _f(BlockKey)
    redis: Redis = _f(Redis)
    discovery: Discovery = _f(Discovery)
    ingest: Ingest = _f(Ingest)
    metrics: Metrics = _f(Metrics)
    audit: Audit = _f(Audit)


def model_basename(name: str) -> str:
    """What vllm-ascend writes as the model: ``Qwen/Qwen2.5-7B-Instruct`` → ``Qwen2.5-7B-Instruct``,
    ``/data/models/x/`` → ``x`` (how a pinned model in ``ingest.l3.models`` is matched)."""
    return name.rstrip("/").split("/")[-1]
