"""What the report commands (``inspect``, ``audit``) share: the config loaded once, Redis
read once with the one client factory (AUTH, TLS and cluster as configured), and the
document printed as JSON or as aligned tables (problem rows coloured on a terminal)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

import orjson
import redis

from common import shell
from common.config import Config, config_path_from, load_config
from common.errors import ConfigError
from common.redis_client import Client, connect, describe

RED, YELLOW, RESET = "\033[31m", "\033[33m", "\033[0m"

Read = Callable[[Config, Client], dict[str, Any]]
"""The document a command prints, read from Redis."""
Render = Callable[[dict[str, Any], bool], str]
"""The document as text; the flag says whether to colour problem rows."""


def run(prog: str, args: argparse.Namespace, out: TextIO | None, read: Read, render: Render) -> int:
    """Exit code: 0 printed, 1 Redis could not be read, 2 the config is invalid."""
    out = out or sys.stdout
    try:
        cfg = load_config(config_path_from(args.config))
    except ConfigError as exc:
        return shell.config_failure(prog, exc).code
    client: Client | None = None
    try:
        client = connect(cfg.redis, retries=1)
        doc = read(cfg, client)
    except redis.RedisError as exc:
        print(f"{prog}: cannot read Redis at {describe(cfg.redis)}: {exc}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            client.close()
    if args.json:
        out.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    out.write(render(doc, out.isatty() and not os.environ.get("NO_COLOR")))
    return 0


def table(cols: tuple[str, ...], rows: list[tuple[list[str], str]], color: bool) -> str:
    """Aligned columns; a row's second item is its colour (``""``: no problem)."""
    widths = [max(len(c), *(len(r[i]) for r, _ in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    for cells, problem in rows:
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        lines.append(f"{problem}{line}{RESET}" if color and problem else line)
    return "\n".join(lines) + "\n"
