"""Runs a real vLLM engine serving LoRA adapters made here; prints one JSON line.

Like tests/integration/vllm_engine_driver.py (whose :class:`Run` it reuses) it must run in a
private network namespace; tests/integration/test_real_vllm_lora.py starts it::

    unshare -n sh -c 'ip link set lo up && python tests/integration/vllm_lora_driver.py'

The dense tiny Qwen3 of :mod:`tests.integration.vllm_engine` (dummy weights) with
``--enable-lora`` and two adapters written by :func:`write_adapter` (random rank-8 weights on
``q/k/v/o_proj``, PEFT layout): ``lora-a`` given by its absolute path, ``lora-b`` by the same
kind of path with a trailing ``/`` (vLLM hashes the ``--lora-modules`` path verbatim, so the
index must be asked with that exact string). Requests go to the engine with ``"model":
<adapter>`` and to ``POST /kv-cache/hit-rate?detail=1`` with ``lora_name``/``lora_path`` in
the body. Three phases:

1. *mixed* — prompts of the engine driver's workload, each under the base model or one of the
   adapters, many followed by the same token ids under another key (base after adapter,
   adapter after base, adapter after adapter);
2. *repoint* — ``lora-a`` re-pointed at a third adapter directory through
   ``/v1/load_lora_adapter`` (``load_inplace``), then prompts ``lora-a`` cached before: vLLM
   must not reuse them (its key holds the path) and neither may the index, asked with the new
   path;
3. per row, the index is also asked for the same token ids under every *other* key (base, the
   other adapter, a normalized or stale path): the test checks those answers show the
   blocks were held under another key while the row's own answer is what the engine reused.

At the end it records the L1 ingester's hash self-check state (vLLM 0.32 publishes LoRA
blocks with ``lora_name`` and untagged ``extra_keys`` but not the path: such blocks must be
counted unchecked, never a mismatch) and the LoRA fields of the captured ``BlockStored``.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

from common.blockhash_extra import HashInputs  # noqa: E402
from tests.conftest import RedisServer, wait_for  # noqa: E402
from tests.integration import vllm_engine as ve  # noqa: E402
from tests.integration.vllm_engine_driver import IP, predict, workload  # noqa: E402
from tests.integration.vllm_keyed_run import KeyedRun  # noqa: E402

MODEL = "dense"
RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
BASE = "base"
"""The key of a request without an adapter."""


# -- the adapter ------------------------------------------------------------------------


def _projections(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each attention projection of a Qwen3-style config."""
    hidden = config["hidden_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
    }


