"""Generates cache-indexer's Grafana dashboard with Grafana's grafana-foundation-sdk.

    python scripts/make_dashboard.py          # writes both copies below
    python scripts/make_dashboard.py --check  # exit 1 if a committed copy differs

The JSON goes to docs/grafana-dashboard.json (to import by hand) and to
charts/cache-indexer/files/grafana-dashboard.json (the chart's ConfigMap for Grafana's
dashboard sidecar, metrics.grafanaDashboard). :data:`ROWS` is the whole content: rows of
panels, each with its PromQL; :func:`queries` lists them for
tests/integration/test_prometheus_stack.py, which runs every one against a real Prometheus.
Queries take ``max by (server_ip)`` of the per-instance gauges because every API pod
reports them alike, and zero-fill rare counters (``or … * 0``) so a healthy system shows 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

ROOT = Path(__file__).resolve().parent.parent
OUTPUTS = (
    ROOT / "docs" / "grafana-dashboard.json",
    ROOT / "charts" / "cache-indexer" / "files" / "grafana-dashboard.json",
)
UID = "cache-indexer"
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    kind: str = "timeseries"  # timeseries | stat | heatmap
    description: str = ""


def _api_rows() -> list[Panel]:
    req = "cache_indexer_api_requests_total"
    lat = "cache_indexer_api_request_duration_seconds_bucket"
    best = "cache_indexer_api_best_hit_ratio_bucket"
    return [
        Panel(
            "Requests/s by endpoint and status",
            "reqps",
            ((f"sum by (path, status) (rate({req}[{RATE}]))", "{{path}} {{status}}"),),
        ),
        Panel(
            "5xx ratio by endpoint",
            "percentunit",
            (
                (
                    f'(sum by (path) (rate({req}{{status=~"5.."}}[{RATE}]))'
                    f" or sum by (path) (rate({req}[{RATE}])) * 0)"
                    f" / sum by (path) (rate({req}[{RATE}]))",
                    "{{path}}",
                ),
            ),
        ),
        Panel(
            "Latency p50 / p99 by endpoint",
            "s",
            tuple(
                (
                    f"histogram_quantile({q}, sum by (le, path) (rate({lat}[{RATE}])))",
                    f"p{int(q * 100)} {{{{path}}}}",
                )
                for q in (0.5, 0.99)
            ),
        ),
        Panel(
            "Lower-bound (inexact) answers/s by tier and reason",
            "ops",
            (
                (
                    "sum by (tier, reason) (rate(cache_indexer_api_inexact_answers_total"
                    f"[{RATE}])) or sum(rate({req}[{RATE}])) * 0",
                    "{{tier}} {{reason}}",
                ),
            ),
        ),
        *(
            Panel(
                f"Best {tier.upper()} hit ratio per request (distribution)",
                "short",
                ((f'sum by (le) (increase({best}{{tier="{tier}"}}[{RATE}]))', "{{le}}"),),
                kind="heatmap",
                description="Per hit-rate request, the highest ratio among its candidates.",
            )
            for tier in ("l1", "l3")
        ),
    ]


def _instance_rows() -> list[Panel]:
    events = "cache_indexer_l1_events_total"
    return [
        Panel(
            "Instances by L1 state",
            "short",
            (
                (
                    "sum by (state) (max by (server_ip, state) (cache_indexer_instance_l1_state))",
                    "{{state}}",
                ),
            ),
            kind="stat",
        ),
        Panel(
            "Instances by hash self-check verdict",
            "short",
            (
                (
                    "sum by (result) (max by (server_ip, result) "
                    "(cache_indexer_instance_l1_hash_check))",
                    "{{result}}",
                ),
            ),
            kind="stat",
        ),
        Panel(
            "KV events applied/s by type and outcome",
            "ops",
            ((f"sum by (type, outcome) (rate({events}[{RATE}]))", "{{type}} {{outcome}}"),),
        ),
        Panel(
            "Sequence gaps and replays",
            "short",
            (
                (
                    f"sum by (outcome) (increase(cache_indexer_l1_gaps_total[{RATE}]))"
                    f" or sum(rate({events}[{RATE}])) * 0",
                    "gaps {{outcome}}",
                ),
                (
                    f"sum by (result) (increase(cache_indexer_l1_replays_total[{RATE}]))"
                    f" or sum(rate({events}[{RATE}])) * 0",
                    "replays {{result}}",
                ),
            ),
        ),
        Panel(
            "Blocks indexed by tier",
            "short",
            (
                (
                    "sum by (tier) (max by (server_ip, tier) (cache_indexer_instance_blocks))",
                    "{{tier}}",
                ),
            ),
        ),
        Panel(
            "Seconds since each instance's last KV-event batch",
            "s",
            (
                (
                    "max by (server_ip) (cache_indexer_instance_l1_last_event_age_seconds)",
                    "{{server_ip}}",
                ),
            ),
        ),
        Panel(
            "Batch apply latency p99 (per ingester)",
            "s",
            (
                (
                    "histogram_quantile(0.99, sum by (le, instance) "
                    f"(rate(cache_indexer_l1_apply_seconds_bucket[{RATE}])))",
                    "{{instance}}",
                ),
            ),
        ),
        Panel(
            "Subscribed ranks per ingester",
            "short",
            (("sum by (instance) (cache_indexer_l1_subscribed_ranks)", "{{instance}}"),),
        ),
    ]


def _l3_rows() -> list[Panel]:
    return [
        Panel(
            "Seconds since each master's last good poll",
            "s",
            (("max by (url) (cache_indexer_master_poll_age_seconds)", "{{url}}"),),
        ),
        Panel(
            "Keys per master (parsed, unparsed, unmappable group)",
            "short",
            tuple(
                (f"max by (url) (cache_indexer_master_{name})", f"{label} {{{{url}}}}")
                for name, label in (
                    ("keys", "keys"),
                    ("keys_unparsed", "unparsed"),
                    ("keys_unmappable_group", "unmappable"),
                )
            ),
        ),
        Panel(
            "Poll duration p99 by master",
            "s",
            (
                (
                    "histogram_quantile(0.99, sum by (le, master) "
                    f"(rate(cache_indexer_l3_poll_seconds_bucket[{RATE}])))",
                    "{{master}}",
                ),
            ),
        ),
        Panel(
            "Poll errors/s by master and reason; stale masters",
            "short",
            (
                (
                    f"sum by (master, reason) (rate(cache_indexer_l3_errors_total[{RATE}]))"
                    " or sum(cache_indexer_master_stale) * 0",
                    "errors {{master}} {{reason}}",
                ),
                ("max by (url) (cache_indexer_master_stale)", "stale {{url}}"),
            ),
        ),
    ]


def _platform_rows() -> list[Panel]:
    return [
        Panel(
            "Redis memory",
            "bytes",
            (
                ("max(cache_indexer_redis_used_memory_bytes)", "used"),
                ("max(cache_indexer_redis_maxmemory_bytes)", "maxmemory (0 = unbounded)"),
            ),
        ),
        Panel(
            "Redis errors/s seen by the API, by operation",
            "ops",
            (
                (
                    f"sum by (op) (rate(cache_indexer_api_redis_errors_total[{RATE}]))"
                    " or sum(cache_indexer_worker_live) * 0",
                    "{{op}}",
                ),
            ),
        ),
        Panel(
            "Worker liveness (1 = every loop progresses)",
            "short",
            (("cache_indexer_worker_live", "{{job}} {{instance}}"),),
        ),
        Panel(
            "Worker readiness conditions (1 = holds)",
            "short",
            (("cache_indexer_worker_condition", "{{job}} {{instance}} {{condition}}"),),
        ),
        Panel(
            "Discovery: instances and masters seen, lease holders",
            "short",
            (
                ("max(cache_indexer_discovery_instances)", "instances"),
                ("max(cache_indexer_discovery_masters)", "masters"),
                ("sum(cache_indexer_discovery_lease_held)", "lease holders"),
            ),
        ),
    ]


def _audit_rows() -> list[Panel]:
    out, diff = (
        "cache_indexer_api_audit_outcomes_total",
        "cache_indexer_api_audit_difference_tokens",
    )
    share = (
        f'(sum by (source) (rate({out}{{explained="false"}}[{RATE}]))'
        f" or sum by (source) (rate({out}[{RATE}])) * 0) / sum by (source) (rate({out}[{RATE}]))"
    )
    records = f"sum by (result) (rate(cache_indexer_api_audit_records_total[{RATE}]))"
    return [
        Panel(
            "Outcome reports/s by verdict",
            "ops",
            ((f"sum by (verdict, explained) (rate({out}[{RATE}]))", "{{verdict}} {{explained}}"),),
        ),
        Panel("Unexplained share of outcome reports", "percentunit", ((share, "{{source}}"),)),
        Panel(
            "Token difference p50 / p99 (|realized - predicted|)",
            "short",
            tuple(
                (f"histogram_quantile({q}, sum by (le) (rate({diff}_bucket[{RATE}])))", f"p{q}")
                for q in (0.5, 0.99)
            ),
        ),
        Panel("Audit records/s by result", "ops", ((records, "{{result}}"),)),
    ]


ROWS: list[tuple[str, list[Panel]]] = [
    ("Hit-rate API", _api_rows()),
    ("Instances (L1)", _instance_rows()),
    ("Mooncake masters (L3)", _l3_rows()),
    ("Redis and workers", _platform_rows()),
    ("Prediction audit", _audit_rows()),
]


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, in dashboard order."""
    return [(p.title, expr) for _, panels in ROWS for p in panels for expr, _ in p.targets]


