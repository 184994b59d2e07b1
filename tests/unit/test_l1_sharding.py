"""Sharding of instances over L1 ingesters: stable static hash and rendezvous assignment."""

from __future__ import annotations

import json
import subprocess
import sys

from services.l1_ingest.sharding import fnv1a64, rendezvous_owner, static_shard
from tests.conftest import ROOT, child_env

IPS = [f"10.0.{i // 250}.{i % 250}" for i in range(1000)]


def test_fnv1a64_known_vectors() -> None:
    # Published FNV-1a 64 test vectors: stable across processes (unlike hash()).
    assert fnv1a64("") == 0xCBF29CE484222325
    assert fnv1a64("a") == 0xAF63DC4C8601EC8C
    assert fnv1a64("foobar") == 0x85944171F73967E8


def test_static_shards_split_everything_once_and_evenly() -> None:
    shards = [static_shard(ip, 4) for ip in IPS]
    counts = [shards.count(i) for i in range(4)]
    assert sum(counts) == len(IPS) and min(counts) > 200


def test_rendezvous_is_stable_and_independent_of_order() -> None:
    ids = ["ing-a", "ing-b", "ing-c"]
    first = {ip: rendezvous_owner(ip, ids) for ip in IPS}
    assert first == {ip: rendezvous_owner(ip, list(reversed(ids))) for ip in IPS}
    counts = [list(first.values()).count(i) for i in ids]
    assert min(counts) > 250, counts
    assert rendezvous_owner("10.0.0.1", []) is None


def test_rendezvous_moves_only_the_lost_ingesters_instances() -> None:
    ids = ["ing-a", "ing-b", "ing-c", "ing-d"]
    before = {ip: rendezvous_owner(ip, ids) for ip in IPS}
    after = {ip: rendezvous_owner(ip, ids[:-1]) for ip in IPS}
    moved = {ip for ip in IPS if before[ip] != after[ip]}
    assert moved == {ip for ip in IPS if before[ip] == "ing-d"}
    # Adding an ingester takes instances only for itself.
    grown = {ip: rendezvous_owner(ip, [*ids, "ing-e"]) for ip in IPS}
    assert all(grown[ip] in (before[ip], "ing-e") for ip in IPS)


_ASSIGN = """
import json, sys
from services.l1_ingest.sharding import rendezvous_owner, static_shard
ips = json.loads(sys.stdin.read())
ids = ["ing-a", "ing-b", "ing-c"]
print(json.dumps([[static_shard(ip, 4), static_shard(ip, 7), rendezvous_owner(ip, ids)]
                  for ip in ips]))
"""


def test_assignment_is_the_same_in_every_process_whatever_its_hash_seed() -> None:
    """Ingesters are separate processes, each with its own PYTHONHASHSEED (random by
    default): they must all compute the same shard and owner for every instance."""
    ids = ["ing-a", "ing-b", "ing-c"]
    ips = IPS[::5]
    here = [[static_shard(ip, 4), static_shard(ip, 7), rendezvous_owner(ip, ids)] for ip in ips]
    seeds = ("0", "4242", "random")
    children = {
        seed: subprocess.Popen(  # concurrently: each pays the interpreter start-up
            [sys.executable, "-c", _ASSIGN],
            cwd=ROOT,
            env={**child_env(), "PYTHONHASHSEED": seed},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in seeds
    }
    for seed, child in children.items():
        out, err = child.communicate(json.dumps(ips), timeout=60)
        assert child.returncode == 0, err[-2000:]
        assert json.loads(out) == here, f"PYTHONHASHSEED={seed}"
