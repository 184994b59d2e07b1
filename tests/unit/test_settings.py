"""The config file translated into per-service settings: every key lands where it belongs."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.blockhash import HashSettings
from common.config import Audit, Config, Duration, L3Model, load_config
from common.errors import ConfigError
from common.status_report import Limits
from common.settings import (
    ApiSettings,
    DiscoverySettings,
    L1IngestSettings,
    L3PollerSettings,
    ProcessSettings,
)

# Every key of the original (Go) schema with a non-default value, plus this project's keys.
FULL = """
audit:
  enabled: false
  ttl: 2m
  maxRecordsPerSecond: 50
  queueSize: 70
  raceWindow: 5s
  maxReportBytes: 999
  recent: 7
  worstInstances: 8
http:
  addr: "127.0.0.1:18080"
  shutdownTimeout: 11s
  readHeaderTimeout: 12s
  readTimeout: 31s
  writeTimeout: 32s
  idleTimeout: 121s
  maxHeaderBytes: 65536
  maxHitRateBodyBytes: 1000000
  maxCandidates: 64
  workers: 3
  threads: 5
log:
  level: debug
  format: json
blockKey:
  pythonHashSeed: "42"
  prefixCachingHashAlgo: sha256
  useIntBlockHashes: false
  vllmVersion: 0.18.0
redis:
  url: redis://127.0.0.1:7777/3
metrics:
  port: 9100
  addr: 0.0.0.0
  livenessTimeout: 45s
discovery:
  mode: static
  namespace: team-a
  kubeconfig: /k/config
  refreshInterval: 7s
  segmentsFetchTimeout: 1500ms
  leaseTTL: 20s
  labels:
    engineKey: e.io/engine
    engineValue: vllm2
    pdRoleKey: e.io/role
    pdRoleValue: [prefill]
    kvManagerKey: e.io/kv
    kvManagerValue: mc
  vllm:
    zmqPortName: zmq
    zmqPort: 6000
    dataParallelSize: 2
  mooncakeMaster:
    httpPortName: web
    rpcPortName: grpc
    httpPort: 9004
    rpcPort: 50051
  static:
    vllm:
      - ip: 10.0.0.1
        zmqEndpoint: tcp://10.0.0.1:5557
    mooncakeMasters:
      - url: http://10.0.0.9:9003
ingest:
  l1:
    backoffInitial: 2s
    backoffMax: 40s
    topic: kv
    onUnrecoverableGap: clear
    shardMode: static
    leaseTTL: 8s
    heartbeatInterval: 2s
    replayTimeout: 6s
    hashCheckRate: 7
    noEventsAfter: 45s
  l3:
    scheme: https
    pollInterval: 4s
    httpTimeout: 3s
    scope: pool
    staleAfter: 90s
    batchSize: 50
    keyFormats: [vllm]
    models:
      - name: org/Qwen
        heads: 2
