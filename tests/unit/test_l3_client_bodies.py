"""Master response parsing, on bodies captured from real masters 0.3.10.post2 and 0.3.13.post1
(tests/data/mooncake/queries-*.json, written by scripts/capture_mooncake_queries.py)."""

from __future__ import annotations

import json
import tracemalloc
from collections import Counter
from typing import Any

import pytest

from services.l3_poller.client import (
    Churn,
    parse_removals,
    MasterError,
    parse_batch_body,
    split_lines,
    parse_query_key_body,
    parse_segments_body,
    parse_segments_detail,
)
from services.l3_poller.index import SegmentMap
from tests.conftest import DATA


def _capture(version: str) -> dict[str, Any]:
    return json.loads((DATA / "mooncake" / f"queries-{version}.json").read_text())  # type: ignore[no-any-return]


def _body(entry: dict[str, Any]) -> bytes:
    return str(entry["body"]).encode()


OLD, NEW = _capture("0.3.10.post2"), _capture("0.3.13.post1")


def test_old_query_key_is_text_lines() -> None:
    hit = OLD["query_key_hit"]
    assert hit["content_type"].startswith("text/plain")
    assert _body(hit).endswith(b"\n")  # one JSON object per line, not an envelope
    replicas = parse_query_key_body(hit["status"], _body(hit))
    assert replicas is not None and len(replicas) == 1
    assert replicas[0].startswith("127.0.0.2:")
    assert parse_query_key_body(404, _body(OLD["query_key_miss"])) is None


def test_new_query_key_is_a_json_envelope() -> None:
    hit = NEW["query_key_hit"]
    assert hit["content_type"].startswith("application/json")
    replicas = parse_query_key_body(hit["status"], _body(hit))
    assert replicas is not None and len(replicas) == 1 and replicas[0].startswith("127.0.0.2:")
    assert parse_query_key_body(404, _body(NEW["query_key_miss"])) is None


@pytest.mark.parametrize("capture", [OLD, NEW], ids=["0.3.10", "0.3.13"])
def test_percent_encoded_keys_miss_on_query_key(capture: dict[str, Any]) -> None:
    """Why the client never encodes: the master compares the parameter undecoded."""
    assert capture["query_key_encoded"]["status"] == 404


def test_old_query_key_with_several_replicas_and_with_none() -> None:
    body = (
        b'{"size_":4096,"buffer_address_":1,"protocol_":"tcp","transport_endpoint_":"a:1"}\n'
        b'{"size_":4096,"buffer_address_":2,"protocol_":"tcp","transport_endpoint_":"b:2"}\n'
    )
    assert parse_query_key_body(200, body) == ("a:1", "b:2")
    assert parse_query_key_body(200, b"") == ()


def test_query_key_garbage_and_errors() -> None:
    with pytest.raises(MasterError) as exc:
        parse_query_key_body(200, b"<html>oops</html>")
    assert exc.value.reason == "garbage"
    with pytest.raises(MasterError) as exc:
        parse_query_key_body(503, b'{"success":false,"error_code":-1011}')
    assert exc.value.reason == "status_503"


@pytest.mark.parametrize("capture", [OLD, NEW], ids=["0.3.10", "0.3.13"])
def test_batch_query_keys_both_versions(capture: dict[str, Any]) -> None:
    keys = capture["keys"]
    found = parse_batch_body(_body(capture["batch_query_keys"]))
    assert set(found) == {keys[0], keys[2], "no_such_key"}
    assert found["no_such_key"] is None
    ep = found[keys[0]]
    assert ep is not None and len(ep) == 1 and ep[0].startswith("127.0.0.2:")


def test_batch_query_keys_decoding_differs_between_versions() -> None:
    """0.3.10 keeps %40 in the key (a miss); 0.3.13 URL-decodes it (a hit)."""
    old = parse_batch_body(_body(OLD["batch_query_keys_encoded"]))
    new = parse_batch_body(_body(NEW["batch_query_keys_encoded"]))
    assert list(old.values()) == [None] and "%40" in next(iter(old))
    assert list(new) == [NEW["keys"][0]] and new[NEW["keys"][0]]


