"""``cache-indexer simulate-vllm``: a vLLM KV-event publisher driven by a prefix-cache model.

    cache-indexer simulate-vllm --endpoint tcp://*:5557 --replay-endpoint tcp://*:5558 \\
        --topic kv-events --vllm-version 0.28.0 --rate 50 --duration 60 --state-file sim.json
    cache-indexer simulate-vllm --engine vllm-ascend ...   # + AscendStoreConnector events

Each step serves ``--requests-per-step`` prompts from the workload on every DP rank and
publishes that step's events as one batch. ``--drop-every K`` leaves every K-th batch out of
the live stream (replay still has it), ``--restart-after N`` restarts the simulated vLLM once
after N steps, ``--reset-every N`` emits AllBlocksCleared. ``--state-file`` receives the true
cache contents as JSON every second and at the end of the run (then with ``"finished": true``).
A ``--duration`` run ends with a batch sent live: a dropped last batch would be a gap nobody
can see, since vLLM sends nothing until its next step. ``--linger S`` keeps the sockets open
(serving replay) for S seconds after the run, so a subscriber can catch up before the
simulated vLLM goes away. ``--engine vllm-ascend`` plays vllm-ascend:
vLLM's events in the paired release's encoding (``--vllm-version`` defaults to 0.18.0, i.e.
vllm-ascend v0.18.0) plus its store connector's ``BlockStored(medium="cpu")`` per pooled block.

``--model-shape`` plays a hybrid model's KV-cache groups (:mod:`services.simulator.shapes`):
``dense`` (the default: one ``full_attention`` group 0), ``gemma3`` (groups
0, 1 ``sliding_window`` with window 64, 2 ``full_attention``), ``qwen3next`` (0 ``mamba``,
1 ``full_attention``) or ``gptoss`` (0 ``sliding_window`` with window 128, 1
``full_attention``), all at ``--block-size`` on one hash chain. Each group publishes as vLLM
does (:mod:`services.simulator.hybrid_model`): one ``BlockStored`` per group per step with
``group_idx``, kind, window and block size, ``token_ids`` for every new full block but hashes
only for the blocks the group keeps (a sliding window its tail before the prompt's last token,
Mamba one state per prefill chunk), and a ``BlockRemoved`` with ``group_idx`` per evicted
block. ``--prefill-chunk N`` splits prefills into N-token chunks (hybrids only). Hybrids need
``--vllm-version`` >= 0.22; the state file then lists the groups and each group's residency
(``gpu_groups``), from which vLLM's hit follows (``shapes.state_hit_tokens``).
``--warm-prompt-file F`` serves the token ids of the JSON array in F every 5th step, like
``--warm-prompt``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import logs
from common.lifecycle import install_signal_handlers
from services.simulator.cache_model import Request
from services.simulator.ascend import DEFAULT_VLLM as ASCEND_VLLM
from services.simulator.engine import SimulatedVLLM
from services.simulator.shapes import SHAPES
from services.simulator.workload import KINDS, Workload

logger = logging.getLogger(__name__)
_EPILOG = (
    "--model-shape plays a model's KV-cache groups as vLLM numbers them: dense (group 0 "
    "full_attention, the default), gemma3 (0, 1 sliding_window w64, 2 full_attention), "
    "qwen3next (0 mamba, 1 full_attention), gptoss (0 sliding_window w128, 1 full_attention), "
    "all at --block-size on one hash chain. A hybrid publishes one BlockStored per group per "
    "step (group_idx, kv_cache_spec_kind, window, block_size) with token_ids for every new "
    "full block but hashes only for the blocks the group keeps (sliding window: the window "
    "before the prompt's last token; mamba: one state per prefill chunk), and BlockRemoved "
    "with group_idx per evicted block. Its --state-file lists the groups and each group's "
    "blocks (gpu_groups), from which vLLM's hit follows."
)


# The command's options, one line each: (flag, add_argument's keywords).
_OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--endpoint", dict(default="tcp://*:5557", help="PUB endpoint (vLLM's bind/connect rule)")),
    (
        "--replay-endpoint",
        dict(default="", help="replay ROUTER endpoint (always binds); '' = none"),
    ),
    ("--topic", dict(default="", help="topic frame (deployments use kv-events)")),
    (
        "--bind-host",
        dict(
            default="127.0.0.1",
            help="host a wildcard endpoint binds (vLLM binds every interface: pass '*')",
        ),
    ),
    (
        "--engine",
        dict(
            choices=["vllm", "vllm-ascend"],
            default="vllm",
            help="vllm, or vllm-ascend (vLLM's events + the AscendStoreConnector's pool events)",
        ),
    ),
    (
        "--vllm-version",
        dict(
            help="emulated vLLM release: encoding and framing (default 0.28.0; vllm-ascend: 0.18.0)"
        ),
    ),
    ("--block-size", dict(type=int, default=16)),
    ("--num-blocks", dict(type=int, default=1024, help="GPU blocks per rank")),
    ("--cpu-blocks", dict(type=int, default=0, help="CPU offload blocks per rank (0 = off)")),
    ("--dp-rank", dict(type=int, help="run only this DP rank")),
    ("--dp-size", dict(type=int, default=1, help="DP ranks to run when --dp-rank is not given")),
    ("--buffer-steps", dict(type=int, default=10_000, help="batches kept for replay")),
    ("--rate", dict(type=float, default=20.0, help="engine steps per second")),
    ("--requests-per-step", dict(type=int, default=2)),
    ("--seed", dict(type=int, default=0)),
    ("--workload", dict(choices=KINDS, default="mixed")),
    ("--prompts", dict(type=int, default=32, help="size of the shared-prompt pool")),
    ("--prompt-len", dict(type=int, default=128, help="maximum prompt length in tokens")),
    ("--hash-seed", dict(default="0", help="PYTHONHASHSEED of the simulated engine")),
    (
        "--warm-prompt",
        dict(
            type=int,
            default=0,
            metavar="N",
            help="also serve the prompt of token ids 1..N every 5th step (a well-known prompt "
            "that stays cached, for hand-written example requests; 0 = off)",
        ),
    ),
    (
        "--warm-prompt-file",
        dict(
            default="",
            metavar="F",
            help="also serve the token ids of the JSON array in F every 5th step ('' = off)",
        ),
    ),
    (
        "--model-shape",
        dict(
            choices=list(SHAPES),
            default="dense",
            help="KV-cache groups to play: dense (one full_attention group), gemma3 (2 "
            "sliding_window w64 + full_attention), qwen3next (mamba + full_attention), gptoss "
            "(sliding_window w128 + full_attention); hybrids need --vllm-version >= 0.22",
        ),
    ),
    (
        "--prefill-chunk",
        dict(
            type=int,
            default=0,
            metavar="N",
            help="hybrid shapes: prefill in chunks of N tokens, a multiple of --block-size "
            "(0 = a prompt at once)",
        ),
    ),
    (
        "--hash-algo",
        dict(
            default="sha256_cbor",
            choices=("sha256_cbor", "sha256"),
            help="--prefix-caching-hash-algo of the simulated engine",
        ),
    ),
    ("--duration", dict(type=float, default=0.0, help="seconds to run (0 = until stopped)")),
    (
        "--linger",
        dict(
            type=float,
            default=0.0,
            help="after the run, keep the sockets open (serving replay) for this many seconds",
        ),
    ),
    (
        "--drop-every",
        dict(type=int, default=0, help="drop every K-th batch from the live stream"),
    ),
    ("--restart-after", dict(type=int, default=0, help="restart once after N steps")),
    ("--reset-every", dict(type=int, default=0, help="reset the prefix cache every N steps")),
    ("--state-file", dict(default="", help="write the true cache state here (JSON)")),
    ("--log-level", dict(default="info")),
)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="cache-indexer simulate-vllm", description=__doc__.split("\n")[0], epilog=_EPILOG
    )
    for flag, keywords in _OPTIONS:
        p.add_argument(flag, **keywords)
    args = p.parse_args(argv)
    if args.vllm_version is None:
        args.vllm_version = ASCEND_VLLM if args.engine == "vllm-ascend" else "0.28.0"
    try:
        args.warm_tokens = _read_prompt(args.warm_prompt_file)
    except (OSError, ValueError) as exc:
        p.error(f"--warm-prompt-file: {exc}")
    return args


def _simulator(args: argparse.Namespace, ranks: list[int]) -> SimulatedVLLM:
    """The simulated engine the arguments describe (``ValueError`` if they do not fit)."""
    return SimulatedVLLM(
        args.endpoint,
        args.replay_endpoint,
        args.topic,
        vllm_version=args.vllm_version,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        ranks=ranks,
        buffer_steps=args.buffer_steps,
        cpu_blocks=args.cpu_blocks,
        hash_seed=args.hash_seed,
        hash_algo=args.hash_algo,
        bind_host=args.bind_host,
        engine=args.engine,
        model_shape=args.model_shape,
        prefill_chunk=args.prefill_chunk,
    )


def main(argv: list[str]) -> int:
    args = _parse(argv)
    logs.configure(args.log_level)
    ranks = [args.dp_rank] if args.dp_rank is not None else list(range(args.dp_size))
    try:
        sim = _simulator(args, ranks)
    except ValueError as exc:
        print(f"simulate-vllm: {exc}", file=sys.stderr)
        return 2
    workload = Workload(
        args.workload,
        prompts=args.prompts,
        prompt_len=args.prompt_len,
        block_size=args.block_size,
        seed=args.seed,
    )
    stop = threading.Event()
    install_signal_handlers(stop)
    logger.info(
        "simulating %s (vLLM %s, %s) on %s (ranks %s, replay %s)",
        args.engine,
        args.vllm_version,
        args.model_shape,
        args.endpoint,
        ranks,
        args.replay_endpoint or "none",
    )
    try:
        try:
            _run(args, sim, workload, stop)
        finally:  # the truth as of the last batch, also when stopped or failing
            sim.flush()
            if args.state_file:
                sim.write_state(args.state_file, finished=True)
        if args.linger > 0 and not stop.is_set():
            logger.info("run over; serving replay for %gs", args.linger)
            stop.wait(args.linger)
    finally:
        sim.close()
    return 0


def warm_prompt(n: int) -> Request:
    """The ``--warm-prompt`` request: token ids 1..n, easy to type into a curl example."""
    return Request(tuple(range(1, n + 1)))


def _read_prompt(path: str) -> tuple[int, ...]:
    """The ``--warm-prompt-file`` token ids (empty without a file)."""
    if not path:
        return ()
    tokens = json.loads(Path(path).read_text(encoding="utf-8"))
    if (
        not isinstance(tokens, list)
        or not tokens
        or not all(type(t) is int and t >= 0 for t in tokens)
    ):
        raise ValueError(f"{path} is not a JSON array of token ids")
    return tuple(tokens)


def step_requests(
    args: argparse.Namespace, workload: Workload, step: int, ranks: int
) -> list[Request]:
    """The prompts of engine step ``step`` (1-based): the workload's, plus the warm prompts."""
    requests = [workload.next() for _ in range(args.requests_per_step * ranks)]
    if args.warm_prompt and step % 5 == 1:
        requests.append(warm_prompt(args.warm_prompt))
    if args.warm_tokens and step % 5 == 1:
        requests.append(Request(args.warm_tokens))
    return requests


def _run(
    args: argparse.Namespace, sim: SimulatedVLLM, workload: Workload, stop: threading.Event
) -> None:
    period = 1.0 / args.rate if args.rate > 0 else 0.0
    start = next_step = last_dump = time.monotonic()
    step, dropped = 0, False
    while not stop.is_set():
        now = time.monotonic()
        if args.duration and now - start >= args.duration:
            if dropped:  # end on a live batch, so the subscriber sees the gap before it
                sim.serve(step_requests(args, workload, step + 1, len(sim.ranks)))
            return
        step += 1
        if args.restart_after and step == args.restart_after + 1:
            logger.info("restarting (step %d)", step)
            sim.restart()
        if args.reset_every and step % args.reset_every == 0:
            sim.reset_prefix_cache()
        dropped = bool(args.drop_every) and step % args.drop_every == 0
        sim.serve(step_requests(args, workload, step, len(sim.ranks)), drop=dropped)
        if args.state_file and now - last_dump >= 1.0:
            sim.flush()
            sim.write_state(args.state_file)
            last_dump = now
        next_step += period
        stop.wait(max(0.0, next_step - time.monotonic()))
