"""Where one HTTP/1.x request ends in a growing byte buffer, without parsing it for real.

The worker (:mod:`services.api.transport.worker`) reads every request whole in its selector
thread before a pool thread sees it, so it must know when "whole" is reached: the header
block (up to the empty line), then ``Content-Length`` bytes or a chunked body up to its
last chunk and trailers. :class:`RequestFrame` answers that incrementally as bytes arrive.
It does not validate: anything it cannot frame (a bad length, conflicting lengths, an
unknown transfer coding, a header block over the cap) is handed over at once, and
gunicorn's own parser then answers it (400, 431, 501). Bodies over ``body_cap`` are not
buffered: the frame completes with :attr:`RequestFrame.body_buffered` false after the
headers (``Content-Length`` over the cap, so the app can refuse it unread), or once more
than ``body_cap`` decoded bytes of a chunked body are held.
"""

from __future__ import annotations

_CRLF = b"\r\n"
_END = b"\r\n\r\n"
_MAX_CHUNK_LINE = 4096


class RequestFrame:
    """Incremental framing of one request at the start of a buffer (see the module doc)."""

    def __init__(self, header_cap: int, body_cap: int) -> None:
        self.header_cap, self.body_cap = header_cap, body_cap
        self.header_end = -1  # offset just past the empty line, once seen
        self.method = self.path = ""
        self.expect_continue = False
        self.complete = False
        self.body_buffered = True
        self._length = 0  # Content-Length, when not chunked
        self._chunked = False
        self._pos = 0  # chunked: offset of the next chunk-size line
        self._decoded = 0  # chunked: body bytes held so far

    @property
    def headers_done(self) -> bool:
        return self.header_end >= 0

    def feed(self, buf: bytes | bytearray) -> bool:
        """Look at the buffer (the whole request so far); True once it can be dispatched."""
        if self.complete:
            return True
        if not self.headers_done and not self._find_headers(buf):
            return self.complete
        if self._chunked:
            self._scan_chunks(buf)
        elif len(buf) - self.header_end >= self._length:
            self.complete = True
        return self.complete

    def _find_headers(self, buf: bytes | bytearray) -> bool:
        start = 0
        while buf[start : start + 2] == _CRLF:  # empty lines before a request are ignored
            start += 2
        end = buf.find(_END, start)
        if end < 0:
            if not self.method and (eol := buf.find(_CRLF, start)) > 0:
                self._read_request_line(bytes(buf[start:eol]))  # for a 408's body shape
            if len(buf) > self.header_cap:
                self.complete = True  # gunicorn refuses it (431)
            return False
        self.header_end = end + 4
        self._read_headers(bytes(buf[start:end]))
        return True

    def _read_headers(self, block: bytes) -> None:
        request_line, *lines = block.split(_CRLF)
        self._read_request_line(request_line)
        lengths: set[bytes] = set()
        codings: list[bytes] = []
        for line in lines:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                lengths.update(v.strip() for v in value.split(b","))
            elif name == b"transfer-encoding":
                codings += [c.strip().lower() for c in value.split(b",")]
            elif name == b"expect":
                self.expect_continue = value.strip().lower() == b"100-continue"
        if codings:
            if lengths or codings[-1] != b"chunked":
                self.complete = True  # for gunicorn to refuse
            self._chunked, self._pos = True, self.header_end
            return
        if len(lengths) > 1 or (lengths and not next(iter(lengths)).isdigit()):
            self.complete = True
            return
        self._length = int(next(iter(lengths))) if lengths else 0
        if self._length > self.body_cap:
            self.complete, self.body_buffered, self._length = True, False, 0

    def _read_request_line(self, line: bytes) -> None:
        parts = line.split(b" ")
        if len(parts) == 3:
            self.method = parts[0].decode("latin-1")
            self.path = parts[1].split(b"?", 1)[0].decode("latin-1")

    def _scan_chunks(self, buf: bytes | bytearray) -> None:
        while not self.complete:
            eol = buf.find(_CRLF, self._pos)
            if eol < 0:
                if len(buf) - self._pos > _MAX_CHUNK_LINE:
                    self.complete = True
                return
            try:
                size = int(bytes(buf[self._pos : eol]).split(b";", 1)[0].strip(), 16)
            except ValueError:
                self.complete = True
                return
            if size == 0:
                self._scan_trailers(buf, eol + 2)
                return
            held = min(size, len(buf) - eol - 2)
            if self._decoded + held > self.body_cap:
                self.complete, self.body_buffered = True, False
                return
            if len(buf) < eol + 2 + size + 2:
                return
            self._decoded += size
            self._pos = eol + 2 + size + 2

    def _scan_trailers(self, buf: bytes | bytearray, start: int) -> None:
        if buf[start : start + 2] == _CRLF:
            self.complete = True
        elif buf.find(_END, start) >= 0 or len(buf) - start > self.header_cap:
            self.complete = True
