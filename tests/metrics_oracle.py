"""Reads of a process's metrics that only tests and benchmarks make: a test oracle, kept out
of ``common/metrics.py``, whose facade only records.

:func:`value_of`, :func:`count_of` and :func:`sum_of` read one series from the
prometheus_client metric behind a :class:`common.metrics.Counter`,
:class:`~common.metrics.Gauge` or :class:`~common.metrics.Histogram` (after flushing a buffered
registry), the way ``/metrics`` would show it in this process. A label left out is ``""``, as
when recording; a series never recorded reads 0 (and is not created by the read).
"""

from __future__ import annotations

from common.metrics import Counter, Gauge, Histogram


def value_of(metric: Counter | Gauge, **labels: str) -> float:
    """A counter's or gauge's current value in this process (0 if never recorded)."""
    return _read(metric, labels, "" if isinstance(metric, Gauge) else "_total")


def count_of(metric: Histogram, **labels: str) -> float:
    """A histogram's observations so far in this process."""
    return _read(metric, labels, "_count")


def sum_of(metric: Histogram, **labels: str) -> float:
    """The sum of a histogram's observations so far in this process."""
    return _read(metric, labels, "_sum")


def _read(metric: Counter | Gauge | Histogram, labels: dict[str, str], suffix: str) -> float:
    if metric._buffers is not None:
        metric._buffers.flush()
    wanted = {n: str(labels.get(n, "")) for n in metric.labels}
    for family in metric._metric.collect():
        for sample in family.samples:
            if sample.name == metric.name + suffix and sample.labels == wanted:
                return float(sample.value)
    return 0.0