def test_batch_disk_replicas_and_bad_bodies() -> None:
    body = json.dumps(
        {
            "success": True,
            "data": {
                "k": {
                    "ok": True,
                    "error": None,
                    "values": [],
                    "disk_values": [{"file_path": "/x"}],
                    "local_disk_values": [{"transport_endpoint": "10.0.0.7:1"}],
                    "nof_values": None,
                },
                "d": {"ok": True, "values": None, "disk_values": [{"file_path": "/y"}]},
            },
        }
    ).encode()
    assert parse_batch_body(body) == {"k": ("10.0.0.7:1",), "d": ()}
    for bad in (b"", b"[]", b"<html>", b'{"success":false,"error":"x"}', b'{"success":true}'):
        with pytest.raises(MasterError):
            parse_batch_body(bad)


def test_segments_and_detail_map_p2p_endpoints_to_pods() -> None:
    names = parse_segments_body(_body(NEW["get_all_segments"]))
    assert names == [NEW["segment_hostname"]]
    detail = parse_segments_detail(_body(NEW["get_segments_detail"]))
    ((endpoint, segment),) = detail.items()
    assert segment == names[0] and endpoint != segment  # P2PHANDSHAKE: another port
    seg = SegmentMap(names, detail)
    assert seg.ip_of(endpoint) == "127.0.0.2"
    assert seg.ip_of("127.0.0.2:1") is None  # exact table: an unknown port is not live
    replicas = parse_query_key_body(200, _body(NEW["query_key_hit"]))
    assert replicas == (endpoint,)


def test_old_master_has_no_detail_and_maps_by_host() -> None:
    assert OLD["get_segments_detail"]["status"] == 404
    names = parse_segments_body(_body(OLD["get_all_segments"]))
    seg = SegmentMap(names, None)
    replicas = parse_query_key_body(200, _body(OLD["query_key_hit"]))
    assert replicas is not None and seg.ip_of(replicas[0]) == "127.0.0.2"
    assert seg.ip_of("127.0.0.9:1") is None


def test_ipv6_segments() -> None:
    seg = SegmentMap(["[fd00::a]:12345"], {"[fd00:0::a]:15000": "[fd00::a]:12345"})
    assert seg.attached == {"fd00::a"}
    assert seg.ip_of("[fd00:0::a]:15000") == "fd00::a"
    old = SegmentMap(["[FD00::A]:12345"], None)
    assert old.ip_of("[fd00::a]:15999") == "fd00::a"


def test_captured_get_all_keys_bodies_are_newline_terminated() -> None:
    for capture in (OLD, NEW):
        body = _body(capture["get_all_keys"])
        assert body.endswith(b"\n") and body.count(b"\n") == len(set(capture["keys"]))


@pytest.mark.parametrize(
    "body",
    [
        b'{"success":true}',
        b'{"success":true,"data":null}',
        b'{"success":true,"data":{}}',
        b'{"success":true,"data":[1]}',
        b'{"success":true,"data":["a:1"]}',
        b'{"success":"yes"}',
        b'{"success":true,"data":[{"transport_endpoint_":"a:1"},null]}',
        b"[1,2]",
        b'"text"',
        b"42",
        b'{"transport_endpoint_":"a:1"}\n[]\n',
        b'{"a":1}\nnot json\n',
    ],
)
def test_malformed_query_key_bodies_are_garbage(body: bytes) -> None:
    with pytest.raises(MasterError) as exc:
        parse_query_key_body(200, body)
    assert exc.value.reason == "garbage"


