"""``cache-indexer inspect --config FILE [--json]``: why does the router never pick the warm pod?

Prints what ``GET /kv-cache/instances`` answers, read straight from Redis with the same code
(:mod:`common.status_report`): one line per instance (L1 state, blocks, hash self-check, last
event age, gaps, ingester, L3 blocks and age, and a note saying what is wrong), then one line
per Mooncake master (keys, unparsed keys with a sample, poll age, staleness, error). Problems
are shown in colour when stdout is a terminal (``NO_COLOR`` turns that off). ``--json`` prints
the API's document. Exit status: 0, 1 if Redis cannot be read, 2 for a bad config.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from common import shell
from common.config import Config
from common.redis_client import Client
from common.settings import instance_limits
from common.status_report import HashCheck, InstanceState, build_report
from common.store_status import StatusReader
from services.tools.report_cmd import RED, YELLOW, run, table

_BAD_STATES = {
    InstanceState.UNASSIGNED,
    InstanceState.UNREACHABLE,
    InstanceState.NO_EVENTS,
    InstanceState.GAP,
}
_INSTANCE_COLS = (
    "SERVER_IP",
    "POD",
    "L1_STATE",
    "L1_BLOCKS",
    "HASH_CHECK",
    "LAST_EVENT",
    "GAPS",
    "INGESTER",
    "L3_BLOCKS",
    "L3_AGE",
    "KV_GROUPS",
    "NOTE",
)
_MASTER_COLS = (
    "MASTER",
    "KEYS",
    "UNPARSED",
    "SAMPLE_UNPARSED",
    "UNMAPPABLE_GROUP",
    "AGE",
    "STALE",
    "ERROR",
)


_PROG = "cache-indexer inspect"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = shell.parser(_PROG, __doc__.split("\n")[0], metrics_port=False)
    p.add_argument("--json", action="store_true", help="print the JSON document instead")
    return p.parse_args(argv)


def main(argv: list[str], out: TextIO | None = None) -> int:
    def read(cfg: Config, client: Client) -> dict[str, Any]:
        return build_report(StatusReader(client).read(), instance_limits(cfg))

    return run(_PROG, _parse(argv), out, read, render_table)


def render_table(report: dict[str, Any], color: bool = False) -> str:
    """The report as two aligned tables; problem rows coloured when ``color``."""
    rows = [(_instance_row(i), _instance_problem(i)) for i in report["instances"]]
    text = table(_INSTANCE_COLS, rows, color) if rows else "no instances registered\n"
    masters = [(_master_row(m), _master_problem(m)) for m in report["masters"]]
    text += "\n" + (table(_MASTER_COLS, masters, color) if masters else "no masters\n")
    return text


def _instance_row(inst: dict[str, Any]) -> list[str]:
    l1, l3 = inst["l1"], inst["l3"]
    note = l1["state_detail"]
    if l1["hash_check"] == "mismatch":
        note = l1["hash_check_detail"]
    return [
        inst["server_ip"],
        inst["pod"] or "-",
        l1["state"],
        str(l1["blocks"]),
        f"{l1['hash_check']} ({l1['hash_check_ok']}/{l1['hash_check_mismatch']})",
        _secs(l1["last_event_age_s"]),
        str(l1["gaps"]),
        l1["ingester"] or "-",
        "-" if l3["blocks"] is None else str(l3["blocks"]) + (" stale" if l3["stale"] else ""),
        _secs(l3["age_s"]),
        _groups_cell(inst.get("groups") or {}),
        note or "-",
    ]


_KIND_SHORT = {
    "full_attention": "FA",
    "mla_attention": "MLA",
    "sink_full_attention": "SINK",
    "sliding_window": "SWA",
    "sliding_window_mla": "SWA-MLA",
    "mamba": "MAMBA",
    "chunked_local_attention": "CHUNK",
}


def _groups_cell(groups: dict[str, Any]) -> str:
    """``1`` for a single-group model; else the groups' kinds, hash unit and exactness; then
    ``L=<n>`` when the instance hashes with speculative-decoding lookahead."""
    lookahead = groups.get("lookahead_tokens")
    return _kinds_cell(groups) + (f" L={lookahead}" if lookahead else "")


def _kinds_cell(groups: dict[str, Any]) -> str:
    if not groups.get("hybrid"):
        return "1"
    kinds = "+".join(
        _KIND_SHORT.get(g["kind"], g["kind"] or "?") for g in groups.get("kv_cache_groups", [])
    )
    exact = (
        "exact"
        if groups.get("exact")
        else "lower bound: " + ",".join(groups.get("inexact_reasons", []))
    )
    return f"{kinds} h{groups.get('hash_unit')} {exact}"


def _instance_problem(inst: dict[str, Any]) -> str:
    l1 = inst["l1"]
    if l1["hash_check"] == HashCheck.MISMATCH or l1["state"] in _BAD_STATES or inst["l3"]["stale"]:
        return RED
    return YELLOW if l1["state"] == "replaying" else ""


def _master_row(m: dict[str, Any]) -> list[str]:
    return [
        m["url"],
        _num(m["keys"]),
        _num(m["keys_unparsed"]),
        m["sample_unparsed"] or "-",
        _num(m["keys_unmappable_group"]),
        _secs(m["age_s"]),
        "yes" if m["stale"] else "no",
        m["error"] or "-",
    ]


def _master_problem(m: dict[str, Any]) -> str:
    if m["stale"] or m["error"] or m["keys"] is None:
        return RED
    return YELLOW if m["keys_unparsed"] or m["keys_unmappable_group"] else ""


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)
