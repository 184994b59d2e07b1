"""Deterministic prompt streams for the simulator: shared prefixes, repeats, salts, uniques.

``mixed`` draws from every pattern a router meets: prompts sharing a system prefix, exact
repeats (which make vLLM store a second copy of the last block), salted variants of pooled
prompts (different hashes for the same tokens), fresh unique prompts and prompts shorter
than one block (no hashes at all). ``shared``, ``repeat`` and ``unique`` use one pattern.
"""

from __future__ import annotations

import random

from services.simulator.cache_model import Request

KINDS = ("mixed", "shared", "repeat", "unique")
_VOCAB = 150_000


class Workload:
    """An endless, seeded request generator."""

    def __init__(
        self,
        kind: str = "mixed",
        *,
        prompts: int = 32,
        prompt_len: int = 128,
        block_size: int = 16,
        seed: int = 0,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"workload {kind!r} is not one of {', '.join(KINDS)}")
        self.kind, self.prompt_len, self.block_size = kind, max(prompt_len, 2), block_size
        self.rng = random.Random(seed)
        n_prefixes = max(1, prompts // 4)
        prefix_blocks = max(1, self.prompt_len // (2 * block_size))
        self.prefixes = [self._tokens(prefix_blocks * block_size) for _ in range(n_prefixes)]
        self.pool = [self._shared() for _ in range(max(1, prompts))]

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(_VOCAB) for _ in range(n))

    def _shared(self) -> Request:
        prefix = self.rng.choice(self.prefixes)
        extra = self.rng.randint(1, max(1, self.prompt_len - len(prefix)))
        return Request(prefix + self._tokens(extra))

    def _unique(self) -> Request:
        return Request(self._tokens(self.rng.randint(self.block_size // 2 + 1, self.prompt_len)))

    def next(self) -> Request:
        kind = self.kind
        if kind == "mixed":
            kind = self.rng.choices(
                ["shared", "repeat", "unique", "salted", "short"], [40, 25, 20, 10, 5]
            )[0]
        if kind == "shared":
            return self._shared()
        if kind == "repeat":
            return self.rng.choice(self.pool)
        if kind == "salted":
            return Request(
                self.rng.choice(self.pool).token_ids, cache_salt=f"tenant-{self.rng.randrange(3)}"
            )
        if kind == "short":
            return Request(self._tokens(self.rng.randint(1, max(1, self.block_size - 1))))
        return self._unique()