_BUILDERS: dict[str, Any] = {
    "timeseries": timeseries.Panel,
    "stat": stat.Panel,
    "heatmap": heatmap.Panel,
}


def _panel(panel: Panel, panel_id: int) -> Any:
    builder = (
        _BUILDERS[panel.kind]()
        .id(panel_id)
        .title(panel.title)
        .unit(panel.unit)
        .datasource(DataSourceRef(type_val="prometheus", uid="${datasource}"))
    )
    if panel.description:
        builder = builder.description(panel.description)
    for i, (expr, legend) in enumerate(panel.targets):
        query = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i))
        if panel.kind == "heatmap":
            query = query.format("heatmap")
        builder = builder.with_target(query)
    return builder


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    board = (
        dashboard.Dashboard("cache-indexer")
        .uid(UID)
        .tags(["cache-indexer", "vllm", "kv-cache"])
        .refresh("30s")
        .time("now-3h", "now")
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        )
    )
    panel_id = 1
    for title, panels in ROWS:
        board = board.with_row(dashboard.Row(title).id(panel_id))
        panel_id += 1
        for panel in panels:
            board = board.with_panel(_panel(panel, panel_id))
            panel_id += 1
    doc: dict[str, Any] = json.loads(JSONEncoder(sort_keys=True).encode(board.build()))
    return doc


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="fail if a committed copy differs")
    args = p.parse_args(argv)
    text = render()
    stale = [str(path) for path in OUTPUTS if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is not what scripts/make_dashboard.py generates", file=sys.stderr)
        return 1 if stale else 0
    for path in OUTPUTS:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
