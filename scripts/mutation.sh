#!/usr/bin/env bash
# Mutation testing of the modules that decide answers, with mutmut (docs/testing.md,
# "Mutation testing"). Not part of CI: slow (minutes to an hour per module on 2 cores).
#
#   scripts/mutation.sh [-j N] [MODULE ...]   # mutate MODULE(s), one after the other, print scores
#   scripts/mutation.sh --resume [MODULE ...] # only the mutants not yet run or that survived
#   scripts/mutation.sh --function FN MODULE  # only the mutants of function or method FN
#                                             # (repeatable; e.g. after FN alone changed)
#   scripts/mutation.sh --report [MODULE ...] # print the scores and survivors of the last runs
#
# MODULE is a path (common/hit_rule.py) or a dotted name (common.hit_rule); without one, every
# module of `[tool.mutmut] only_mutate` in pyproject.toml, most answer-deciding first. The tests
# are the fast suite (`pytest_add_cli_args_test_selection`: tests/unit, tests/services); mutmut
# first runs it once to learn which tests reach which function, then runs only those tests
# against each mutant. -j N: mutants run at once (default 1; the machine is shared).
#
# Which code the tests run: mutmut copies the tree into mutants/ and puts mutants/ first on the
# sys.path of its own process. Child processes the tests start (the API under gunicorn, the
# ingesters) see only PYTHONPATH, and without it they import the *editable install* (which may
# point at another checkout), not the mutant. So PYTHONPATH is set to mutants/ itself, and the
# script checks that `common` resolves there (before each module once mutants/ is whole, and at the end).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
children=1
report_only=0
resume=0
modules=()
functions=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -j) children=$2; shift 2 ;;
        --report) report_only=1; shift ;;
        --resume) resume=1; shift ;;
        --function) functions+=("$2"); shift 2 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) modules+=("$1"); shift ;;
    esac
done
if [[ ${#modules[@]} -eq 0 ]]; then
    mapfile -t modules < <(python - <<'EOF'
import tomllib
for path in tomllib.load(open("pyproject.toml", "rb"))["tool"]["mutmut"]["only_mutate"]:
    print(path)
EOF
)
fi

report() {
    python - "$@" <<'EOF'
import json, sys
from collections import Counter
from pathlib import Path
from mutmut.stats import status_by_exit_code

print(f"{'module':40} {'mutants':>7} {'killed':>6} {'survived':>8} {'no tests':>8} {'timeout':>7} {'other':>5}  score")
for path in sys.argv[1:]:
    meta = Path("mutants") / (path + ".meta")
    if not meta.exists():
        print(f"{path:40} (not run)")
        continue
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    status = {k: status_by_exit_code[v] for k, v in codes.items()}
    n = Counter(status.values())
    killed = n["killed"] + n["caught by type check"]
    other = len(status) - killed - n["survived"] - n["no tests"] - n["timeout"]
    run = len(status) - n["not checked"]
    score = f"{100 * (killed + n['timeout']) / run:.1f}%" if run else "-"
    print(f"{path:40} {len(status):7} {killed:6} {n['survived']:8} {n['no tests']:8} {n['timeout']:7} {other:5}  {score}")
    for key, s in sorted(status.items()):
        if s not in ("killed", "caught by type check", "timeout"):
            print(f"    {s}: {key}")
EOF
}

paths=()
for m in "${modules[@]}"; do
    m=${m%.py}
    paths+=("${m//.//}.py")
done

if [[ $report_only -eq 1 ]]; then
    report "${paths[@]}"
    exit 0
fi

command -v mutmut >/dev/null || { echo "mutmut is not installed (pip install mutmut==3.8.1)" >&2; exit 2; }
for p in "${paths[@]}"; do
    [[ -f $p ]] || { echo "no such module: $p" >&2; exit 2; }
    grep -q "\"$p\"" pyproject.toml || { echo "$p is not in [tool.mutmut] only_mutate" >&2; exit 2; }
done
# The C hasher is not built in a checkout; copied, the tests run its path too.
ls common/_cbor_blocks*.so >/dev/null 2>&1 || echo "note: no common/_cbor_blocks*.so, the C path is not run" >&2

# mutmut copies the sources into mutants/ once and refreshes only the mutated modules (by
# mtime; their results are kept while they do not change): drop the other copies, so they are
# copied afresh from the tree.
if [[ -d mutants ]]; then
    python - <<'EOF'
import tomllib
from pathlib import Path
keep = set(tomllib.load(open("pyproject.toml", "rb"))["tool"]["mutmut"]["only_mutate"])
for top in ("common", "services"):
    for p in (Path("mutants") / top).rglob("*"):
        if p.is_file() and str(p.relative_to("mutants")) not in keep and p.suffix not in (".meta", ".spans"):
            p.unlink()
EOF
fi
# mutants/ must exist before mutmut starts: Python caches "nothing here" for a sys.path entry
# that is missing at start-up and never looks again, and mutmut drops the tree itself from
# sys.path, so on a checkout's first run pytest found no `tests` package for its plugin
# (tests/mutation_rerun.py) and the run stopped.
mkdir -p mutants
export PYTHONPATH="$ROOT/mutants"
unset CI  # a skipped test is not a kill, and a prerequisite missing here is not a mutant's doing

for p in "${paths[@]}"; do
    name=${p%.py}
    name=${name//\//.}
    echo "=== $p ($(date -u +%H:%M:%S))"
    # mutants/common is whole only after mutmut's copy: check where `common` resolves once it is
    if [[ -f mutants/common/__init__.py ]]; then
        where=$(cd / && python -c 'import common; print(common.__file__)')
        [[ $where == "$ROOT/mutants/"* ]] || { echo "common resolves to $where, not mutants/" >&2; exit 3; }
    fi
    # tests/mutation_rerun.py (pytest_add_cli_args) runs a failed test once more, so a flaky
    # test neither stops mutmut's first full run nor counts as a kill
    names=("$name.*")
    if [[ ${#functions[@]} -gt 0 ]]; then
        names=()
        for fn in "${functions[@]}"; do
            names+=("$name.x*$fn""__mutmut_*")  # x_FN (a function), xǁClassǁFN (a method)
        done
    fi
    if [[ $resume -eq 1 && -f mutants/$p.meta ]]; then
        mapfile -t names < <(python - "mutants/$p.meta" <<'EOF'
import json, sys
for key, code in json.load(open(sys.argv[1]))["exit_code_by_key"].items():
    if code in (None, 0):  # not run yet, or survived (new tests may kill it)
        print(key)
EOF
)
        [[ ${#names[@]} -gt 0 ]] || continue
    fi
    mutmut run --max-children "$children" "${names[@]}" || echo "mutmut failed on $p" >&2
done
where=$(cd / && python -c 'import common; print(common.__file__)')
[[ $where == "$ROOT/mutants/"* ]] || { echo "common resolved to $where, not mutants/" >&2; exit 3; }
report "${paths[@]}"
