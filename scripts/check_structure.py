#!/usr/bin/env python3
"""Print the modules over 400 lines and the functions over 50 lines in ``common/`` and
``services/``; exit 1 if there is any (issue 34's limits, ``docs/design.md``; CI runs it in
``scripts/lint.sh``).

A module's size is its line count; a function's is from its ``def`` line to its last line
(decorators not counted), nested functions and methods each measured on their own. The
exceptions below are text that reads better whole; each says why.

    python scripts/check_structure.py [ROOT]      # ROOT defaults to the repository
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50
PACKAGES = ("common", "services")

# path relative to ROOT -> why it may exceed MAX_MODULE_LINES
MODULE_EXCEPTIONS: dict[str, str] = {
    "common/store_lua.py": "the Lua scripts' text, each read whole next to its KEYS/ARGV table",
}


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def find_excess(root: Path) -> list[str]:
    """One line per module or function over its limit, as ``path:line: what``."""
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text(encoding="utf-8")
            lines = len(text.splitlines())
            if lines > MAX_MODULE_LINES and rel not in MODULE_EXCEPTIONS:
                found.append(f"{rel}:1: module {lines} lines (> {MAX_MODULE_LINES})")
            for fn in _functions(ast.parse(text, filename=rel)):
                size = (fn.end_lineno or fn.lineno) - fn.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    found.append(
                        f"{rel}:{fn.lineno}: function {fn.name} {size} lines "
                        f"(> {MAX_FUNCTION_LINES})"
                    )
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    found = find_excess(root)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
