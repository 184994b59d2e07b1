"""Live self-check of the engine's block hashing: are the events' hashes the ones we compute?

A KV-cache-aware router answers with a silent 0 when the indexer hashes prompts differently
from the engine (another ``PYTHONHASHSEED``, another ``--prefix-caching-hash-algo``, another
release's extra-key rule). :class:`HashChecker` recomputes the hashes of sampled
``BlockStored`` events from their ``token_ids`` and extra keys and compares them with the
event's ``block_hashes``:

* Only chains it can prove: an event whose parent is the chain root (``parent_block_hash``
  nil on a full-attention group: NONE_HASH from the configured seed) or a block it verified
  itself, in any KV-cache group (its full 32-byte digest is kept, the last
  :data:`VERIFIED_MAX` per instance; events carry only 8 bytes, which cannot be chained).
  GPU events only.
* Plain stores (tokens exactly ``len(block_hashes) * block_size`` at the hash unit) are
  checked block by block. Every other store of a KV-cache group — a sliding-window or Mamba
  group's sparse store, a block larger than the hash unit ``h``, a partial entry — is checked
  by chaining its whole token span at ``h`` and requiring the published hashes to be a
  subsequence of the chain's values at the group's block boundaries (spec vllm-hybrid-kv.md
  §2.3); ``h`` as :func:`common.group_view.parse_groups` says. A ``--prefix-match-unit``
  finer than the derived unit shows as a mismatch naming the unit. A null parent is the
  root only on full-attention kinds (a sparse group's first kept block has no stored parent
  either); such stores, and sparse ones with extra keys, are unchecked.
* Bounded CPU: a token bucket of ``ingest.l1.hashCheckRate`` blocks per second per instance
  (burst one second). When the bucket is empty an event costs one comparison.
* Extra keys come from the event (``extra_keys``, vLLM >= 0.17, one entry per hash; else
  ``lora_name`` on every block). The "untagged" rule (vLLM 0.12–0.30) hashes them as
  published (LoRA name, multimodal identifier or ``(identifier, offset)``, salt); the
  "tagged" rule (>= 0.31) hashes ``("cache_salt", s)``, ``("mm", id, off)``,
  ``("prompt_embeds", d)`` and needs the LoRA path, which events do not carry: such blocks
  are counted unchecked (``lora_path``), never a mismatch. With ``lookahead_token_ids``
  (vLLM >= 0.33 speculative decoding) each block hashes ``(keys, *its lookahead tokens)``.
  Releases before 0.17 publish no extra keys (before 0.14 not even the LoRA name): once a
  block verified (seed and algo are right), a mismatch no alternative setting explains is
  counted unchecked (``extra_keys_unpublished``: a multimodal item or salt we cannot see).
* The verdict is ``ok`` once a block verified, ``mismatch`` for :data:`MISMATCH_HOLD` seconds
  after a block did not (``unchecked`` before either).
* On a mismatch it searches the plausible alternatives (the configured and common seeds,
  ``"vllm-none-hash"``, both algos, both extra-key rules) on that one block and names the one
  that matches, in the status detail, the log (once per change) and
  ``cache_indexer_l1_hash_check_hint_total``. A search that finds nothing is not repeated for
  :data:`SEARCH_INTERVAL` seconds.

Pure apart from logging and metrics (no I/O); the subscriber writes its counts to Redis.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence

from common.blockhash import (
    ALGOS,
    HashSettings,
    chain_digests,
    to_event_int,
)
from common.events import BlockStored, Event, hash_to_int
from common.lifecycle import StateLog
from common.status_report import HashCheck
from common.hit_rule import FULL_ATTENTION_KINDS
from services.l1_ingest.apply import tier_for_medium
from services.l1_ingest.hashcheck_keys import SEEDS
from services.l1_ingest.hashcheck_keys import TAGGED
from services.l1_ingest.hashcheck_keys import UNTAGGED
from services.l1_ingest.hashcheck_keys import Candidate
from services.l1_ingest.hashcheck_keys import Uncheckable
from services.l1_ingest.hashcheck_keys import expected_candidate
from services.l1_ingest.hashcheck_keys import hash_side_keys
from services.l1_ingest.hashcheck_keys import none_hash
from services.l1_ingest.metrics import IngestMetrics

logger = logging.getLogger(__name__)

OK, MISMATCH, UNCHECKED = HashCheck.OK, HashCheck.MISMATCH, HashCheck.UNCHECKED
_ROOT_KINDS = frozenset({None, *FULL_ATTENTION_KINDS})
"""Kinds whose null parent is the chain root (``None``: versions that send no kind)."""
EXTRA_KEYS_PUBLISHED_SINCE = (0, 17, 0)
"""The first vLLM whose BlockStored carries each block's extra keys (``extra_keys``)."""
VERIFIED_MAX = 4096
"""Verified digests kept per instance (parents that later events may chain from)."""
SEARCH_INTERVAL = 300.0
"""Seconds between two searches for an explanation that found none (a search is ~1,000
candidate hashes: a few tens of ms; a found explanation is re-tried first, for one hash)."""
MISMATCH_HOLD = 60.0
"""Seconds the verdict stays ``mismatch`` after the last mismatching block: when only some
blocks differ (salted prompts under the wrong extra-key rule) the status must not flicker."""


