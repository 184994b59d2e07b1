"""The self-check's hint when the first mismatching block of an event is not block 0.

Issue 21, behaviour 4: a multimodal block after a plain one. Block 0 carries no extra keys, so
every extra-key rule hashes it alike and it verifies; block 1 carries an image, which vLLM
0.19-0.30 hashes as ``(identifier, offset)`` and vLLM >= 0.31 as ``("mm", identifier,
offset)``, while both publish ``[identifier, offset]``. The hint must still name the rule and
the ``vllmVersion`` setting, exactly as for the same image on block 0. The engine's hashes are
computed here from the spec's rules (§4.3-§4.4) with :func:`common.blockhash.chain_digests`.
"""

from __future__ import annotations

import pytest

from common.blockhash import HashSettings, chain_digests, seed_none_hash, to_event_int
from common.events import BlockStored
from services.l1_ingest.hashcheck import MISMATCH, HashChecker
from services.l1_ingest.hashcheck_keys import TAGGED, UNTAGGED
from services.l1_ingest.metrics import IngestMetrics
from tests.metrics_oracle import value_of

B = 16
IMAGE = ("img-7f3a", 5)
RULE_OF = {"0.28.0": UNTAGGED, "0.34.0": TAGGED}


def _engine_event(engine: str, algo: str, image_block: int) -> BlockStored:
    """Two blocks from the root; the image overlaps block ``image_block`` only."""
    tokens = list(range(5000, 5000 + 2 * B))
    hashed = (("mm", *IMAGE),) if RULE_OF[engine] == TAGGED else (IMAGE,)
    extras: list[tuple[object, ...] | None] = [None, None]
    extras[image_block] = hashed
    digests = chain_digests(algo, seed_none_hash(algo, "0"), tokens, B, extras)
    published: list[list[object] | None] = [None, None]
    published[image_block] = [list(IMAGE)]  # the same on the wire for both rules
    return BlockStored(
        [to_event_int(d) for d in digests], None, tokens, B, medium="GPU", extra_keys=published
    )


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
@pytest.mark.parametrize(("engine", "config"), [("0.34.0", "0.28.0"), ("0.28.0", "0.34.0")])
@pytest.mark.parametrize("image_block", [1, 0])
def test_a_mismatch_first_seen_on_a_later_block_names_the_rule(
    engine: str, config: str, algo: str, image_block: int
) -> None:
    metrics = IngestMetrics()
    checker = HashChecker(
        "10.0.0.1", HashSettings.from_strings(algo, "0", config), 10_000, metrics=metrics
    )
    event = _engine_event(engine, algo, image_block)
    checker.offer([event])
    assert checker.verdict == MISMATCH and checker.mismatch == 1
    # with the image on block 1, block 0 verified: the first mismatch really is block 1
    assert (event.block_hashes[0] in checker.verified) is (image_block == 1)
    assert checker.hint is not None
    assert (checker.hint.seed, checker.hint.algo, checker.hint.rule) == ("0", algo, RULE_OF[engine])
    rule_text = (
        "tagged extra keys (vLLM >= 0.31)"
        if RULE_OF[engine] == TAGGED
        else "untagged extra keys (vLLM 0.12-0.30)"
    )
    assert checker.detail == (
        f"the engine hashes with pythonHashSeed '0', {algo} and {rule_text}; the config "
        f"says vllmVersion {config} ({RULE_OF[config]} extra keys)"
    )
    assert value_of(metrics.hash_check_hints, seed="0", algo=algo, extra_keys=RULE_OF[engine]) == 1


def test_a_later_block_that_no_rule_explains_gets_no_hint() -> None:
    """The search on a later block tries only what the verified prefix leaves open (the
    extra-key rule), on that block: an image hashed at another offset than the event says
    matches neither rule, and no rule may be named (block 0 would match under either)."""
    event = _engine_event("0.28.0", "sha256_cbor", 1)
    event.extra_keys = [None, [[IMAGE[0], IMAGE[1] + 1]]]  # published with another offset
    checker = HashChecker(
        "10.0.0.1", HashSettings.from_strings("sha256_cbor", "0", "0.28.0"), 10_000
    )
    checker.offer([event])
    assert checker.verdict == MISMATCH and checker.hint is None
    assert checker.detail.startswith("no plausible setting reproduces the engine's hashes")
