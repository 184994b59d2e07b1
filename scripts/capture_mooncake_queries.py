"""Capture a real master's replica-query bodies (tests/data/mooncake/queries-<version>.json).

Run inside a private network namespace (store clients listen on all interfaces), with the
store client of the same version importable::

    unshare -n sh -c 'ip link set lo up && PYTHONPATH=<unpacked wheel> python \
        scripts/capture_mooncake_queries.py <mooncake_master> <out.json> <version>'

Used once for 0.3.10.post2 (wheel unpacked from ``pip download
mooncake-transfer-engine-non-cuda==0.3.10.post2``) and 0.3.13.post1 (installed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

HASHES = [
    "15528b726efb88cb4d9efc583657a821bceb1f67307c6e813417567050a24fdc",
    "15528b726efb88cb4d9efc583657a821bceb1f67307c6e813417567050a24fdc",
    "d1872d6100e1c1ff861552bc4efceaf7f53da12555de6e2c0cfcb56d48b26249",
]
KEYS = [
    f"Qwen2.5-0.5B-Instruct@tp_rank:{i % 2}@pcp0@dcp0@pp_rank:0@group:0@{h}"
    for i, h in enumerate(HASHES)
]


def main(master_bin: str, out: str, version: str) -> None:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    args = [
        master_bin,
        "--rpc_address=127.0.0.1",
        "--rpc_port=50551",
        "--metrics_port=19003",
        "--enable_metric_reporting=false",
    ]
    helptext = subprocess.run([master_bin, "--help"], check=False, capture_output=True, text=True)
    if "-metrics_host" in helptext.stdout + helptext.stderr:
        args.append("--metrics_host=127.0.0.1")  # the flag exists from 0.3.13
    master = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = "http://127.0.0.1:19003"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(base + "/health")
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    store = MooncakeDistributedStore()
    assert (
        store.setup("127.0.0.2", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", "127.0.0.1:50551")
        == 0
    )
    for key in KEYS:
        assert store.put(key, b"x" * 4096, ReplicateConfig()) == 0
    encoded = KEYS[0].replace("@", "%40").replace(":", "%3A")
    paths = {
        "get_all_keys": "/get_all_keys",
        "get_all_segments": "/get_all_segments",
        "get_segments_detail": "/get_segments_detail",
        "query_key_hit": f"/query_key?key={KEYS[0]}",
        "query_key_miss": f"/query_key?key={KEYS[0]}0",
        "query_key_encoded": f"/query_key?key={encoded}",
        "batch_query_keys": f"/batch_query_keys?keys={KEYS[0]},{KEYS[2]},no_such_key",
        "batch_query_keys_empty": "/batch_query_keys",
        "batch_query_keys_encoded": f"/batch_query_keys?keys={encoded}",
    }
    result: dict[str, object] = {
        "version": version,
        "keys": KEYS,
        "segment_hostname": store.get_hostname(),
    }
    for name, path in paths.items():
        resp = httpx.get(base + path)
        result[name] = {
            "path": path,
            "status": resp.status_code,
            "content_type": resp.headers.get("content-type"),
            "body": resp.text,
        }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    store.close()
    master.terminate()
    master.wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
