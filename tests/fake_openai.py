"""A fake vLLM OpenAI-compatible server for the audit prober's tests.

Serves ``GET /v1/models`` and ``POST /v1/completions`` with a token-id prompt. It keeps a
prefix cache of block hashes (vLLM's, from :class:`common.blockhash.BlockHasher`, salted with
the request's ``cache_salt``) and answers ``usage.prompt_tokens_details.cached_tokens`` by
vLLM's rule (the longest cached run of full blocks, at most ``len - 1`` tokens, block-aligned);
then it stores the prompt's full blocks and hands their event ints to ``publish`` — the test
wires that to the index (as an L1 ingester would apply the engine's ``BlockStored``).

Faults, set on the instance: ``publish_events`` False (the events never reach the index),
``status`` (answer every request with that HTTP status), ``details`` False (no
``prompt_tokens_details``: vLLM without ``--enable-prompt-tokens-details``), ``delay``
(seconds before answering), ``extra_bos`` (the engine sees a BOS token before the prompt, as
when a router's tokenization differs from the engine's), ``cached_bias`` (tokens added to
every ``cached_tokens``), ``publish_limit`` (only that many of a prompt's blocks reach the
index: the events of the others were lost).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson

from common.blockhash import BlockHasher, HashSettings

BOS = 1


class FakeOpenAI:
    def __init__(
        self,
        host: str,
        block_size: int,
        publish: Callable[[list[int]], None],
        model: str = "fake-model",
    ) -> None:
        self.block_size, self.publish, self.model = block_size, publish, model
        self.hasher = BlockHasher(HashSettings())
        self.cache: set[int] = set()
        self.publish_events = True
        self.status = 200
        self.details = True
        self.delay = 0.0
        self.extra_bos = False
        self.cached_bias = 0
        self.publish_limit: int | None = None
        self.completions: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, 0), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeOpenAI:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = [int(t) for t in body["prompt"]]
        seen = [BOS, *prompt] if self.extra_bos else prompt
        salt = body.get("cache_salt") or None
        with self.lock:
            self.completions.append(body)
            hashes = self.hasher.event_ints(seen, self.block_size, salt)
            hit = 0
            while hit < len(hashes) and hashes[hit] in self.cache:
                hit += 1
            cached = min(hit, (len(seen) - 1) // self.block_size) * self.block_size
            self.cache.update(hashes)
        if self.publish_events:
            self.publish(hashes[: self.publish_limit])
        usage: dict[str, Any] = {"prompt_tokens": len(seen), "completion_tokens": 1}
        if self.details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached + self.cached_bias}
        return {"id": "cmpl-1", "object": "text_completion", "choices": [], "usage": usage}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def _send(self, status: int, doc: Any) -> None:
                data = orjson.dumps(doc)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _fault(self) -> bool:
                if fake.delay:
                    time.sleep(fake.delay)
                if fake.status != 200:
                    self._send(fake.status, {"error": "refused by the test"})
                    return True
                return False

            def do_GET(self) -> None:
                if self._fault():
                    return
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": fake.model}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = orjson.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)))
                if self._fault():
                    return
                if self.path != "/v1/completions" or body.get("model") != fake.model:
                    self._send(404, {"error": f"no {self.path} for {body.get('model')!r}"})
                    return
                self._send(200, fake.complete(body))

        return Handler
