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
import os
import sys
from typing import Any, TextIO

import orjson
import redis

from common.config import config_path_from, load_config
from common.errors import ConfigError
from common import shell
from common.redis_client import Client, connect, describe
from common.settings import instance_limits
from common.status_report import HashCheck, InstanceState, build_report
from common.store_status import StatusReader

_RED, _YELLOW, _RESET = "\033[31m", "\033[33m", "\033[0m"
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
    args = _parse(argv)
    out = out or sys.stdout
    try:
        cfg = load_config(config_path_from(args.config))
    except ConfigError as exc:
        return shell.config_failure(_PROG, exc).code
    client: Client | None = None
    try:  # the one Redis client factory: AUTH, TLS and cluster as configured
        client = connect(cfg.redis, retries=1)
        report = build_report(StatusReader(client).read(), instance_limits(cfg))
    except redis.RedisError as exc:
        print(f"{_PROG}: cannot read Redis at {describe(cfg.redis)}: {exc}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            client.close()
    if args.json:
        out.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    color = out.isatty() and not os.environ.get("NO_COLOR")
    out.write(render_table(report, color))
    return 0


def render_table(report: dict[str, Any], color: bool = False) -> str:
    """The report as two aligned tables; problem rows coloured when ``color``."""
    rows = [(_instance_row(i), _instance_problem(i)) for i in report["instances"]]
    text = _table(_INSTANCE_COLS, rows, color) if rows else "no instances registered\n"
    masters = [(_master_row(m), _master_problem(m)) for m in report["masters"]]
    text += "\n" + (_table(_MASTER_COLS, masters, color) if masters else "no masters\n")
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
    """``1`` for a single-group model; else the groups' kinds, hash unit and exactness."""
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
        return _RED
    return _YELLOW if l1["state"] == "replaying" else ""


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
        return _RED
    return _YELLOW if m["keys_unparsed"] or m["keys_unmappable_group"] else ""


def _table(cols: tuple[str, ...], rows: list[tuple[list[str], str]], color: bool) -> str:
    widths = [max(len(c), *(len(r[i]) for r, _ in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    for cells, problem in rows:
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        lines.append(f"{problem}{line}{_RESET}" if color and problem else line)
    return "\n".join(lines) + "\n"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)