@pytest.mark.parametrize(
    "body",
    [
        b'{"success":true,"data":null}',
        b'{"success":true,"data":[]}',
        b'{"success":1,"data":{}}',
        b'{"success":true,"data":{"k":null}}',
        b'{"success":true,"data":{"k":[1]}}',
        b'{"success":true,"data":{"k":{"ok":true,"values":[null]}}}',
        b'{"success":true,"data":{"k":{"ok":true,"values":{"a":1}}}}',
        b'{"success":true,"data":{"k":{"ok":true,"values":[],"local_disk_values":"x"}}}',
        b"null",
        b'[{"success":true}]',
    ],
)
def test_malformed_batch_bodies_are_garbage(body: bytes) -> None:
    with pytest.raises(MasterError) as exc:
        parse_batch_body(body)
    assert exc.value.reason == "garbage"


def test_null_or_non_string_endpoints_are_left_out() -> None:
    body = (
        b'{"success":true,"data":[{"transport_endpoint_":null},'
        b'{"transport_endpoint_":5},{"size_":1},{"transport_endpoint_":"a:1"}]}'
    )
    assert parse_query_key_body(200, body) == ("a:1",)
    assert parse_query_key_body(200, b'{"transport_endpoint_":null}\n') == ()
    batch = (
        b'{"success":true,"data":{"k":{"ok":true,"values":[{"transport_endpoint_":null}],'
        b'"local_disk_values":[{"transport_endpoint":"b:2"},{"transport_endpoint":[]}]},'
        b'"n":{"ok":true,"values":[{"transport_endpoint_":null}]}}}'
    )
    assert parse_batch_body(batch) == {"k": ("b:2",), "n": ()}
    assert parse_segments_detail(b'{"segments":[{"te_endpoint":null,"segment_name":"s"}]}') == {}


def _lines(chunks: list[bytes], max_line: int = 8) -> tuple[list[bytes], Counter[str]]:
    skipped: Counter[str] = Counter()
    return [x for lines in split_lines(chunks, skipped, max_line) for x in lines], skipped


def test_split_lines_across_chunks_and_overlong_lines() -> None:
    assert _lines([b"ab\ncd", b"ef\n", b"\n"]) == ([b"ab", b"cdef", b""], Counter())
    lines, skipped = _lines([b"ok\n0123", b"456789", b"AB\nfine\n0123456789ABC\nend\n"])
    assert lines == [b"ok", b"fine", b"end"] and skipped["too_long"] == 2
    with pytest.raises(MasterError) as exc:
        _lines([b"ok\n0123456789"])
    assert exc.value.reason == "truncated"


def test_a_body_without_newlines_is_streamed_in_bounded_memory() -> None:
    """64 MiB with no newline: before the cap this buffered (and re-copied) all of it."""
    chunk = b"k" * (1 << 16)
    skipped: Counter[str] = Counter()
    tracemalloc.start()
    try:
        out = [x for lines in split_lines([*(chunk,) * 1024, b"\nkey\n"], skipped) for x in lines]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out == [b"key"] and skipped["too_long"] == 1
    assert peak < 1 << 20, f"peak {peak} bytes"


def test_removals_sum_the_counters_of_keys_leaving_a_replica() -> None:
    """Names as a real 0.3.13.post1 master exposes them (probed with two store clients)."""
    body = (
        b"# TYPE master_remove_requests_total counter\n"
        b"master_remove_requests_total 3\n"
        b"master_remove_failures_total 7\n"
        b"master_put_start_requests_total 43\n"
        b"master_evicted_key_count 5\n"
        b"master_evicted_key_count_mem 5\n"
        b"master_successful_evictions_mem 2\n"
        b"master_evicted_size_bytes_mem 20480\n"
        b"master_attempted_evictions_mem 11\n"
        b"master_evicted_size_bytes 20480\n"
        b"master_attempted_evictions_total 11\n"
        b'master_successful_evictions_total{tenant="a"} 2\n'
        b"master_key_count 40\n"
    )
    assert parse_removals(body) == Churn(per_key=8, other=0)
    batch = b"master_evicted_key_count 1\nmaster_batch_remove_requests_total 4\n"
    assert parse_removals(batch) == Churn(per_key=1, other=4)
    assert parse_removals(b"master_key_count 40\n") is None
    assert parse_removals(b"master_drain_jobs_total 1\n") is None  # nothing per key
    assert parse_removals(b"") is None
