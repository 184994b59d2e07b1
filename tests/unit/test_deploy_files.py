"""The docker-compose stack, the Dockerfile and docs/deploy.md agree with the code.

No Docker engine here: these tests check what can be checked offline — the compose file's
commands are real subcommands, ``compose/config.yaml`` validates (including its static
discovery lists) and points at the simulators' addresses and ports, the image copies every
package the project installs, and the deployment guide documents every config key.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from common.config import Config, load_config, parse_listen_addr
from services.cli import SUBCOMMANDS
from services.discovery.static import desired_from
from services.simulator.cache_model import Request
from services.simulator.engine import SimulatedVLLM
from services.simulator.main import _parse as simulator_args
from services.simulator.main import step_requests
from services.simulator.workload import Workload
from tests.unit.test_chart import _schema_paths

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose" / "docker-compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_compose_runs_every_component_with_real_subcommands() -> None:
    roles = {
        name: svc["command"][0]
        for name, svc in SERVICES.items()
        if svc.get("image") == "cache-indexer:dev"
    }
    assert sorted(roles.values()) == sorted(
        ["api", "audit-probe", "discovery", "l1-ingest", "l3-poll"]
        + ["simulate-vllm", "simulate-vllm"]
    )
    assert SERVICES["audit-probe"]["profiles"] == ["audit"]  # optional: real vLLM only
    assert all(role in SUBCOMMANDS for role in roles.values())
    assert {"redis", "mooncake-master"} <= set(SERVICES)
    assert SERVICES["api"]["ports"] == ["127.0.0.1:8080:28080"]


def test_compose_config_validates_and_matches_the_stack() -> None:
    cfg = load_config(ROOT / "compose" / "config.yaml", env={})
    assert cfg.discovery.mode == "static" and cfg.redis.url == "redis://redis:6379/0"
    assert parse_listen_addr(cfg.http.addr)[1] == 28080
    desired = desired_from(cfg.discovery.static)
    assert desired.instances is not None and desired.masters is not None
    sims = {
        svc["networks"]["indexer"]["ipv4_address"]: svc["command"]
        for svc in SERVICES.values()
        if svc.get("command", [""])[0] == "simulate-vllm"
    }
    assert set(desired.instances) == set(sims)
    for ip, inst in desired.instances.items():
        command = sims[ip]
        pub_port = _flag(command, "--endpoint").rsplit(":", 1)[1]
        replay_port = _flag(command, "--replay-endpoint").rsplit(":", 1)[1]
        assert inst.zmq_endpoint == f"tcp://{ip}:{pub_port}"
        assert inst.replay_endpoint == f"tcp://{ip}:{replay_port}"
        assert _flag(command, "--topic").startswith(cfg.ingest.l1.topic)
        assert _flag(command, "--vllm-version") == cfg.block_key.vllm_version
        sim = simulator_args(command[1:])  # the simulator accepts every flag
        assert (sim.hash_seed, sim.block_size) == (cfg.block_key.python_hash_seed, 16)
    assert list(desired.masters) == ["http://mooncake-master:9003"]


def _header_example() -> dict[str, Any]:
    header = []
    for line in (ROOT / "compose" / "docker-compose.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:].strip())
    text = " ".join(h[:-1] if h.endswith("\\") else h for h in header)
    m = re.search(r"curl\s.*?-d\s+'(\{.*?\})'", text)
    assert m, "the compose header has no example curl"
    return dict(json.loads(m.group(1)))


def test_compose_header_example_hits_what_the_simulators_keep_warm() -> None:
    """The example curl must be able to answer a real ratio (3 tokens at block 128 cannot):
    drive each simulator of the stack in-process, with its own command line, for a few
    engine steps and check that it holds every full block of the example's prompt."""
    example = _header_example()
    tokens, block_size = example["body"]["token_ids"], example["body"]["block_size"]
    sims = {
        svc["networks"]["indexer"]["ipv4_address"]: svc["command"]
        for svc in SERVICES.values()
        if svc.get("command", [""])[0] == "simulate-vllm"
    }
    assert sorted(example["server_ip"]) == sorted(sims)
    assert len(tokens) >= 2 * block_size
    for command in sims.values():
        args = simulator_args(command[1:])
        assert args.block_size == block_size
        sim = SimulatedVLLM(
            "inproc://compose-example",
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            hash_seed=args.hash_seed,
            vllm_version=args.vllm_version,
        )
        try:
            workload = Workload(
                args.workload,
                prompts=args.prompts,
                prompt_len=args.prompt_len,
                block_size=args.block_size,
                seed=args.seed,
            )
            for step in range(1, 11):
                sim.serve(step_requests(args, workload, step, 1))
            assert sim.true_prefix_len(Request(tuple(tokens))) == len(tokens) // block_size
        finally:
            sim.close()


def test_image_copies_every_installed_package() -> None:
    dockerfile = (ROOT / "Dockerfiles" / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    ]
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for package in packages:
        assert f"COPY {package} ./{package}" in dockerfile
        assert f"!{package}/" in ignore
    script = next(iter(pyproject["project"]["scripts"]))
    assert f'ENTRYPOINT ["{script}"]' in dockerfile


def test_deploy_guide_documents_exactly_the_config_keys() -> None:
    guide = (ROOT / "docs" / "deploy.md").read_text()
    section = guide.split("\n## Config file\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([A-Za-z0-9.]+)` \|", section, flags=re.MULTILINE))
    schema = _schema_paths(Config)
    assert schema - documented == set(), "config keys missing from docs/deploy.md"
    assert documented - schema == set(), "docs/deploy.md documents keys that do not exist"
