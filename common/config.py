"""The runtime config file (the operator's ``config.yaml``): schema, defaults, validation.

The schema is the original service's (``http``, ``log``, ``blockKey``, ``discovery``,
``ingest``) plus this project's own keys (``redis``, ``metrics``, ``audit``,
``discovery.mode`` and ``discovery.static``, sharding and lease settings, ``ingest.l3.scope``
…), every one with a default, so an empty file is valid. Durations are Go-style strings
(``10s``, ``1m30s``, ``500ms``). The file is read once; *all* problems (unknown keys, wrong
types, bad values) are reported together in one :class:`~common.errors.ConfigError` naming each key.

A few environment variables override the file: ``CACHE_INDEXER_REDIS_URL`` (redis.url),
``CACHE_INDEXER_REDIS_USERNAME`` / ``CACHE_INDEXER_REDIS_PASSWORD`` (redis.username/password,
e.g. from a Kubernetes Secret), ``CACHE_INDEXER_REDIS_SENTINEL_ADDRESSES`` (comma-separated
host:port), ``CACHE_INDEXER_REDIS_SENTINEL_MASTER_NAME`` and
``CACHE_INDEXER_REDIS_SENTINEL_PASSWORD`` (redis.sentinel.*),
``POD_NAMESPACE`` (discovery.namespace, when the file leaves it empty), ``LOG_LEVEL``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.errors import ConfigError

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


def _yaml_name(f: dataclasses.Field[Any]) -> str:
    if "yaml" in f.metadata:
        return str(f.metadata["yaml"])
    head, *rest = f.name.split("_")
    return head + "".join(p.upper() if p in ("l1", "l3") else p.capitalize() for p in rest)


def _convert(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(tp):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)
    if origin is typing.Literal:
        return _choice(tp, value, path)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {type(value).__name__}")
            return []
        return [_convert(item, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if tp is Duration:
        return _duration(value, path, problems)
    if tp is bool:
        return value if isinstance(value, bool) else _bad(path, value, "true or false")
    if tp is int:
        return value if type(value) is int else _bad(path, value, "an integer")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        return _bad(path, value, "a string")
    raise AssertionError(f"unsupported config type {tp!r}")


class _Bad(Exception):
    pass


def _duration(value: Any, path: str, problems: list[str]) -> Duration:
    try:
        return parse_duration(str(value)) if isinstance(value, str) else _bad(path, value)
    except ValueError as exc:
        problems.append(f"{path}: {exc}")
        return Duration(0)


def choices(tp: Any) -> list[str]:
    """The allowed values of a choice field's ``Literal`` type, in their written order."""
    return [str(a) for a in typing.get_args(tp)]


def choice_keys(cls: Any = None, prefix: str = "") -> dict[str, list[str]]:
    """Every choice key of the file (dotted YAML path, e.g. ``ingest.l3.scope``) with its
    allowed values, read from the dataclasses' ``Literal`` fields."""
    found: dict[str, list[str]] = {}
    hints = typing.get_type_hints(Config if cls is None else cls)
    for f in dataclasses.fields(Config if cls is None else cls):
        path, tp = prefix + _yaml_name(f), hints[f.name]
        if typing.get_origin(tp) is typing.Literal:
            found[path] = choices(tp)
        elif dataclasses.is_dataclass(tp):
            found.update(choice_keys(tp, path + "."))
    return found


def _env_choice(tp: Any, path: str, value: str, problems: list[str]) -> Any:
    try:
        return _choice(tp, value, path)
    except _Bad as exc:
        problems.append(str(exc))
        return value


def _choice(tp: Any, value: Any, path: str) -> Any:
    allowed = choices(tp)
    if isinstance(value, str) and value in allowed:
        return value
    raise _Bad(f"{path}: {value!r} is not one of {sorted(allowed)}")


def _bad(path: str, value: Any, expected: str = "a Go duration string like 10s") -> Any:
    raise _Bad(f"{path}: expected {expected}, got {value!r}")