def write_safetensors(path: Path, tensors: dict[str, tuple[list[int], list[float]]]) -> None:
    """A float32 safetensors file (8-byte little-endian header length, JSON header padded
    to 8 bytes, then the raw data in header order)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, values) in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + 4 * len(values)],
        }
        offset += 4 * len(values)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(head)) + head)
        for _, values in tensors.values():
            out.write(struct.pack(f"<{len(values)}f", *values))


def write_adapter(directory: Path, base_model: Path, seed: int) -> Path:
    """A PEFT LoRA adapter for :data:`MODEL`: ``adapter_config.json`` and
    ``adapter_model.safetensors`` with random rank-:data:`RANK` A and B matrices."""
    config = ve.MODELS[MODEL]["config"]
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], list[float]]] = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in _projections(config).items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                [RANK, fan_in],
                [rng.gauss(0, 0.05) for _ in range(RANK * fan_in)],
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                [fan_out, RANK],
                [rng.gauss(0, 0.05) for _ in range(fan_out * RANK)],
            )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(base_model),
                "r": RANK,
                "lora_alpha": 2 * RANK,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(TARGETS),
                "fan_in_fan_out": False,
                "use_rslora": False,
                "use_dora": False,
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    write_safetensors(directory / "adapter_model.safetensors", tensors)
    return directory


# -- the run ----------------------------------------------------------------------------


class LoraRun(KeyedRun):
    """The dense model's :class:`Run` with LoRA enabled and two static adapters."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        super().__init__(MODEL, tmp, redis_url)
        adapters = self.tmp / "adapters"
        model_dir = self.tmp / MODEL
        # key → (lora_name, lora_path as vLLM gets it: verbatim, what it hashes)
        self.keys: dict[str, tuple[str | None, str | None]] = {
            BASE: (None, None),
            "lora-a": ("lora-a", str(write_adapter(adapters / "a", model_dir, 1))),
            "lora-b": ("lora-b", str(write_adapter(adapters / "b", model_dir, 2)) + "/"),
        }
        self.repointed = str(write_adapter(adapters / "a2", model_dir, 3))

    def _spawn(self, log: str, argv: list[str], env: dict[str, str]) -> Any:
        if log == "engine.log":
            modules = [f"{name}={path}" for name, path in self.keys.values() if name]
            argv = [*argv, "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2"]
            argv += ["--lora-modules", *modules]
            env = {**env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        return super()._spawn(log, argv, env)

    def body(self, prompt: list[int], key: str) -> dict[str, Any]:
        name, path = self.keys[key]
        body: dict[str, Any] = {"token_ids": prompt, "block_size": ve.BLOCK}
        if name:
            body.update(lora_name=name, lora_path=path)
        return body

    def ask_index_body(self, body: dict[str, Any]) -> dict[str, Any]:
        resp = httpx.post(
            f"http://127.0.0.1:{self.api}/kv-cache/hit-rate",
            params={"detail": 1},
            json={"server_ip": [IP], "body": body},
            timeout=10,
        )
        if resp.status_code != 200:
            raise RuntimeError(f"hit-rate answered {resp.status_code}: {resp.text[:500]}")
        return dict(resp.json()["server_score_list"][0])

    def ask_engine_as(self, prompt: list[int], key: str) -> int:
        name = self.keys[key][0] or self.model
        resp = httpx.post(
            f"http://{IP}:{self.engine_port}/v1/completions",
            timeout=60,
            json={"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        )
        if resp.status_code != 200:
            raise RuntimeError(f"the engine answered {resp.status_code}: {resp.text[:500]}")
        details = resp.json()["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    def repoint(self, key: str, path: str) -> None:
        """Re-point adapter ``key`` at ``path`` in the engine (same name, same int id)."""
        name = self.keys[key][0]
        resp = httpx.post(
            f"http://{IP}:{self.engine_port}/v1/load_lora_adapter",
            timeout=120,
            json={"lora_name": name, "lora_path": path, "load_inplace": True},
        )
        if resp.status_code != 200:
            raise RuntimeError(f"load_lora_adapter answered {resp.status_code}: {resp.text[:500]}")
        self.keys[key] = (name, path)

    def step(
        self,
        i: int,
        phase: str,
        prompt: list[int],
        key: str,
        previous: list[int] | None,
        answered: float,
    ) -> dict[str, Any]:
        note = self.settle(previous, answered)
        score = self.ask_index_body(self.body(prompt, key))
        others = {
            other: _tokens(self.ask_index_body(self.body(prompt, other)))
            for other in self.keys
            if other != key
        }
        others.update(self._variants(prompt, key))
        cached = self.ask_engine_as(prompt, key)
        name, path = self.keys[key]
        self.previous_inputs = HashInputs(lora_name=name, lora_path=path)
        return {
            "i": i,
            "phase": phase,
            "key": key,
            "len": len(prompt),
            **predict(score, len(prompt), False),
            "cached_tokens": cached,
            "others": others,
            **note,
        }

    def _variants(self, prompt: list[int], key: str) -> dict[str, int]:
        """The index's answer for the row's adapter name with other path strings: the
        normalized path (no trailing ``/``), the path before a re-point."""
        name, path = self.keys[key]
        if not name or not path:
            return {}
        out: dict[str, int] = {}
        if path.endswith("/"):
            body = {**self.body(prompt, key), "lora_path": path.rstrip("/")}
            out["normalized_path"] = _tokens(self.ask_index_body(body))
        if key == "lora-a" and path == self.repointed:
            old = str(self.tmp / "adapters" / "a")
            out["old_path"] = _tokens(
                self.ask_index_body({**self.body(prompt, key), "lora_path": old})
            )
        return out

    def run_lora(self, seed: int) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        previous: list[int] | None = None
        answered = time.monotonic()
        plan = mixed_plan(seed)
        plan_a = [p for p, k in plan if k == "lora-a"]
        for phase, items in (("mixed", plan), ("repoint", [])):
            if phase == "repoint":
                self.repoint("lora-a", self.repointed)
                items = [(p, "lora-a") for p in plan_a[-4:]]
            for prompt, key in items:
                rows.append(self.step(len(rows), phase, prompt, key, previous, answered))
                previous, answered = prompt, time.monotonic()
        assert self.capture is not None
        self.capture.wait_quiet(answered)
        return {"rows": rows}

    def hash_check(self) -> dict[str, str]:
        state = self.store.l1_state(IP)
        return {k: v for k, v in state.items() if k.startswith("hash_check")}


def _tokens(score: dict[str, Any]) -> int:
    return int(score.get("l1_hit_tokens", -1))


def mixed_plan(seed: int, count: int = 36) -> list[tuple[list[int], str]]:
    """The engine driver's prompts, each under a random key; about half followed at once by
    the same token ids under another key."""
    rng = random.Random(seed)
    keys = [BASE, "lora-a", "lora-b"]
    plan: list[tuple[list[int], str]] = []
    for prompt in workload(seed, count):
        key = rng.choice(keys)
        plan.append((prompt, key))
        if rng.random() < 0.5:
            plan.append((prompt, rng.choice([k for k in keys if k != key])))
    return plan


def lora_events(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """What the engine published for LoRA blocks: ``lora_name``/``lora_id`` values and the
    shapes of ``extra_keys`` (first entry of each kind)."""
    names: Counter[str] = Counter()
    ids: Counter[str] = Counter()
    samples: dict[str, Any] = {}
    for batch in batches:
        for ev in batch["events"]:
            if ev["type"] != "BlockStored":
                continue
            name = ev.get("lora_name")
            names[str(name)] += len(ev["block_hashes"])
            ids[str(ev.get("lora_id"))] += len(ev["block_hashes"])
            samples.setdefault(
                str(name), {k: ev.get(k) for k in ("lora_name", "lora_id", "extra_keys")}
            )
    return {"blocks_by_lora_name": dict(names), "blocks_by_lora_id": dict(ids), "samples": samples}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=31)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-lora-") as tmp:
        server = RedisServer().start()
        run = None
        try:
            redis.Redis.from_url(server.url).flushall()
            run = LoraRun(Path(tmp), server.url)
            started = time.monotonic()
            run.start()
            ready = time.monotonic()
            out = run.run_lora(args.seed)
            assert run.capture is not None
            wait_for(
                lambda: run.hash_check().get("hash_check"), timeout=30, what="a hash check verdict"
            )
            batches = run.capture.decoded()
            result = {
                "model": "dense-lora",
                "rows": out["rows"],
                "keys": run.keys,
                "hash_check": run.hash_check(),
                "events": {**ve.event_summary(batches), **lora_events(batches)},
                "seconds": {
                    "start": round(ready - started, 1),
                    "workload": round(time.monotonic() - ready, 1),
                },
            }
        except Exception as exc:  # noqa: BLE001 - reported to the test with the logs
            logs = {}
            if run is not None:
                logs = {
                    p.name: p.read_text(errors="replace")[-4000:] for p in run.tmp.glob("*.log")
                }
            result = {"model": "dense-lora", "error": repr(exc), "logs": logs}
        finally:
            if run is not None:
                run.stop()
            server.cleanup()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
