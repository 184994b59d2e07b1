"""The ways an engine may have hashed a block, for the hash self-check (:mod:`.hashcheck`).

:class:`Candidate` is one (seed, algo, extra-key rule); :func:`hash_side_keys` rebuilds the
extra keys vLLM hashed for each block of an event under a rule (raising :class:`Uncheckable`
when the event does not carry enough to know); :data:`SEEDS` are the seeds tried on a mismatch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from common.blockhash import (
    DEFAULT_NONE_HASH_SEED,
    ExtraKeys,
    HashSettings,
    effective_seed,
    seed_none_hash,
    tags_extra_keys,
)
from common.events import BlockStored

UNTAGGED, TAGGED = "untagged", "tagged"
SEEDS = (
    "0",
    DEFAULT_NONE_HASH_SEED,
    "",
    "1",
    "42",
    "random",
    "1234",
    "12345",
    *(str(i) for i in range(2, 256)),
)
"""Seeds tried on a mismatch besides the configured one: vLLM's default, the empty string,
"random" and the small integers operators set (a few ms of hashing, once per change)."""


@dataclass(frozen=True)
class Candidate:
    """One way of hashing: PYTHONHASHSEED string, algo, extra-key rule."""

    seed: str
    algo: str
    rule: str

    def describe(self, keyed: bool) -> str:
        parts = [f"pythonHashSeed {self.seed!r}", self.algo]
        if keyed:
            parts.append(_RULE_TEXT[self.rule])
        return ", ".join(parts[:-1]) + " and " + parts[-1]


_RULE_TEXT = {
    UNTAGGED: "untagged extra keys (vLLM 0.12-0.30)",
    TAGGED: "tagged extra keys (vLLM >= 0.31)",
}


class Uncheckable(Exception):
    """This event cannot be checked; ``args[0]`` is a short reason (a metric label)."""


def hash_side_keys(event: BlockStored, rule: str, at_root: bool) -> list[ExtraKeys]:
    """The extra keys vLLM hashed for each block of ``event``, under an extra-key rule; with
    ``lookahead_token_ids`` (vLLM >= 0.33) each block's ``(keys, *lookahead tokens)``."""
    keys = _published_keys(event, rule, at_root)
    lookahead = event.lookahead_token_ids
    if lookahead is None:
        return keys
    if len(lookahead) != len(keys):
        raise Uncheckable("lookahead_misaligned")
    return [(k, *tokens) for k, tokens in zip(keys, lookahead, strict=True)]


def _published_keys(event: BlockStored, rule: str, at_root: bool) -> list[ExtraKeys]:
    n = len(event.block_hashes)
    if event.extra_keys is None:
        if not event.lora_name:
            return [None] * n
        if rule == TAGGED:
            raise Uncheckable("lora_path")
        return [(event.lora_name,)] * n
    if len(event.extra_keys) != n:
        raise Uncheckable("extra_keys_misaligned")
    if rule == UNTAGGED:
        return [None if keys is None else _tuple(keys) for keys in event.extra_keys]
    if event.lora_name:
        raise Uncheckable("lora_path")
    return [
        None if keys is None else _tagged(keys, i == 0 and at_root)
        for i, keys in enumerate(event.extra_keys)
    ]


def _tuple(value: Any) -> Any:
    """Lists (msgpack arrays) back to the tuples vLLM hashed (pickle tells them apart)."""
    return tuple(map(_tuple, value)) if isinstance(value, list) else value


def _tagged(keys: list[Any], first_block: bool) -> tuple[object, ...]:
    """vLLM >= 0.31 publishes untagged keys (``to_event_extra_keys``); tag them back."""
    out: list[object] = []
    for item in keys:
        if isinstance(item, list) and len(item) == 2:
            out.append(("mm", *_tuple(item)))
        elif isinstance(item, bytes):
            out.append(("prompt_embeds", item))
        elif isinstance(item, str) and first_block:
            out.append(("cache_salt", item))
        else:
            raise Uncheckable("extra_keys_unknown")
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def none_hash(algo: str, seed: str) -> bytes:
    return seed_none_hash(algo, seed)


def expected_candidate(settings: HashSettings) -> Candidate:
    """How the config says the engine hashes (raises ConfigError for an unset seed < 0.29)."""
    rule = TAGGED if tags_extra_keys(settings.vllm_version) else UNTAGGED
    return Candidate(effective_seed(settings), settings.algo, rule)
