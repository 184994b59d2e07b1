"""vLLM MooncakeStoreConnector key parsing: every released format, junk, the u64 hash."""

from __future__ import annotations

import json

import pytest

from common.blockhash import BlockHasher, HashSettings
from services.l3_poller.keys_parser import (
    Namespace,
    hash_u64,
    host_of,
    is_url_safe,
    parse_prefix,
)
from tests.conftest import DATA
from tests.keys_oracle import ParsedKey, parse_any, parse_key, split_key

HEX = "15528b726efb88cb4d9efc583657a821bceb1f67307c6e813417567050a24fdc"
U64 = 3753563854825738204  # the demo's KV-event int of HEX (spec §4.1)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        # vLLM 0.21: no group
        (
            f"Qwen2.5-0.5B-Instruct@tp_rank:0@pcp0@dcp0@pp_rank:0@{HEX}",
            ParsedKey("Qwen2.5-0.5B-Instruct", 0, 0, 0, 0, 0, U64),
        ),
        # vLLM 0.22+: with group
        (
            f"Qwen2.5-0.5B-Instruct@tp_rank:3@pcp1@dcp2@pp_rank:1@group:2@{HEX}",
            ParsedKey("Qwen2.5-0.5B-Instruct", 3, 1, 2, 1, 2, U64),
        ),
        # a real log line from vLLM PR #46855
        (
            (
                "Kimi-K2.6-NVFP4@tp_rank:3@pcp0@dcp3@pp_rank:0@group:0@"
                "1453887b2877d08904910b50e5b094884bfa056d4dc462f9354ffeee4170933c"
            ),
            ParsedKey("Kimi-K2.6-NVFP4", 3, 0, 3, 0, 0, 0x9354FFEEE4170933C & (2**64 - 1)),
        ),
        # cache_prefix@ (0.26+), "auto" digest form of 0.34
        (
            f"auto-3f2a9c@Qwen2.5-0.5B-Instruct@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@{HEX}",
            ParsedKey("auto-3f2a9c@Qwen2.5-0.5B-Instruct", 1, 0, 0, 0, 0, U64),
        ),
        # 0.34 store namespace, both spellings
        (
            (
                f"Llama-3.1-8B@store_tp:4@store_pp:1@store_format:kv@store_schema:v1"
                f"@tp_rank:2@pcp0@dcp0@pp_rank:0@group:1@{HEX}"
            ),
            ParsedKey(
                "Llama-3.1-8B@store_tp:4@store_pp:1@store_format:kv@store_schema:v1",
                2,
                0,
                0,
                0,
                1,
                U64,
            ),
        ),
        (
            (
                f"pfx@Llama-3.1-8B@store_pp:1@store_format:rank_local_tp2_layout_nhd"
                f"@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HEX}"
            ),
            ParsedKey(
                "pfx@Llama-3.1-8B@store_pp:1@store_format:rank_local_tp2_layout_nhd",
                0,
                0,
                0,
                0,
                0,
                U64,
            ),
        ),
    ],
)
def test_parses_every_vllm_format(key: str, expected: ParsedKey) -> None:
    assert parse_key(key) == expected
    prefix, layer, u64 = split_key(key.encode())  # type: ignore[misc]
    assert u64 == expected.hash_u64 and layer == b""
    assert parse_prefix(prefix.decode()) == expected.namespace
    assert parse_any(key) == (expected.namespace, expected.hash_u64)


@pytest.mark.parametrize(
    "junk",
    [
        "",
        "hello",
        HEX,
        f"@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HEX}",  # no model
        f"Qwen@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HEX.upper()}",  # not BlockHash.hex()
        f"Qwen@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HEX[:15]}",  # too short for a u64
        f"Qwen@tp_rank:x@pcp0@dcp0@pp_rank:0@group:0@{HEX}",
        f"Qwen@tp_rank:0@pp_rank:0@group:0@{HEX}",  # forks' short form
        # LMCache: another connector sharing the master
        "Qwen2.5-0.5B-Instruct@1@0@3a9f1c2b@bfloat16",
        f"Qwen@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HEX[:-1]}g",
        f"Qwen@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@1_{HEX[2:]}",  # int() would accept _
    ],
)
def test_junk_is_not_a_key(junk: str) -> None:
    assert parse_key(junk) is None
    assert parse_any(junk) is None
    split = split_key(junk.encode())
    assert split is None or parse_prefix(split[0].decode(), split[1].decode()) is None


def test_hash_is_the_kv_event_int_of_the_projects_own_block_hashes() -> None:
    hasher = BlockHasher(HashSettings())
    tokens = list(range(64))
    digests = hasher.digests(tokens, 16)
    ints = hasher.event_ints(tokens, 16)
    for digest, expected in zip(digests, ints, strict=True):
        key = f"M@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{digest.hex()}"
        assert parse_key(key) == ParsedKey("M", 0, 0, 0, 0, 0, expected)
    assert hash_u64(HEX) == U64


def test_captured_keys_match_the_captured_event_ints() -> None:
    capture = json.loads((DATA / "mooncake" / "capture-0.3.13.post1-p2p.json").read_text())
    for key, entry in capture["index"].items():
        parsed = parse_key(key)
        assert parsed is not None
        assert parsed.hash_u64 == entry["event_int"]
        assert parsed.namespace == Namespace("Qwen2.5-0.5B-Instruct", 0, 0, 0, 0, 0)


def test_url_safety() -> None:
    assert is_url_safe(f"auto-1@Qwen2.5_x@tp_rank:0@pcp0@dcp0@pp_rank:0@{HEX}".encode())
    for bad in ("a b", "a,b", "a+b", "a%40b", "a&b", "a#b", 'a"b', "é"):
        assert not is_url_safe(bad.encode()), bad


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("10.0.0.5:12345", "10.0.0.5"),
        ("[fd00::1]:12345", "fd00::1"),
        ("fd00::1:12345", "fd00::1"),
        ("10.0.0.5:12345:npu_0", "10.0.0.5"),
        ("pod-a", "pod-a"),
    ],
)
def test_host_of(endpoint: str, host: str) -> None:
    assert host_of(endpoint) == host
