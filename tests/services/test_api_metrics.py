"""Cross-worker metrics: per-pid snapshot files summed, dead workers' counts kept."""

from __future__ import annotations

from pathlib import Path

from services.api.api_metrics import ApiMetrics, SnapshotDir

PATH = "/kv-cache/hit-rate"


def _worker(shared: Path | None, requests: int) -> ApiMetrics:
    metrics = ApiMetrics(shared)
    for _ in range(requests):
        metrics.requests.inc(path=PATH, status="200")
        metrics.latency.observe(0.003, path=PATH)
    return metrics


def _line(text: str, prefix: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(prefix))


def test_scrape_sums_every_worker_file(tmp_path: Path) -> None:
    shared = SnapshotDir(tmp_path)
    shared.write(4242, _worker(None, 3).registry.snapshot())  # two sibling workers
    shared.write(4243, _worker(None, 5).registry.snapshot())
    text = _worker(tmp_path, 1).render()  # this worker's own count is written on scrape
    assert _line(text, "cache_indexer_api_requests_total{") == (
        f'cache_indexer_api_requests_total{{path="{PATH}",status="200"}} 9')
    assert _line(text, "cache_indexer_api_request_duration_seconds_count").endswith(" 9")
    assert len(list(tmp_path.glob("worker-*.json"))) == 3


def test_a_retired_worker_keeps_its_counts_and_its_pid_can_be_reused(tmp_path: Path) -> None:
    shared = SnapshotDir(tmp_path)
    shared.write(100, _worker(None, 2).registry.snapshot())
    shared.write(101, _worker(None, 1).registry.snapshot())
    shared.retire(100)
    shared.retire(101)
    assert sorted(p.name for p in tmp_path.glob("worker-*.json")) == []
    shared.write(100, _worker(None, 4).registry.snapshot())  # a new worker, same pid
    text = ApiMetrics(tmp_path).render()
    assert _line(text, "cache_indexer_api_requests_total{").endswith(" 7")


def test_unreadable_snapshot_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "worker-7.json").write_bytes(b"{not json")
    text = _worker(tmp_path, 2).render()
    assert _line(text, "cache_indexer_api_requests_total{").endswith(" 2")


def test_without_a_shared_dir_a_worker_renders_its_own_registry() -> None:
    metrics = _worker(None, 0)
    metrics.hashed_blocks.inc(5)
    assert "cache_indexer_api_hashed_blocks_total 5" in metrics.render()
