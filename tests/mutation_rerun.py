"""pytest plugin for mutation runs only (``scripts/mutation.sh`` loads it with ``-p``): a test
that fails is run once more, and counts as failed only if it fails again.

mutmut runs the fast suite with ``-x`` to learn which tests reach which function, and stops
there at the first failure; on the shared 2-core machine a few timing-bound service tests
(the discovery watch's 410 relist, the L3 poller's re-location) fail now and then under
heavy load. A mutant that breaks a test breaks it twice, so kills are unchanged; a flaky test
no longer stops the run or counts as a kill. Also, the fastest tests run first (below).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _pytest.runner import runtestprotocol


def pytest_runtest_protocol(item: Any, nextitem: Any) -> bool:
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    if any(r.failed for r in reports):
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """Fastest tests first (mutmut's recorded durations, in ``mutmut-stats.json`` of the
    ``mutants/`` directory the tests run in): a mutant is killed by its first failing test
    (``-x``), usually a fast one, so most mutants cost seconds, not the slowest test's time."""
    stats = Path("mutmut-stats.json")
    if not stats.is_file():
        return
    durations = json.loads(stats.read_text()).get("duration_by_test", {})
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))