class HashChecker:
    """The self-check of one instance (all its DP ranks); see the module docstring."""

    def __init__(
        self,
        name: str,
        settings: HashSettings,
        rate: float,
        *,
        metrics: IngestMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        hash_unit: int = 0,
    ) -> None:
        self.name, self.rate, self.metrics, self.clock = name, float(rate), metrics, clock
        self.configured_unit = hash_unit
        self.unit = hash_unit
        """The hash unit the checks chain at: configured, else the GCD of block sizes seen."""
        self.version = ".".join(map(str, settings.vllm_version))
        self._keys_unpublished = settings.vllm_version < EXTRA_KEYS_PUBLISHED_SINCE
        self.expected = expected_candidate(settings)
        self._capacity = max(1.0, self.rate)
        self._tokens, self._last = self._capacity, clock()
        self.verified: OrderedDict[int, bytes] = OrderedDict()
        self.ok = self.mismatch = 0
        self.verdict: HashCheck = UNCHECKED
        self.detail = "no checkable BlockStored event seen yet"
        self.hint: Candidate | None = None
        self.unchecked: Counter[str] = Counter()
        self._searched_at = -SEARCH_INTERVAL
        self._mismatch_at = -MISMATCH_HOLD
        self._log = StateLog(logger, f"{name}: block-hash self-check")

    # -- hot path --------------------------------------------------------------------------

    def offer(self, events: Sequence[Event]) -> None:
        """Check what the budget allows of one applied batch."""
        if self.rate <= 0:
            return
        now = self.clock()
        self._tokens = min(self._capacity, self._tokens + (now - self._last) * self.rate)
        self._last = now
        for event in events:
            if self._tokens < 1:
                return
            if type(event) is BlockStored:
                self._consider(event)

    def _consider(self, event: BlockStored) -> None:
        n, size = len(event.block_hashes), event.block_size
        if size <= 0 or tier_for_medium(event.medium) != "l1":
            return  # placeholders and other media
        if not self.configured_unit:
            self.unit = math.gcd(self.unit, size)
        parent_int = event.parent_block_hash
        if parent_int is None:
            if event.kv_cache_spec_kind not in _ROOT_KINDS:
                return  # a sparse group's first kept block: its parent is not stored
            parent = none_hash(self.expected.algo, self.expected.seed)
        else:  # the commonest case first: a parent never verified (costs no budget)
            found = self.verified.get(
                parent_int if type(parent_int) is int else hash_to_int(parent_int)
            )
            if found is None:
                return
            parent = found
        if n == 0:
            return
        if size == self.unit and len(event.token_ids) == n * size:
            k = n if self._tokens >= n else int(self._tokens)
            self._tokens -= k
            self._check(event, parent, k)
            return
        units = len(event.token_ids) // self.unit if self.unit else 0
        if units == 0 or units > self._tokens:
            return
        self._tokens -= units
        self._check_span(event, parent)

    def _check_span(self, event: BlockStored, parent: bytes) -> None:
        """A group's store that is not one hash per ``h`` tokens: its published hashes must
        be a subsequence of the span's chain at ``h``, at the group's block boundaries."""
        unit, size = self.unit, event.block_size
        if size % unit or len(event.token_ids) % unit:
            self._skip("span_not_whole_units")
            return
        if (
            any(k is not None for k in (event.extra_keys or []))
            or event.lora_name
            or event.lookahead_token_ids
        ):
            self._skip("sparse_extra_keys")
            return
        try:
            digests = chain_digests(
                self.expected.algo,
                parent,
                event.token_ids,
                unit,
                [None] * (len(event.token_ids) // unit),
            )
        except ValueError:
            self._skip("bad_tokens")
            return
        values = [to_event_int(d) for d in digests]
        step = size // unit
        boundaries = iter(values[step - 1 :: step])
        published = [hash_to_int(h) for h in event.block_hashes]
        if not all(any(v == b for b in boundaries) for v in published):
            self._on_span_mismatch(event)
            return
        for value, digest in zip(values, digests):
            self._remember(value, digest)
        self._count_ok(len(published))

    def _on_span_mismatch(self, event: BlockStored) -> None:
        self.mismatch += 1
        self._mismatch_at = self.clock()
        if self.metrics is not None:
            self.metrics.hash_checks.inc(result=MISMATCH)
        source = (
            "ingest.l1.prefixMatchUnit"
            if self.configured_unit
            else "the GCD of the "
            "block sizes seen (set ingest.l1.prefixMatchUnit to vLLM's --prefix-match-unit)"
        )
        self._set(
            MISMATCH,
            f"the hashes of KV-cache group {event.group_idx or 0} "
            f"({event.kv_cache_spec_kind or 'kind not sent'}, block "
            f"{event.block_size}) are not on the chain at hash unit "
            f"{self.unit} from {source}, with "
            f"{self.expected.describe(False)}",
        )

    def _check(self, event: BlockStored, parent: bytes, k: int) -> None:
        at_root = event.parent_block_hash is None
        try:
            extras = hash_side_keys(event, self.expected.rule, at_root)[:k]
            digests = chain_digests(
                self.expected.algo, parent, event.token_ids, event.block_size, extras
            )
        except Uncheckable as exc:
            self._skip(str(exc.args[0]))
            return
        except ValueError:
            self._skip("bad_tokens")
            return
        for i, digest in enumerate(digests):
            if to_event_int(digest) != hash_to_int(event.block_hashes[i]):
                self._on_mismatch(event, parent if i == 0 else digests[i - 1], i)
                return
            self._remember(hash_to_int(event.block_hashes[i]), digest)
        self._count_ok(len(digests))

    def _count_ok(self, blocks: int) -> None:
        self.ok += blocks
        if self.metrics is not None:
            self.metrics.hash_checks.inc(blocks, result=OK)
        if self.clock() - self._mismatch_at >= MISMATCH_HOLD:
            self._set(OK, f"{self.ok} blocks verified ({self.expected.describe(False)})")

    def _remember(self, value: int, digest: bytes) -> None:
        self.verified[value] = digest
        if len(self.verified) > VERIFIED_MAX:
            self.verified.popitem(last=False)

    def _skip(self, reason: str) -> None:
        self.unchecked[reason] += 1
        if self.metrics is not None:
            self.metrics.hash_check_unchecked.inc(reason=reason)
        if self.verdict == UNCHECKED:
            self.detail = f"no checkable block yet (last skipped: {reason})"

    # -- mismatch --------------------------------------------------------------------------

    def _on_mismatch(self, event: BlockStored, parent: bytes, index: int) -> None:
        unit = None if self.configured_unit else self._finer_unit(event, parent, index)
        hint = None if unit is not None else self._explain(event, parent, index)
        if unit is None and hint is None and self.ok and self._keys_unpublished:
            # Blocks verified already, so seed and algo are right; a release that does not
            # publish extra keys hides a multimodal item, a salt or (< 0.14) a LoRA here.
            self._skip("extra_keys_unpublished")
            return
        self.mismatch += 1
        self._mismatch_at = self.clock()
        if self.metrics is not None:
            self.metrics.hash_checks.inc(result=MISMATCH)
        self._set(MISMATCH, self._mismatch_detail(event, unit, hint))

    def _mismatch_detail(self, event: BlockStored, unit: int | None, hint: Candidate | None) -> str:
        keyed = any(k is not None for k in (event.extra_keys or [])) or bool(event.lora_name)
        if unit is not None:
            return (
                f"the engine hashes at a prefix-match unit of {unit} tokens (vLLM's "
                f"--prefix-match-unit), finer than the block size {event.block_size}: "
                f"set ingest.l1.prefixMatchUnit: {unit}"
            )
        if hint is not None:
            if hint != self.hint and self.metrics is not None:
                self.metrics.hash_check_hints.inc(
                    seed=hint.seed, algo=hint.algo, extra_keys=hint.rule
                )
            self.hint = hint
            return (
                f"the engine hashes with {hint.describe(keyed)}; the config says "
                f"{self._config_text(hint)}"
            )
        if self.hint is not None and self.verdict == MISMATCH:
            return self.detail  # the last explanation still stands until a search says else
        return (
            "no plausible setting reproduces the engine's hashes: PYTHONHASHSEED may "
            "be unset on a vLLM < 0.29 engine (random per process), or an unknown "
            f"seed is used; the config says {self.expected.describe(keyed)}"
        )

    def _finer_unit(self, event: BlockStored, parent: bytes, index: int) -> int | None:
        """The largest unit below the block size at which block ``index``'s published value
        is the chain's value at its end, if any (a ``--prefix-match-unit`` not configured)."""
        size = event.block_size
        tokens = event.token_ids[index * size : (index + 1) * size]
        if len(tokens) != size or event.extra_keys or event.lora_name:
            return None
        if event.lookahead_token_ids:
            return None
        want = hash_to_int(event.block_hashes[index])
        for unit in sorted((d for d in range(1, size) if size % d == 0), reverse=True)[:16]:
            try:
                last = chain_digests(
                    self.expected.algo, parent, tokens, unit, [None] * (size // unit)
                )[-1]
            except ValueError:
                return None
            if to_event_int(last) == want:
                return unit
        return None

    def _config_text(self, hint: Candidate) -> str:
        exp, parts = self.expected, []
        if hint.seed != exp.seed:
            parts.append(f"pythonHashSeed {exp.seed!r}")
        if hint.algo != exp.algo:
            parts.append(f"prefixCachingHashAlgo {exp.algo}")
        if hint.rule != exp.rule:
            parts.append(f"vllmVersion {self.version} ({exp.rule} extra keys)")
        return ", ".join(parts)

    def _explain(self, event: BlockStored, parent: bytes, index: int) -> Candidate | None:
        """The alternative that reproduces block ``index``'s hash, if any (bounded search)."""
        if self.hint is not None and self._matches(self.hint, event, parent, index):
            return self.hint
        now = self.clock()
        if now - self._searched_at < SEARCH_INTERVAL:
            return None
        self._searched_at = now
        for cand in self._candidates(event.parent_block_hash is None and index == 0):
            if cand != self.expected and self._matches(cand, event, parent, index):
                return cand
        return None

    def _candidates(self, at_root: bool) -> Iterator[Candidate]:
        exp = self.expected
        rules = (exp.rule, UNTAGGED if exp.rule == TAGGED else TAGGED)
        if not at_root:  # the verified prefix fixed seed and algo; only the rule can differ
            yield from (Candidate(exp.seed, exp.algo, r) for r in rules)
            return
        algos = (exp.algo, *(a for a in ALGOS if a != exp.algo))
        seeds = (exp.seed, *(s for s in SEEDS if s != exp.seed))
        for algo in algos:
            for rule in rules:
                yield from (Candidate(seed, algo, rule) for seed in seeds)

    def _matches(self, cand: Candidate, event: BlockStored, parent: bytes, index: int) -> bool:
        at_root = event.parent_block_hash is None
        if at_root and index == 0:
            parent = none_hash(cand.algo, cand.seed)
        size = event.block_size
        try:
            extras = hash_side_keys(event, cand.rule, at_root)
            tokens = event.token_ids[index * size : (index + 1) * size]
            (digest,) = chain_digests(cand.algo, parent, tokens, size, [extras[index]])
        except (Uncheckable, ValueError):
            return False
        return to_event_int(digest) == hash_to_int(event.block_hashes[index])

    def _set(self, verdict: HashCheck, detail: str) -> None:
        """Record the verdict; log once per change of verdict or of the named alternative."""
        self.verdict, self.detail = verdict, detail
        if verdict == MISMATCH:
            hint = self.hint
            named = "" if hint is None else f" ({hint.seed!r}, {hint.algo}, {hint.rule})"
            self._log.set(f"mismatch{named}", detail, logging.WARNING)
        else:
            self._log.set(verdict, "hashes match the config" if verdict == OK else detail)
