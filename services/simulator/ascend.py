"""vllm-ascend on top of the simulated vLLM: what its ``AscendStoreConnector`` adds.

vllm-ascend publishes vLLM's own KV events (the paired vLLM release's encoding, e.g. arrays
for v0.18.0 ↔ vLLM 0.18.0); since v0.15.0rc1 the connector also emits, for every block it
puts into the Mooncake pool, ``BlockStored(block_hashes=[u64], medium="cpu")`` with the
un-multiplied block size and no lora fields, and never a ``BlockRemoved`` for the pool
(spec vllm-ascend-mooncake §5). :class:`ConnectorEvents` reproduces those events;
:func:`ascend_store_key` builds the connector's Mooncake keys (§1) for the simulated pods.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.config import model_basename
from common.events import BlockStored, Event, hash_to_int

DEFAULT_VLLM = "0.18.0"
"""vLLM release paired with vllm-ascend v0.18.0, the original cache-indexer's default."""
FORMS = ("A", "C", "A-LW", "C-LW", "E-LW")
"""Key layouts: A = v0.13–v0.19, C = v0.20.2+, LW = layer-wise (see keys_parser)."""


class ConnectorEvents:
    """The connector's pool events for one rank: each block once (the connector skips keys
    that already exist), in put order, parent = the previous block of the same request."""

    def __init__(self) -> None:
        self.pool: set[int] = set()

    def after(self, events: Sequence[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if not isinstance(event, BlockStored) or (event.medium or "").upper() != "GPU":
                continue
            size = event.block_size
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                u64 = hash_to_int(h)
                if u64 not in self.pool:
                    self.pool.add(u64)
                    out.append(
                        BlockStored(
                            block_hashes=[u64],
                            parent_block_hash=None if parent is None else hash_to_int(parent),
                            token_ids=list(event.token_ids[i * size : (i + 1) * size]),
                            block_size=size,
                            lora_id=None,
                            medium="cpu",
                            lora_name=None,
                        )
                    )
                parent = h
        return out


def ascend_store_key(
    model: str, head: int, digest_hex: str, *, form: str = "A", pp: int = 0, layer: int = 0
) -> str:
    """One AscendStoreConnector key (pcp0/dcp0; group 0 ``kv``/``default`` where the layout
    has groups); ``model`` is the basename of ``--model``."""
    base = f"{model_basename(model)}@pcp0@dcp0@head_or_tp_rank:{head}"
    group = "@group:0@cache_role:kv@cache_family:default"
    if form == "A":
        return f"{base}@pp_rank:{pp}@{digest_hex}"
    if form == "C":
        return f"{base}@pp_rank:{pp}{group}@{digest_hex}"
    if form == "A-LW":
        return f"{base}@{digest_hex}@{layer}"
    if form == "C-LW":
        return f"{base}{group}@{digest_hex}@{layer}"
    if form == "E-LW":
        return f"{base}{group}@layer_id:{layer}@{digest_hex}"
    raise ValueError(f"unknown vllm-ascend key layout {form!r} (one of {', '.join(FORMS)})")
