"""A simulated vLLM instance: per DP rank a prefix-cache model and a wire-exact publisher.

:class:`SimulatedVLLM` is what tests, the local stack and the benchmarks drive: serve
requests (one engine step per rank → at most one batch per rank), drop batches from the live
stream (they stay in the replay buffer, like a PUB high-water-mark drop), reset the prefix
cache, or restart (sequence back to 0, empty cache, sockets re-created). Its true cache
contents are available in-process (:meth:`true_prefix_len`, :meth:`true_hit_tokens`,
:meth:`state`) and as JSON (:meth:`write_state`) for checking an indexer's answers.

A ``model_shape`` other than ``dense`` plays a hybrid model (:mod:`services.simulator.shapes`,
:class:`~services.simulator.hybrid_model.HybridCacheModel`): vLLM >= 0.22 only (the stores
carry kinds from there), no CPU offload, engine ``vllm`` only. Its state adds ``model_shape``,
``hash_unit``, ``groups`` and, per rank, every group's residency (``gpu_groups``, what
:func:`~services.simulator.shapes.state_hit_tokens` reads); ``gpu`` is then group 0's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import zmq

from common import hit_rule
from common.blockhash import BlockHasher, HashSettings, parse_vllm_version
from services.simulator.ascend import ConnectorEvents
from services.simulator.cache_model import PrefixCacheModel, Request
from services.simulator.hybrid_model import HybridCacheModel
from services.simulator.publisher import Publisher
from services.simulator.shapes import HYBRID_SINCE, describe, rule_for, shape_groups

CacheModel = PrefixCacheModel | HybridCacheModel


class SimulatedVLLM:
    """One vLLM instance with ``ranks`` DP ranks (all of them, or just ``--dp-rank``)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "",
        *,
        vllm_version: str = "0.28.0",
        block_size: int = 16,
        num_blocks: int = 1024,
        ranks: Sequence[int] = (0,),
        buffer_steps: int = 10_000,
        cpu_blocks: int = 0,
        hash_algo: str = "sha256_cbor",
        hash_seed: str | None = "0",
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        bind_host: str = "127.0.0.1",
        engine: str = "vllm",
        model_shape: str = "dense",
        prefill_chunk: int = 0,
    ) -> None:
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.bind_host = bind_host
        if engine not in ("vllm", "vllm-ascend"):
            raise ValueError(f"unknown engine {engine!r}: vllm or vllm-ascend")
        self.engine = engine
        self.connectors: dict[int, ConnectorEvents] = {}
        self.version = parse_vllm_version(vllm_version)
        self.model_shape, self.groups = model_shape, shape_groups(model_shape)
        self.prefill_chunk = prefill_chunk
        if model_shape != "dense":
            _check_hybrid(self.version, engine, cpu_blocks)
        elif prefill_chunk:
            raise ValueError("a prefill chunk needs a hybrid model shape")
        self.hasher = BlockHasher(HashSettings.from_strings(hash_algo, hash_seed, vllm_version))
        self.block_size, self.num_blocks, self.cpu_blocks = block_size, num_blocks, cpu_blocks
        self.ranks, self.buffer_steps = list(ranks), buffer_steps
        self.ctx = ctx or zmq.Context.instance()
        self.models: dict[int, CacheModel] = {}
        self.publishers: dict[int, Publisher] = {}
        self.served: dict[Request, None] = {}
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        for rank in self.ranks:
            self.models[rank] = self._model()
            if self.engine == "vllm-ascend":  # the pool outlives an engine restart
                self.connectors.setdefault(rank, ConnectorEvents())
            self.publishers[rank] = Publisher(
                self.endpoint,
                self.replay_endpoint,
                self.topic,
                dp_rank=rank,
                vllm_version=self.version,
                buffer_steps=self.buffer_steps,
                ctx=self.ctx,
                bind_host=self.bind_host,
            )

    def _model(self) -> CacheModel:
        if self.model_shape == "dense":
            return PrefixCacheModel(self.num_blocks, self.block_size, self.hasher, self.cpu_blocks)
        return HybridCacheModel(
            self.num_blocks, self.block_size, self.hasher, self.groups, self.prefill_chunk
        )

    # -- driving -------------------------------------------------------------------------

    def serve(
        self, requests: Iterable[Request], *, rank: int | None = None, drop: bool = False
    ) -> dict[int, int]:
        """One engine step: requests go to ``rank`` or round-robin; returns rank → seq sent."""
        by_rank: dict[int, list[Request]] = {r: [] for r in self.ranks}
        for i, request in enumerate(requests):
            by_rank[self.ranks[i % len(self.ranks)] if rank is None else rank].append(request)
            self.served[request] = None
        sent: dict[int, int] = {}
        for r, batch in by_rank.items():
            if batch:
                events = self.models[r].step(batch)
                if r in self.connectors:  # vllm-ascend: + the store connector's pool events
                    events += self.connectors[r].after(events)
                if events:
                    sent[r] = self.publishers[r].publish(events, drop=drop)
        return sent

    def reset_prefix_cache(self, rank: int | None = None) -> None:
        for r in self.ranks if rank is None else [rank]:
            self.publishers[r].publish(self.models[r].reset())

    def restart(self) -> None:
        """vLLM restarts: the publisher's sockets close, sequences restart at 0, cache empty."""
        self.close()
        self.restarts += 1
        self._start()

    def flush(self) -> None:
        for pub in self.publishers.values():
            pub.flush()

    def close(self) -> None:
        for pub in self.publishers.values():
            pub.close()
        self.publishers = {}

    # -- truth ---------------------------------------------------------------------------

    def last_seq(self, rank: int = 0) -> int:
        return self.publishers[rank].last_seq

    def true_prefix_len(self, request: Request) -> int:
        """Leading blocks of ``request`` cached on GPU on any rank (what L1 must answer for a
        dense model; for a hybrid, in its first full-attention group: an upper bound)."""
        hashes = self.models[self.ranks[0]].hashes(request)
        group = next(g for g, s in enumerate(self.groups) if s.kind == "full_attention")
        held = [_held(m, group) for m in self.models.values()]
        for i, h in enumerate(hashes):
            if not any(h in m for m in held):
                return i
        return len(hashes)

    def true_hit_tokens(self, request: Request) -> int:
        """vLLM's hit for ``request``, in tokens (:mod:`common.hit_rule` over every group's
        blocks on any rank: the union the index evaluates)."""
        hashes = self.models[self.ranks[0]].hashes(request)
        present = [
            [int(any(h in _held(m, g) for m in self.models.values())) for h in hashes]
            for g in range(len(self.groups))
        ]
        return hit_rule.hit_tokens(
            rule_for(self.groups, self.block_size), len(request.token_ids), present
        )

    def member_keys(self, request: Request) -> list[bytes]:
        return self.hasher.member_keys(list(request.token_ids), self.block_size, request.cache_salt)

    def state(self, *, finished: bool = False) -> dict[str, Any]:
        """JSON-able truth: per rank the last sequence, GPU hash → copies, CPU hashes, and
        (vllm-ascend) the hashes its connector put into the pool; ``finished`` once the run
        is over and nothing more will be published."""
        state: dict[str, Any] = {
            "block_size": self.block_size,
            "finished": finished,
            "restarts": self.restarts,
            "updated": time.time(),
            "ranks": {
                str(r): {
                    "last_seq": self.publishers[r].last_seq if r in self.publishers else -1,
                    "gpu": {str(h): n for h, n in self.models[r].gpu_counts().items()},
                    "cpu": sorted(str(h) for h in self.models[r].cpu_hashes()),
                    "rejected": self.models[r].rejected,
                    "pool": sorted(str(h) for h in self.connectors[r].pool)
                    if r in self.connectors
                    else [],
                }
                for r in self.ranks
            },
        }
        if self.model_shape != "dense":  # hybrid: the groups and each group's residency
            state.update(
                model_shape=self.model_shape,
                hash_unit=self.block_size,
                groups=describe(self.groups, self.block_size),
            )
            for r in self.ranks:
                model = self.models[r]
                assert isinstance(model, HybridCacheModel)
                state["ranks"][str(r)]["gpu_groups"] = {
                    str(g): {str(h): n for h, n in counts.items()}
                    for g, counts in enumerate(model.group_counts())
                }
        return state

    def write_state(self, path: str | os.PathLike[str], *, finished: bool = False) -> None:
        """Atomically replace ``path`` with :meth:`state` as JSON."""
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.state(finished=finished)), encoding="utf-8")
        tmp.replace(target)


def _held(model: CacheModel, group: int) -> dict[int, list[int]]:
    return model.cached[group] if isinstance(model, HybridCacheModel) else model.cached


def _check_hybrid(version: tuple[int, int, int], engine: str, cpu_blocks: int) -> None:
    if version < HYBRID_SINCE:
        raise ValueError("hybrid model shapes need vLLM >= 0.22 (kinds on the stores)")
    if engine != "vllm" or cpu_blocks:
        raise ValueError("hybrid model shapes play vLLM without CPU offload only")
