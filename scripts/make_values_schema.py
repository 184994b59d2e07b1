"""Generates charts/cache-indexer/values.schema.json from the chart's values.yaml.

    python scripts/make_values_schema.py          # writes the schema
    python scripts/make_values_schema.py --check  # exit 1 if the committed one differs

Every mapping of values.yaml becomes an object that rejects unknown keys
(``additionalProperties: false``) and every value a type taken from its default, so a
misspelt or misplaced key, or a wrong type, fails ``helm install/upgrade/template/lint``
instead of being ignored. :data:`OVERRIDES` says where the default's type is not the whole
story: Kubernetes objects passed through as they are (free form), enumerations, numbers that
may be written as text, and ``redis.sentinel``, which the Redis HA work defines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.config import KEY_FORMATS, choice_keys  # noqa: E402 (the checkout's own config)

CHART = ROOT / "charts" / "cache-indexer"
OUTPUT = CHART / "values.schema.json"

_FREE_OBJECT: dict[str, Any] = {"type": "object"}
_FREE_LIST: dict[str, Any] = {"type": "array"}
_STRINGS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
_QUANTITY: dict[str, Any] = {"type": ["string", "number"]}
_RESOURCES: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "limits": {"type": "object", "additionalProperties": _QUANTITY},
        "requests": {"type": "object", "additionalProperties": _QUANTITY},
        "claims": {"type": "array"},
    },
}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def config_choices() -> dict[str, set[str]]:
    """The config file's enumerated keys (``common.config``): the same words, checked at
    ``helm install`` instead of when a pod starts."""
    return {key: set(allowed) for key, allowed in choice_keys().items()}


# Dotted path (``*`` = any component) → schema used instead of the default's.
OVERRIDES: dict[str, dict[str, Any]] = {
    # Kubernetes objects and maps handed to the manifests as they are.
    "imagePullSecrets": _FREE_LIST,
    "podAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
    "podLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
    "tolerations": _FREE_LIST,
    "affinity": _FREE_OBJECT,
    "podSecurityContext": _FREE_OBJECT,
    "securityContext": _FREE_OBJECT,
    "extraEnv": {"type": "array", "items": {"type": "object"}},
    "resources": _RESOURCES,
    "*.resources": _RESOURCES,
    "redis.resources": _RESOURCES,
    "redis.extraArgs": _STRINGS,
    "metrics.serviceMonitor.labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "metrics.prometheusRule.labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "metrics.grafanaDashboard.labels": {
        "type": "object",
        "additionalProperties": {"type": "string"},
    },
    "metrics.grafanaDashboard.annotations": {
        "type": "object",
        "additionalProperties": {"type": "string"},
    },
    "networkPolicy.apiFrom": {"type": "array", "items": {"type": "object"}},
    "networkPolicy.metricsFrom": {"type": "array", "items": {"type": "object"}},
    "networkPolicy.extraEgress": {"type": "array", "items": {"type": "object"}},
    "networkPolicy.kubeAPIPorts": {"type": "array", "items": {"type": "integer"}},
    "api.topologySpread.topologyKeys": _STRINGS,
    "api.topologySpread.whenUnsatisfiable": _enum("ScheduleAnyway", "DoNotSchedule"),
    # Enumerations of the chart's own values; the config file's come from common.config.
    "image.pullPolicy": _enum("Always", "IfNotPresent", "Never"),
    "redis.image.pullPolicy": _enum("Always", "IfNotPresent", "Never"),
    "service.type": _enum("ClusterIP", "NodePort", "LoadBalancer"),
    **{path: _enum(*sorted(allowed)) for path, allowed in config_choices().items()},
    "ingest.l3.keyFormats": {
        "type": "array",
        "items": {"type": "string", "enum": list(KEY_FORMATS)},
    },
    "redis.persistence.appendfsync": _enum("always", "everysec", "no"),
    # Text the config file takes as a string but users write as a number.
    "blockKey.pythonHashSeed": {"type": ["string", "integer", "null"]},
    "blockKey.vllmVersion": {"type": ["string", "number"]},
    "image.tag": {"type": ["string", "number"]},
    "redis.image.tag": {"type": ["string", "number"]},
    "service.targetPort": {"type": ["integer", "string"]},
    "discovery.labels.pdRoleValue": _STRINGS,
    "ingest.l1.models": {"type": "array", "items": {"type": "object"}},
    "ingest.l3.models": {"type": "array", "items": {"type": "object"}},
    "redis.maxmemory": {"type": ["string", "integer"]},
    # Redis Sentinel (issue 19 defines the values): typed where known, open to more keys.
    "redis.sentinel": {
        "type": "object",
        "properties": {
            "enabled": {"type": "boolean"},
            "addresses": _STRINGS,
            "masterName": {"type": "string"},
            "password": {"type": "string"},
            "existingSecret": {"type": "string"},
            "existingSecretKey": {"type": "string"},
            "tls": {"type": "boolean"},
        },
    },
}
# redis.sentinel is allowed even where values.yaml does not (yet) have it.
ALWAYS = {"redis": ("sentinel",)}


def _type_of(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    if isinstance(value, list):
        types = {json.dumps(_type_of(v), sort_keys=True) for v in value}
        items = json.loads(types.pop()) if len(types) == 1 else {}
        return {"type": "array", "items": items} if items else {"type": "array"}
    raise ValueError(f"no schema for {value!r}")


def _override(path: str) -> dict[str, Any] | None:
    if path in OVERRIDES:
        return OVERRIDES[path]
    head, _, tail = path.partition(".")
    return OVERRIDES.get(f"*.{tail}") if tail and "." not in tail else None


def schema_of(value: Any, path: str = "") -> dict[str, Any]:
    found = _override(path) if path else None
    if found is not None:
        return found
    if not isinstance(value, dict):
        return _type_of(value)
    props = {k: schema_of(v, f"{path}.{k}" if path else k) for k, v in value.items()}
    for extra in ALWAYS.get(path, ()):
        props.setdefault(extra, schema_of(None, f"{path}.{extra}"))
    return {"type": "object", "additionalProperties": False, "properties": props}


def build() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    schema = schema_of(values)
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "cache-indexer chart values (generated by scripts/make_values_schema.py)",
        **schema,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="fail if the committed schema differs")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        same = OUTPUT.exists() and OUTPUT.read_text(encoding="utf-8") == text
        if not same:
            print(f"{OUTPUT} is not what scripts/make_values_schema.py generates", file=sys.stderr)
        return 0 if same else 1
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
