"""The runtime config file (the operator's ``config.yaml``): loading, overrides, validation.

The schema (every key's dataclass and default) is in :mod:`common.config_schema`; its names are
re-exported here.

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
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from common.config_schema import (
    Audit,
    AuditProbe,
    BlockKey,
    Config,
    Discovery,
    DiscoveryMode,
    DiscoveryVLLM,
    Duration,
    GapPolicy,
    HashAlgo,
    HTTP,
    Ingest,
    IngestL1,
    IngestL3,
    KEY_FORMATS,
    L1Model,
    L3Model,
    L3Scope,
    Labels,
    Log,
    LogFormat,
    LogLevel,
    Metrics,
    MooncakeMaster,
    parse_duration,
    Redis,
    RedisSentinel,
    RedisTLS,
    Scheme,
    ShardMode,
    Static,
    StaticMaster,
    StaticVLLM,
    model_basename,
)
from common.config_checks import check_values
from common.errors import ConfigError

# The schema's names are re-exported: callers import every config name from here.
__all__ = [
    "Audit",
    "AuditProbe",
    "BlockKey",
    "choice_keys",
    "choices",
    "Config",
    "config_path_from",
    "Discovery",
    "DiscoveryMode",
    "DiscoveryVLLM",
    "Duration",
    "GapPolicy",
    "HashAlgo",
    "HTTP",
    "Ingest",
    "IngestL1",
    "IngestL3",
    "KEY_FORMATS",
    "L1Model",
    "L3Model",
    "L3Scope",
    "Labels",
    "load_config",
    "Log",
    "LogFormat",
    "LogLevel",
    "Metrics",
    "model_basename",
    "MooncakeMaster",
    "parse_duration",
    "parse_listen_addr",
    "Redis",
    "RedisSentinel",
    "RedisTLS",
    "Scheme",
    "ShardMode",
    "Static",
    "StaticMaster",
    "StaticVLLM",
]


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


def _sentinel_from_env(s: RedisSentinel, env: dict[str, str]) -> None:
    if env.get("CACHE_INDEXER_REDIS_SENTINEL_ADDRESSES"):
        addresses = env["CACHE_INDEXER_REDIS_SENTINEL_ADDRESSES"].split(",")
        s.addresses = [a.strip() for a in addresses if a.strip()]
    s.master_name = env.get("CACHE_INDEXER_REDIS_SENTINEL_MASTER_NAME") or s.master_name
    s.password = env.get("CACHE_INDEXER_REDIS_SENTINEL_PASSWORD") or s.password


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
    check_values(cfg, problems)
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
