"""The engine driver's :class:`Run` for prompts with extra hash inputs (LoRA, images).

:meth:`Run.settle` waits until the engine's events hold the previous prompt's blocks under
the hashes the project computes. With extra inputs that wait is itself a check of the hasher
(the engine names the blocks, we compute the names), so here a miss does not abort the run:
it is recorded (``held`` false in the request's row; the tests assert it true) and the
request is still scored
once the engine's PUB is quiet and the index has applied every batch. A hashing bug then
shows as wrong answers and misses, not as a driver error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.blockhash import BlockHasher, HashSettings
from common.blockhash_extra import HashInputs
from tests.conftest import wait_for
from tests.integration.vllm_engine_driver import Run

HOLD_TIMEOUT = 15.0
"""Seconds to wait for the previous prompt's blocks to appear in the engine's events."""


class InputsHasher:
    """``event_ints``/``digests`` under fixed extra inputs (what :meth:`Run.settle` and
    :class:`tests.integration.vllm_engine.Capture` call)."""

    def __init__(self, hasher: BlockHasher, inputs: HashInputs) -> None:
        self.hasher, self.inputs = hasher, inputs

    def event_ints(self, prompt: Sequence[int], block_size: int) -> list[int]:
        return self.hasher.event_ints(prompt, block_size, inputs=self.inputs)

    def digests(self, prompt: Sequence[int], block_size: int) -> list[bytes]:
        return self.hasher.digests(prompt, block_size, inputs=self.inputs)


class KeyedRun(Run):
    """A :class:`Run` whose prompts carry extra hash inputs (vLLM 0.32's rules)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hasher_0_32 = BlockHasher(HashSettings(vllm_version=(0, 32, 0)))
        self.previous_inputs = HashInputs()

    def settle(self, previous: list[int] | None, answered: float) -> dict[str, Any]:
        """:meth:`Run.settle` for a previous prompt hashed with :attr:`previous_inputs`."""
        assert self.capture is not None
        capture, hasher = self.capture, InputsHasher(self.hasher_0_32, self.previous_inputs)
        held = True
        if previous:
            try:
                wait_for(
                    lambda: capture.holds(previous, hasher),  # type: ignore[arg-type]
                    timeout=HOLD_TIMEOUT,
                    what="the engine's events to hold the previous prompt's blocks",
                )
            except AssertionError:
                held = False
        return {**super().settle(None, answered), "held": held}
