"""A master's poll status as the poller reports it: the ``ci:master:{<url>}:state`` hash and
the "keys in no known family" and "keys in unmappable KV-cache groups" gauges and log lines
(never a silent zero)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.l3_poller.index import PollStats
from services.l3_poller.metrics import PollerMetrics
from services.l3_poller.writer import MasterView

logger = logging.getLogger(__name__)

STATE_FIELDS = (
    "keys",
    "keys_unparsed",
    "sample_unparsed",
    "keys_unmappable_group",
    "blocks",
    "updated_ms",
    "stale",
    "error",
)
"""``ci:master:{url}:state``: keys listed and unparsed in the last complete poll, one
unparsed key (≤ 200 chars), keys parsed but in KV-cache groups whose hashes are not vLLM
block hashes (indexed nowhere), complete blocks indexed, last successful poll (ms since
epoch, "" before the first), stale ("1" once dropped after staleAfter), last poll error
("")."""
SAMPLE_CHARS = 200
ERROR_CHARS = 500


def master_state(stats: PollStats | None, view: MasterView | None, error: str) -> dict[str, str]:
    """The status hash from the last complete poll's stats, the current view, the error."""
    sample = stats.sample_unparsed.decode("utf-8", "replace") if stats else ""
    return {
        "keys": str(stats.seen if stats else 0),
        "keys_unparsed": str(stats.skipped["unparsed"] if stats else 0),
        "sample_unparsed": sample[:SAMPLE_CHARS],
        "keys_unmappable_group": str(stats.unmappable_group if stats else 0),
        "blocks": str(view.blocks.complete if view else 0),
        "updated_ms": str(view.polled_ms) if view and stats else "",
        "stale": "1" if view and view.stale else "0",
        "error": error[:ERROR_CHARS],
    }


def note_unparsed(
    url: str, before: int, stats: PollStats, formats: Sequence[str], metrics: PollerMetrics
) -> None:
    """Set the gauge; log once (WARNING, with a sample) when unparsed keys appear, once
    (INFO) when they are gone."""
    now = stats.skipped["unparsed"]
    metrics.keys_unparsed.set(now, master=url)
    if now and not before:
        logger.warning(
            "master %s: %d of %d keys are in no known key family (ingest.l3.keyFormats: %s);"
            " e.g. %r",
            url,
            now,
            stats.seen,
            ",".join(formats),
            stats.sample_unparsed[:SAMPLE_CHARS].decode("utf-8", "replace"),
        )
    elif before and not now:
        logger.info("master %s: every key is in a known key family again", url)


def note_unmappable(url: str, before: int, stats: PollStats, metrics: PollerMetrics) -> None:
    """Set the gauge; log once (WARNING, naming the groups) when keys of unmappable groups
    appear, once (INFO) when they are gone."""
    now = stats.unmappable_group
    metrics.keys_unmappable_group.set(now, master=url)
    if now and not before:
        groups = ", ".join(f"{model} group {group}" for model, group in stats.unmappable[:8])
        logger.warning(
            "master %s: %d keys are in KV-cache groups that share no block hash with the other"
            " groups of their model (%s): their hashes are not vLLM block hashes (vllm-ascend"
            " v0.21-v0.24 rehash grouped blocks); those groups stay out of L3",
            url,
            now,
            groups,
        )
    elif before and not now:
        logger.info("master %s: no KV-cache group is unmappable any more", url)
