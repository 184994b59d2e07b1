"""``cache-indexer audit --config FILE [--json]``: are the answers what the engines reused?

Prints what ``GET /kv-cache/audit`` answers, read straight from Redis with the same code
(:mod:`common.audit_report`): the outcome totals, the instances with the most unexplained
discrepancies (reports, exact/under/over, unexplained share, mean token difference), then the
latest discrepancies with what helps debug them (predicted vs realized tokens, cause, first
differing block, block size, salt, prompt lengths, inexact reasons). Unexplained rows are
shown in colour when stdout is a terminal (``NO_COLOR`` turns that off). ``--json`` prints
the document. Exit status: 0, 1 if Redis cannot be read, 2 for a bad config.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, TextIO

from common import shell
from common.audit_report import read_audit
from common.config import Config
from common.redis_client import Client
from services.tools.report_cmd import RED, run, table

_PROG = "cache-indexer audit"
_WORST_COLS = (
    "SERVER_IP",
    "REPORTS",
    "EXACT",
    "UNDER",
    "OVER",
    "UNEXPLAINED",
    "UNEXPL_%",
    "MEAN_DIFF",
    "LAST_REPORT",
)
_RECENT_COLS = (
    "AGE",
    "REQUEST_ID",
    "SERVER_IP",
    "SOURCE",
    "VERDICT",
    "PREDICTED",
    "REALIZED",
    "DIFF",
    "CAUSE",
    "FIRST_BLOCK",
    "BS",
    "SALT",
    "PROMPT",
    "INEXACT",
)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = shell.parser(_PROG, __doc__.split("\n")[0], metrics_port=False)
    p.add_argument("--json", action="store_true", help="print the JSON document instead")
    p.add_argument("--worst", type=int, default=None, help="instances to list")
    p.add_argument("--recent", type=int, default=None, help="discrepancies to list")
    return p.parse_args(argv)


def main(argv: list[str], out: TextIO | None = None) -> int:
    args = _parse(argv)

    def read(cfg: Config, client: Client) -> dict[str, Any]:
        worst = cfg.audit.worst_instances if args.worst is None else max(0, args.worst)
        recent = cfg.audit.recent if args.recent is None else max(0, args.recent)
        doc = read_audit(client, worst, recent)
        doc["enabled"] = cfg.audit.enabled
        return doc

    return run(_PROG, args, out, read, lambda doc, color: render(doc, color, _now_ms()))


def _now_ms() -> int:
    return int(time.time() * 1000)


def render(doc: dict[str, Any], color: bool = False, now_ms: int = 0) -> str:
    """The totals line and the two tables."""
    text = _totals_line(doc.get("totals", {}))
    if not doc.get("enabled", True):
        text = "the audit is off (audit.enabled: false)\n" + text
    worst = [(_worst_row(w, now_ms), _red(w["unexplained"])) for w in doc["worst_instances"]]
    text += "\n" + (table(_WORST_COLS, worst, color) if worst else "no unexplained reports\n")
    recent = [
        (_recent_row(d, now_ms), _red(not d.get("explained"))) for d in doc["recent_discrepancies"]
    ]
    text += "\n" + (table(_RECENT_COLS, recent, color) if recent else "no discrepancies\n")
    return text


def _totals_line(totals: dict[str, int]) -> str:
    exact, under, over = (totals.get(v, 0) for v in ("exact", "under", "over"))
    reports = exact + under + over
    unexplained = sum(n for k, n in totals.items() if ":unexplained:" in k)
    share = f"{100 * exact / reports:.1f}%" if reports else "-"
    return (
        f"reports {reports}  exact {exact} ({share})  under {under}  over {over}  "
        f"unexplained {unexplained}\n"
    )


def _worst_row(w: dict[str, Any], now_ms: int) -> list[str]:
    reports = w["reports"]
    return [
        w["server_ip"],
        str(reports),
        str(w["exact"]),
        str(w["under"]),
        str(w["over"]),
        str(w["unexplained"]),
        f"{100 * w['unexplained'] / reports:.1f}" if reports else "-",
        f"{w['difference_tokens'] / reports:.1f}" if reports else "-",
        _age(w["last_report_ms"], now_ms),
    ]


def _recent_row(d: dict[str, Any], now_ms: int) -> list[str]:
    prompt = str(d.get("prompt_tokens"))
    if d.get("reported_prompt_tokens") not in (None, d.get("prompt_tokens")):
        prompt += f"≠{d['reported_prompt_tokens']}"
    return [
        _age(d.get("reported_at_ms") or 0, now_ms),
        str(d.get("request_id")),
        str(d.get("server_ip")),
        str(d.get("source")),
        str(d.get("verdict")),
        str(d.get("predicted_tokens")),
        str(d.get("realized_tokens")),
        f"{d.get('difference', 0):+d}",
        str(d.get("cause") or "-") + ("" if d.get("explained") else " (unexplained)"),
        "-" if d.get("first_differing_block") is None else str(d["first_differing_block"]),
        str(d.get("block_size")),
        "yes" if d.get("salt") else "no",
        prompt,
        ",".join(d.get("inexact_reasons") or []) or "-",
    ]


def _age(ms: int, now_ms: int) -> str:
    if not ms or not now_ms:
        return "-"
    return f"{max(0.0, (now_ms - ms) / 1000):.0f}s"


def _red(problem: object) -> str:
    return RED if problem else ""