def _build(cls: Any, raw: Any, path: str, problems: list[str]) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{path or 'config'}: expected a mapping, got {type(raw).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    by_yaml = {_yaml_name(f): f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        sub = f"{path}.{key}" if path else str(key)
        f = by_yaml.get(str(key))
        if f is None:
            problems.append(f"{sub}: unknown key")
            continue
        try:
            kwargs[f.name] = _convert(hints[f.name], value, sub, problems)
        except _Bad as exc:
            problems.append(str(exc))
    return cls(**kwargs)


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


def _check_values(cfg: Config, problems: list[str]) -> None:
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
    if cfg.ingest.l3.poll_interval <= 0:
        problems.append("ingest.l3.pollInterval: must be > 0")
    if cfg.metrics.liveness_timeout <= 0:
        problems.append("metrics.livenessTimeout: must be > 0")
    _check_redis(cfg.redis, problems)
    _check_l3_keys(cfg.ingest.l3, problems)


def _sentinel_from_env(s: RedisSentinel, env: dict[str, str]) -> None:
    if env.get("CACHE_INDEXER_REDIS_SENTINEL_ADDRESSES"):
        addresses = env["CACHE_INDEXER_REDIS_SENTINEL_ADDRESSES"].split(",")
        s.addresses = [a.strip() for a in addresses if a.strip()]
    s.master_name = env.get("CACHE_INDEXER_REDIS_SENTINEL_MASTER_NAME") or s.master_name
    s.password = env.get("CACHE_INDEXER_REDIS_SENTINEL_PASSWORD") or s.password


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


def model_basename(name: str) -> str:
    """What vllm-ascend writes as the model: ``Qwen/Qwen2.5-7B-Instruct`` → ``Qwen2.5-7B-Instruct``,
    ``/data/models/x/`` → ``x`` (how a pinned model in ``ingest.l3.models`` is matched)."""
    return name.rstrip("/").split("/")[-1]


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


def _keep_seed_text(raw: Any, root: yaml.Node | None) -> None:
    """``pythonHashSeed: 010`` means the string "010" to vLLM (and to the Go original, whose
    field is a string), not YAML's octal 8: keep an unquoted number's text as written."""
    node: Any = root
    for key in ("blockKey", "pythonHashSeed"):
        if not isinstance(node, yaml.MappingNode):
            return
        node = next((v for k, v in node.value if getattr(k, "value", None) == key), None)
    if isinstance(node, yaml.ScalarNode) and node.tag.endswith((":int", ":float")):
        raw["blockKey"]["pythonHashSeed"] = node.value


def load_config(
    path: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None
) -> Config:
    """Load and validate the config file (``None`` = defaults only), then apply env overrides."""
    env = dict(os.environ) if env is None else env
    raw: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
            raw = yaml.safe_load(text)
            _keep_seed_text(raw, yaml.compose(text))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    problems: list[str] = []
    cfg: Config = _build(Config, raw, "", problems)
    if env.get("CACHE_INDEXER_REDIS_URL"):
        cfg.redis.url = env["CACHE_INDEXER_REDIS_URL"]
    cfg.redis.username = env.get("CACHE_INDEXER_REDIS_USERNAME") or cfg.redis.username
    cfg.redis.password = env.get("CACHE_INDEXER_REDIS_PASSWORD") or cfg.redis.password
    _sentinel_from_env(cfg.redis.sentinel, env)
    if not cfg.discovery.namespace and env.get("POD_NAMESPACE"):
        cfg.discovery.namespace = env["POD_NAMESPACE"]
    if env.get("LOG_LEVEL"):
        cfg.log.level = _env_choice(LogLevel, "log.level", env["LOG_LEVEL"].lower(), problems)
    _check_values(cfg, problems)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))
    return cfg


def config_path_from(argv_value: str | None, env: dict[str, str] | None = None) -> str | None:
    """The config path: ``--config`` if given, else ``CACHE_INDEXER_CONFIG``, else none."""
    env = dict(os.environ) if env is None else env
    return argv_value or env.get("CACHE_INDEXER_CONFIG") or None


def parse_listen_addr(addr: str) -> tuple[str, int]:
    """Go-style ``host:port`` / ``:port`` → (host, port); an empty host means all interfaces."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"http.addr: {addr!r} is not host:port")
    return (host.strip("[]") or "0.0.0.0"), int(port)
