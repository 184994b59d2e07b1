"""The config file: the original schema accepted unchanged, defaults, strict validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config, parse_duration, parse_listen_addr
from common.errors import ConfigError

ORIGINAL = """
http:
  addr: ":28080"
  shutdownTimeout: 10s
  readHeaderTimeout: 10s
  readTimeout: 30s
  writeTimeout: 30s
  idleTimeout: 120s
  maxHeaderBytes: 1048576
  maxHitRateBodyBytes: 4194304
log:
  level: info
blockKey:
  pythonHashSeed: "0"
  prefixCachingHashAlgo: sha256_cbor
  useIntBlockHashes: true
discovery:
  refreshInterval: 10s
  segmentsFetchTimeout: 2s
  labels:
    engineKey: openfuyao.com/engine
    engineValue: vllm
    pdRoleKey: openfuyao.com/pdRole
    pdRoleValue: [prefill, aggregate]
    kvManagerKey: openfuyao.com/kvmanager
    kvManagerValue: mooncake
  vllm:
    zmqPortName: zmq-pub
  mooncakeMaster:
    httpPortName: http
    rpcPortName: rpc
    httpPort: 9003
    rpcPort: 0
ingest:
  l1:
    backoffInitial: 1s
    backoffMax: 30s
  l3:
    scheme: http
    pollInterval: 10s
    httpTimeout: 5s
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_original_operator_file_is_accepted_unchanged(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, ORIGINAL), env={})
    assert cfg.http.max_hit_rate_body_bytes == 4194304
    assert cfg.http.idle_timeout == 120.0
    assert cfg.discovery.labels.pd_role_value == ["prefill", "aggregate"]
    assert cfg.discovery.mooncake_master.http_port == 9003
    assert cfg.ingest.l3.poll_interval == 10.0
    assert cfg.block_key.python_hash_seed == "0"


def test_defaults_for_every_key_and_env_overrides(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        env={
            "CACHE_INDEXER_REDIS_URL": "redis://127.0.0.1:7000/1",
            "POD_NAMESPACE": "inference",
            "LOG_LEVEL": "DEBUG",
        },
    )
    assert cfg.redis.url == "redis://127.0.0.1:7000/1"
    assert cfg.discovery.namespace == "inference"
    assert cfg.log.level == "debug"
    assert cfg.http.addr == ":28080" and cfg.block_key.vllm_version == "0.28.0"
    assert cfg.discovery.labels.pd_role_value == ["prefill", "aggregate"]
    fresh = load_config(None, env={})
    assert fresh.discovery.labels.pd_role_value is not cfg.discovery.labels.pd_role_value


def test_all_problems_are_reported_with_key_names(tmp_path: Path) -> None:
    bad = (
        "http:\n  bogus: 1\n  readTimeout: 10x\n  maxHeaderBytes: '12'\n"
        "ingest:\n  l3: {scope: foo}\nfoo: 1\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, bad), env={})
    text = str(err.value)
    for part in (
        "http.bogus: unknown key",
        "http.readTimeout",
        "http.maxHeaderBytes",
        "ingest.l3.scope",
        "foo: unknown key",
    ):
        assert part in text


@pytest.mark.parametrize(
    "block_key, problem",
    [
        ("{hashLookaheadTokens: -1}", "must be 0 (none) to 64 tokens, got -1"),
        ("{hashLookaheadTokens: 65}", "must be 0 (none) to 64 tokens, got 65"),
        ("{hashLookaheadTokens: 1}", "vLLM hashes lookahead tokens from 0.33 on"),
        ("{hashLookaheadTokens: 2, vllmVersion: 0.32.0}", "from 0.33 on"),
    ],
)
def test_a_lookahead_outside_its_range_or_release_is_refused(
    tmp_path: Path, block_key: str, problem: str
) -> None:
    with pytest.raises(ConfigError, match=r"blockKey\.hashLookaheadTokens: ") as err:
        load_config(_write(tmp_path, f"blockKey: {block_key}\n"), env={})
    assert problem in str(err.value)
    text = "blockKey: {hashLookaheadTokens: 3, vllmVersion: 0.33.0}\n"
    assert load_config(_write(tmp_path, text), env={}).block_key.hash_lookahead_tokens == 3


def test_null_seed_means_unset_and_static_entries_parse(tmp_path: Path) -> None:
    text = (
        "blockKey:\n  pythonHashSeed: null\ndiscovery:\n  mode: static\n  static:\n"
        "    vllm:\n      - ip: 127.0.0.2\n        zmqEndpoint: tcp://127.0.0.2:5557\n"
        "    mooncakeMasters:\n      - url: http://127.0.0.1:9003\n"
    )
    cfg = load_config(_write(tmp_path, text), env={})
    assert cfg.block_key.python_hash_seed is None
    assert cfg.discovery.static.vllm[0].zmq_endpoint == "tcp://127.0.0.2:5557"
    assert cfg.discovery.static.mooncake_masters[0].url == "http://127.0.0.1:9003"


def test_unreadable_or_non_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "http: [unclosed"), env={})
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(_write(tmp_path, "- 1\n"), env={})


