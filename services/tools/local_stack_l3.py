"""The L3 side of ``cache-indexer local-stack``: a real ``mooncake_master``, one store client
per dense pod putting its blocks, and the L3 poller, all in a private network namespace
(Mooncake store clients listen on every interface). The poller reaches Redis through the
stack's unix socket. Without root, ``unshare`` or the Mooncake wheel it is left out.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

from services.tools.local_stack_processes import Processes, cli, wait_http

logger = logging.getLogger(__name__)


def start_l3_side(
    procs: Processes,
    workdir: Path,
    config: Path,
    master_port: int,
    blocks: dict[str, dict[str, Any]],
) -> bool:
    """Start the namespace (``local-stack --l3-side`` inside it) with ``blocks`` (pod name →
    the store client's key spec and hashes); False if this machine cannot."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("mooncake_master"):
        logger.warning(
            "L3 side left out: needs root, unshare and the Mooncake wheel "
            "(scripts/setup.sh installs it); L3 ratios will be 0"
        )
        return False
    for name, spec in blocks.items():
        (workdir / f"{name}.blocks.json").write_text(json.dumps(spec), encoding="utf-8")
    inner = cli(
        "local-stack", "--l3-side", "--workdir", str(workdir), "--master-port", str(master_port)
    )
    script = "ip link set lo up && exec " + " ".join(f"'{a}'" for a in inner)
    env = dict(
        os.environ,
        CACHE_INDEXER_CONFIG=str(config),
        CACHE_INDEXER_REDIS_URL=f"unix://{workdir}/redis.sock?db=0",
    )
    procs.spawn("l3-netns", ["unshare", "-n", "sh", "-c", script], env=env)
    return True


def run_l3_side(
    workdir: Path, master_port: int, pods: list[tuple[str, str]], stop: threading.Event
) -> int:
    """Inside the private netns: master, one store client per pod (name, ip), the L3 poller."""
    procs = Processes(workdir)
    rpc = f"127.0.0.1:{master_port + 1}"
    try:
        procs.spawn(
            "mooncake-master",
            [
                shutil.which("mooncake_master") or "mooncake_master",
                "--rpc_address=127.0.0.1",
                f"--rpc_port={master_port + 1}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={master_port}",
                "--enable_metric_reporting=false",
                "--logtostderr",
            ],
        )
        wait_http(f"http://127.0.0.1:{master_port}/health", 30, stop)
        for name, ip in pods:
            blocks = str(workdir / f"{name}.blocks.json")
            procs.spawn(
                f"mooncake-{name}",
                [sys.executable, "-m", "services.tools.mooncake_pods", "--ip", ip]
                + ["--master", rpc, "--blocks", blocks],
            )
        procs.spawn("l3-poll", cli("l3-poll"))
        while not stop.wait(1.0):
            if procs.dead():
                logger.error("stopped unexpectedly: %s", ", ".join(procs.dead()))
                return 1
        return 0
    finally:
        procs.stop_all()
