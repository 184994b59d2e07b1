"""RequestFrame: where a request ends in a growing buffer, fed byte by byte or all at once."""

from __future__ import annotations

import pytest

from services.api.transport.request_frame import RequestFrame

HEAD = b"POST /kv-cache/hit-rate?x=1 HTTP/1.1\r\nHost: a\r\n"


def _feed_bytewise(
    data: bytes, header_cap: int = 8192, body_cap: int = 100
) -> tuple[RequestFrame, int]:
    """Feed one byte at a time; return the frame and the length at which it completed."""
    frame = RequestFrame(header_cap, body_cap)
    for i in range(1, len(data) + 1):
        if frame.feed(data[:i]):
            return frame, i
    return frame, -1


def test_content_length_body_completes_exactly_at_its_end() -> None:
    data = HEAD + b"Content-Length: 5\r\n\r\nhello"
    frame, at = _feed_bytewise(data + b"GET / HTTP/1.1\r\n")
    assert at == len(data) and frame.body_buffered
    assert (frame.method, frame.path) == ("POST", "/kv-cache/hit-rate")


def test_no_body_completes_at_the_empty_line_after_leading_empty_lines() -> None:
    data = b"\r\n\r\nGET /healthz HTTP/1.1\r\nHost: a\r\n\r\n"
    frame, at = _feed_bytewise(data)
    assert at == len(data) and frame.path == "/healthz"


def test_chunked_body_completes_after_the_last_chunk_and_trailers() -> None:
    body = b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    data = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + body
    assert _feed_bytewise(data)[1] == len(data)
    with_trailer = HEAD + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n"
    assert _feed_bytewise(with_trailer)[1] == len(with_trailer)


def test_bodies_over_the_cap_are_not_buffered() -> None:
    frame, at = _feed_bytewise(HEAD + b"Content-Length: 101\r\n\r\n" + b"x" * 101)
    head_len = len(HEAD + b"Content-Length: 101\r\n\r\n")
    assert at == head_len and not frame.body_buffered
    chunked = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"40\r\n" + b"y" * 64 + b"\r\n"
    chunked += b"40\r\n" + b"y" * 64 + b"\r\n0\r\n\r\n"
    frame, at = _feed_bytewise(chunked)
    # complete once more than the cap of decoded bytes is held, not before
    assert not frame.body_buffered and 0 < at < len(chunked)
    assert chunked[:at].count(b"y") == 101


@pytest.mark.parametrize(
    "headers",
    [
        b"Content-Length: 5\r\nContent-Length: 6\r\n",
        b"Content-Length: x\r\n",
        b"Transfer-Encoding: gzip\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    ],
)
def test_unframeable_requests_are_handed_over_at_the_end_of_the_headers(headers: bytes) -> None:
    data = HEAD + headers + b"\r\n"
    assert _feed_bytewise(data + b"more")[1] == len(data)


def test_a_header_block_over_the_cap_is_handed_over() -> None:
    frame, at = _feed_bytewise(HEAD + b"X: " + b"a" * 200, header_cap=100)
    assert at == 101 and not frame.headers_done


def test_bad_chunk_size_is_handed_over() -> None:
    data = HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"
    assert _feed_bytewise(data)[1] == len(data)


def test_expect_continue_is_seen() -> None:
    frame = RequestFrame(8192, 100)
    assert not frame.feed(HEAD + b"Expect: 100-continue\r\nContent-Length: 3\r\n\r\n")
    assert frame.headers_done and frame.expect_continue