@pytest.mark.parametrize(
    "text,seconds",
    [("10s", 10), ("1m30s", 90), ("500ms", 0.5), ("1h", 3600), ("0", 0), ("1.5s", 1.5)],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "s", "-1s", "10 s", "1d"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_listen_addr() -> None:
    assert parse_listen_addr(":28080") == ("0.0.0.0", 28080)
    assert parse_listen_addr("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_listen_addr("[::1]:8080") == ("::1", 8080)
    with pytest.raises(ConfigError):
        parse_listen_addr("nope")


@pytest.mark.parametrize(
    "literal,seed",
    [("010", "010"), ("0", "0"), ('"0"', "0"), ("1e3", "1e3"), ("0x1F", "0x1F"), ("null", None)],
)
def test_hash_seed_is_the_text_as_written(tmp_path: Path, literal: str, seed: str | None) -> None:
    """vLLM hashes PYTHONHASHSEED as a string: YAML must not turn 010 into 8."""
    cfg = load_config(_write(tmp_path, f"blockKey:\n  pythonHashSeed: {literal}\n"), env={})
    assert cfg.block_key.python_hash_seed == seed


def test_heartbeat_must_fit_the_lease(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ingest.l1.heartbeatInterval"):
        load_config(
            _write(tmp_path, "ingest:\n  l1: {leaseTTL: 2s, heartbeatInterval: 2s}\n"), env={}
        )


def test_l3_key_formats_and_model_pins(tmp_path: Path) -> None:
    cfg = load_config(None)
    assert cfg.ingest.l3.key_formats == ["vllm", "vllm-ascend"] and cfg.ingest.l3.models == []
    path = tmp_path / "c.yaml"
    path.write_text(
        "ingest:\n  l3:\n    keyFormats: [vllm-ascend]\n    models:\n"
        "      - {name: Qwen/Qwen2.5-7B-Instruct, heads: 2, ppRanks: 2}\n"
        "      - {name: Qwen2.5-0.5B-Instruct, layers: 24}\n"
    )
    l3 = load_config(path).ingest.l3
    assert l3.key_formats == ["vllm-ascend"]
    assert [(m.name, m.heads, m.pp_ranks, m.layers) for m in l3.models] == [
        ("Qwen/Qwen2.5-7B-Instruct", 2, 2, 0),
        ("Qwen2.5-0.5B-Instruct", 0, 0, 24),
    ]
    path.write_text(
        "ingest:\n  l3:\n    keyFormats: [lmcache]\n    models:\n"
        "      - {name: a/Qwen, heads: -1}\n      - {name: Qwen}\n      - {heads: 2}\n"
        "      - {name: x, tp: 2}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    for part in (
        "ingest.l3.keyFormats[0]: 'lmcache'",
        "ingest.l3.models[0].heads: must be >= 0",
        "ingest.l3.models[1].name: 'Qwen' is pinned twice",
        "ingest.l3.models[2].name: must be",
        "ingest.l3.models[3].tp: unknown key",
    ):
        assert part in str(err.value)
    path.write_text("ingest:\n  l3:\n    keyFormats: []\n")
    with pytest.raises(ConfigError, match="keyFormats: must name at least one"):
        load_config(path)
