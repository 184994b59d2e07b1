"""The model shapes ``simulate-vllm --model-shape`` can play: the KV-cache groups vLLM forms.

Each shape is the list of groups in vLLM's numbering (order of first appearance of each spec
in the layer list, spec vllm-hybrid-kv.md §2.5), as the real engine numbered them on the CPU
machines (vllm-cpu-engine.md, "What the engine publishes"):

| shape | groups | like |
|---|---|---|
| ``dense`` | 0 ``full_attention`` | Llama, Qwen3 (the simulator's historical behaviour) |
| ``gemma3`` | 0, 1 ``sliding_window`` (window 64), 2 ``full_attention`` | Gemma 3 |
| ``qwen3next`` | 0 ``mamba``, 1 ``full_attention`` | Qwen3-Next, Qwen3.5 |
| ``gptoss`` | 0 ``sliding_window`` (window 128), 1 ``full_attention`` | gpt-oss |

Every group has the simulator's block size, so the hash unit and vLLM's alignment are that
block size and every group publishes values of the one hash chain. The truth an indexer must
reproduce is vLLM's hybrid rule (:mod:`common.hit_rule`) over per-group residency:
:func:`rule_for` builds it, :func:`state_hit_tokens` applies it to a ``--state-file``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common import hit_rule
from common.hit_rule import GroupSpec, Rule


@dataclass(frozen=True)
class GroupShape:
    """One KV-cache group: the kind vLLM stamps on its stores and its window (SWA only)."""

    kind: str
    sliding_window: int | None = None


SHAPES: dict[str, tuple[GroupShape, ...]] = {
    "dense": (GroupShape("full_attention"),),
    "gemma3": (
        GroupShape("sliding_window", 64),
        GroupShape("sliding_window", 64),
        GroupShape("full_attention"),
    ),
    "qwen3next": (GroupShape("mamba"), GroupShape("full_attention")),
    "gptoss": (GroupShape("sliding_window", 128), GroupShape("full_attention")),
}
HYBRID_SINCE = (0, 22, 0)
"""First vLLM release whose stores carry the group's kind and window (vllm#40984)."""


def shape_groups(name: str) -> tuple[GroupShape, ...]:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}: one of {', '.join(SHAPES)}") from None


def rule_for(groups: Sequence[GroupShape], block_size: int) -> Rule:
    """vLLM's hit rule for ``groups``, all of ``block_size`` tokens (hash unit = block size)."""
    return hit_rule.build_rule(
        [GroupSpec(g.kind, block_size, g.sliding_window) for g in groups], block_size
    )


def describe(groups: Sequence[GroupShape], block_size: int) -> list[dict[str, Any]]:
    """The groups as the state file lists them (what the stores announce)."""
    return [
        {"group": gid, "kind": g.kind, "block_size": block_size, "sliding_window": g.sliding_window}
        for gid, g in enumerate(groups)
    ]


def state_hit_tokens(state: Mapping[str, Any], hashes: Sequence[int], num_tokens: int) -> int:
    """vLLM's hit, in tokens, for a prompt of ``num_tokens`` tokens whose block hashes are
    ``hashes``, over the residency a hybrid ``--state-file`` reports (the union of its DP
    ranks, as the index evaluates it)."""
    groups = [GroupShape(g["kind"], g.get("sliding_window")) for g in state["groups"]]
    held: list[set[int]] = [set() for _ in groups]
    for rank in state["ranks"].values():
        for gid, counts in rank["gpu_groups"].items():
            held[int(gid)].update(int(h) for h in counts)
    present = [[int(h in s) for h in hashes] for s in held]
    return hit_rule.hit_tokens(rule_for(groups, int(state["block_size"])), num_tokens, present)
