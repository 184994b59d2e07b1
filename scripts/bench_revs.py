"""Run one benchmark script on two revisions of the project, taking turns, in one run.

    python scripts/bench_revs.py --old-rev REV [--rounds 3] [--grep REGEX] -- SCRIPT [ARGS...]

The old revision is checked out with ``git worktree add --detach`` into a temporary
directory (removed at the end); the C block encoder is copied from this checkout when
``common/_cbor_blocks.c`` is the same in both, else compiled there with ``cc``. Each round
runs ``SCRIPT ARGS`` once in the old tree and once in this one (the order alternating from
round to round), each with its own tree as working directory and ``PYTHONPATH``, so both
see the same machine load. Each tree runs its own copy of the script (its imports are that
tree's), or this tree's when the old one has none. Printed per round and revision: the
lines of the script's output that match ``--grep`` (default: every line).
Benchmarks only, never a test.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = "_cbor_blocks"


def _checkout(rev: str, where: Path) -> Path:
    tree = where / "old"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), rev],
        check=True,
    )
    source = tree / "common" / f"{LIBRARY}.c"
    built = sorted((ROOT / "common").glob(f"{LIBRARY}*.so"))
    if built and source.exists() and filecmp.cmp(source, ROOT / "common" / source.name):
        shutil.copy(built[0], tree / "common" / built[0].name)
    elif source.exists():
        target = tree / "common" / f"{LIBRARY}{sysconfig.get_config_var('EXT_SUFFIX')}"
        cc = ["cc", "-O2", "-shared", "-fPIC", "-o", str(target), str(source)]
        subprocess.run(cc, check=True)
    return tree


def _run(tree: Path, script: str, args: list[str], pattern: re.Pattern[str]) -> list[str]:
    path = tree / script if (tree / script).exists() else ROOT / script
    proc = subprocess.run(
        [sys.executable, str(path), *args],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if pattern.search(line)]
    if proc.returncode != 0:
        lines.append(f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-rev", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grep", default="", help="print only the output lines matching this")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the benchmark script after --")
    script, script_args = command[0], command[1:]
    pattern = re.compile(args.grep)
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-revs-") as tmp:
        old = _checkout(args.old_rev, Path(tmp))
        try:
            for i in range(args.rounds):
                trees = [(args.old_rev, old), (f"{head} (this tree)", ROOT)]
                for label, tree in trees if i % 2 == 0 else trees[::-1]:
                    print(f"## round {i + 1}, {label}", flush=True)
                    for line in _run(tree, script, script_args, pattern):
                        print(line, flush=True)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
