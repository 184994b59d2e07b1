"""The import rules of the layout (docs/design.md "Layout"), read from the source: ``common``
never imports ``services``; a service never imports another (``services/cli.py``, the one
entry point, dispatches to all of them; the tools may drive the simulator); the API's HTTP
server (``services/api/transport``) imports nothing of the API it serves."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """The absolute modules ``path`` imports (``from a.b import c`` counts as ``a.b.c`` too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_common_never_imports_services() -> None:
    bad = [
        (str(path.relative_to(ROOT)), module)
        for path in _sources("common")
        for module in _imports(path)
        if module.split(".")[0] == "services"
    ]
    assert bad == []


# The operator tools drive the simulator (``local-stack``, ``mooncake-pods``); neither is a
# deployed process, so this import couples no two deployed processes.
ALLOWED = {("tools", "simulator")}


def test_services_never_import_each_other() -> None:
    bad = []
    for path in _sources("services"):
        parts = path.relative_to(ROOT / "services").parts
        if len(parts) < 2:  # services/cli.py, services/__init__.py
            continue
        for module in _imports(path):
            names = module.split(".")
            if names[0] != "services" or len(names) < 2 or names[1] == parts[0]:
                continue
            if (parts[0], names[1]) not in ALLOWED:
                bad.append((str(path.relative_to(ROOT)), module))
    assert bad == []


def test_the_http_server_does_not_import_the_api() -> None:
    bad = [
        (str(path.relative_to(ROOT)), module)
        for path in _sources("services/api/transport")
        for module in _imports(path)
        if module.startswith("services.") and not module.startswith("services.api.transport")
    ]
    assert bad == []


# Modules that still spell Redis keys outside the store (none since issue 34).
NOT_YET_IN_THE_STORE: set[str] = set()

# The prediction audit's own store (issue 30): its keys (``audit:*``) are written and read only
# there, apart from the index the audit checks a report against (``audit_store.py``).
AUDIT_STORE = {
    "common/audit_report.py",
    "services/api/audit_record.py",
    "services/api/audit_store.py",
}


def test_only_the_store_spells_redis_keys() -> None:
    """One place to look for a key's readers and writers: the store's modules."""
    users = {
        str(path.relative_to(ROOT))
        for package in ("common", "services")
        for path in _sources(package)
        if "common.keys" in _imports(path)  # also ``from common import keys``
    }
    store = {"common/store.py", "common/store_reads.py", "common/store_status.py"}
    assert users - store - AUDIT_STORE == NOT_YET_IN_THE_STORE
