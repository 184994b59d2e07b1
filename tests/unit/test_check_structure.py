"""``scripts/check_structure.py`` on a synthetic tree: what it reports, where the limits sit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
try:
    import check_structure
finally:
    sys.path.remove(str(ROOT / "scripts"))


def _function(name: str, lines: int) -> str:
    """A function of exactly ``lines`` lines, def line included."""
    return f"def {name}() -> None:\n" + "    x = 1\n" * (lines - 1)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_limits_are_inclusive_and_every_excess_is_named(tmp_path: Path) -> None:
    at_limit = _function("fits", 50) + "\n" + _function("too_long", 51)
    method = "class C:\n" + "".join("    " + ln + "\n" for ln in _function("m", 52).splitlines())
    root = _tree(
        tmp_path,
        {
            "common/a.py": at_limit,
            "common/big.py": "x = 1\n" * 401,
            "common/ok.py": "x = 1\n" * 400,
            "services/svc/b.py": method,
            "scripts/outside.py": "x = 1\n" * 900,  # not checked: only common/ and services/
        },
    )
    assert check_structure.find_excess(root) == [
        "common/a.py:52: function too_long 51 lines (> 50)",
        "common/big.py:1: module 401 lines (> 400)",
        "services/svc/b.py:2: function m 52 lines (> 50)",
    ]


def test_a_nested_function_is_measured_on_its_own(tmp_path: Path) -> None:
    inner = "".join("    " + ln + "\n" for ln in _function("inner", 51).splitlines())
    root = _tree(tmp_path, {"common/n.py": "def outer() -> None:\n" + inner})
    found = check_structure.find_excess(root)
    assert found == [
        "common/n.py:1: function outer 52 lines (> 50)",
        "common/n.py:2: function inner 51 lines (> 50)",
    ]


def test_a_listed_exception_is_not_reported(tmp_path: Path) -> None:
    (exempt,) = check_structure.MODULE_EXCEPTIONS
    root = _tree(tmp_path, {exempt: "x = 1\n" * 900, "common/other.py": "x = 1\n" * 401})
    assert check_structure.find_excess(root) == ["common/other.py:1: module 401 lines (> 400)"]


def test_the_exit_status_says_whether_anything_exceeds(tmp_path: Path) -> None:
    clean = _tree(tmp_path / "clean", {"common/a.py": _function("f", 10)})
    dirty = _tree(tmp_path / "dirty", {"common/a.py": _function("f", 60)})
    script = ROOT / "scripts" / "check_structure.py"
    ok = subprocess.run([sys.executable, script, clean], capture_output=True, text=True)
    bad = subprocess.run([sys.executable, script, dirty], capture_output=True, text=True)
    assert (ok.returncode, ok.stdout) == (0, "")
    assert bad.returncode == 1
    assert bad.stdout == "common/a.py:1: function f 60 lines (> 50)\n"