"""


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    path = tmp_path_factory.mktemp("settings") / "config.yaml"
    path.write_text(FULL, encoding="utf-8")
    return load_config(path, env={})


def test_defaults_agree_with_the_config_defaults() -> None:
    """A settings class's own defaults (used by tests and benchmarks) are the file's."""
    assert L1IngestSettings.from_config(Config()) == L1IngestSettings()
    assert L3PollerSettings.from_config(Config()) == L3PollerSettings()
    assert ApiSettings.from_config(Config()) == ApiSettings()


def test_process_settings(cfg: Config) -> None:
    p = ProcessSettings.from_config(cfg)
    assert (p.log_level, p.log_format) == ("debug", "json")
    assert (p.metrics_addr, p.metrics_port, p.liveness_timeout) == ("0.0.0.0", 9100, 45.0)
    assert p.redis.url == "redis://127.0.0.1:7777/3"
    assert ProcessSettings.from_config(cfg, metrics_port=0).metrics_port == 0  # --metrics-port


def test_discovery_settings_take_the_original_cross_section_keys(cfg: Config) -> None:
    d = DiscoverySettings.from_config(cfg)
    assert (d.mode, d.namespace, d.kubeconfig) == ("static", "team-a", "/k/config")
    assert (d.refresh_interval, d.lease_ttl) == (7.0, 20.0)
    assert (d.labels.engine_key, d.labels.engine_value, d.labels.pd_role_value) == (
        "e.io/engine",
        "vllm2",
        ["prefill"],
    )
    assert (d.labels.kv_manager_key, d.labels.kv_manager_value) == ("e.io/kv", "mc")
    assert (d.vllm.zmq_port_name, d.vllm.zmq_port, d.vllm.data_parallel_size) == ("zmq", 6000, 2)
    mm = d.mooncake_master
    assert (mm.http_port_name, mm.rpc_port_name, mm.http_port, mm.rpc_port) == (
        "web",
        "grpc",
        9004,
        50051,
    )
    assert d.static.vllm[0].ip == "10.0.0.1"
    assert d.static.mooncake_masters[0].url == "http://10.0.0.9:9003"
    # the Go original's meanings: ingest.l1.backoff* is every watcher's reconnect backoff,
    # ingest.l3.scheme the scheme of the master URLs discovery publishes
    assert (d.backoff_initial, d.backoff_max) == (2.0, 40.0)
    assert d.master_scheme == "https"


def test_l1_ingest_settings(cfg: Config) -> None:
    assert L1IngestSettings.from_config(cfg) == L1IngestSettings(
        topic="kv",
        on_unrecoverable_gap="clear",
        shard_mode="static",
        lease_ttl=8.0,
        heartbeat_interval=2.0,
        replay_timeout=6.0,
        backoff_initial=2.0,
        backoff_max=40.0,
        hash_check_rate=7,
        hash=HashSettings(algo="sha256", seed="42", vllm_version=(0, 18, 0)),
    )


def test_l3_poller_settings_take_the_segment_query_timeout(cfg: Config) -> None:
    assert L3PollerSettings.from_config(cfg) == L3PollerSettings(
        scheme="https",
        poll_interval=4.0,
        http_timeout=3.0,
        segments_timeout=1.5,  # discovery.segmentsFetchTimeout in the original
        scope="pool",
        stale_after=90.0,
        batch_size=50,
        key_formats=("vllm",),
        models=(L3Model(name="org/Qwen", heads=2),),
    )


def test_api_settings(cfg: Config) -> None:
    assert ApiSettings.from_config(cfg) == ApiSettings(
        addr="127.0.0.1:18080",
        workers=3,
        threads=5,
        shutdown_timeout=11.0,
        read_header_timeout=12.0,
        read_timeout=31.0,
        write_timeout=32.0,
        idle_timeout=121.0,
        max_header_bytes=65536,
        max_hit_rate_body_bytes=1000000,
        max_candidates=64,
        hash=HashSettings(algo="sha256", seed="42", vllm_version=(0, 18, 0)),
        instance_limits=Limits(no_events_after=45.0, lease_ttl=8.0, vllm_version=(0, 18, 0)),
        log_level="debug",
        audit=Audit(
            enabled=False,
            ttl=Duration(120),
            max_records_per_second=50,
            queue_size=70,
            race_window=Duration(5),
            max_report_bytes=999,
            recent=7,
            worst_instances=8,
        ),
    )


def test_an_unusable_block_key_is_refused_at_the_edge(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("blockKey:\n  vllmVersion: not-a-version\n", encoding="utf-8")
    cfg = load_config(path, env={})
    for settings in (ApiSettings, L1IngestSettings):
        with pytest.raises(ConfigError, match="not-a-version"):
            settings.from_config(cfg)


def test_settings_are_frozen() -> None:
    with pytest.raises(AttributeError):
        L1IngestSettings().topic = "x"  # type: ignore[misc]


def test_hybrid_settings_per_model(tmp_path: Path) -> None:
    """``ingest.l1.models`` overrides the unit and chunk size for the instances of a model,
    matched as written or by basename; others get the defaults."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "ingest:\n  l1:\n    prefixMatchUnit: 32\n    models:\n"
        "      - {name: Qwen/Qwen3.5-4B, prefixMatchUnit: 16}\n"
        "      - {name: llama4, attentionChunkSize: 8192}\n"
    )
    s = L1IngestSettings.from_config(load_config(path))
    assert s.hybrid_settings("Qwen/Qwen3.5-4B") == (16, 0)
    assert s.hybrid_settings("/models/Qwen3.5-4B") == (16, 0)
    assert s.hybrid_settings("llama4") == (32, 8192)
    assert s.hybrid_settings("") == s.hybrid_settings("other") == (32, 0)


def test_hybrid_settings_are_validated(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "ingest:\n  l1:\n    attentionChunkSize: -1\n    models:\n"
        "      - {name: m, prefixMatchUnit: -16}\n      - {name: m}\n"
        "      - {prefixMatchUnit: 16}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    for problem in (
        "ingest.l1.attentionChunkSize",
        "ingest.l1.models[0].prefixMatchUnit",
        "ingest.l1.models[1].name: 'm' is listed twice",
        "ingest.l1.models[2].name",
    ):
        assert problem in text, text
