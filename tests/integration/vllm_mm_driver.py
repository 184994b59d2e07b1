"""Runs a real multimodal vLLM engine (tests/integration/vllm_mm_engine.py); prints one JSON
line. Like tests/integration/vllm_engine_driver.py (whose :class:`Run` it reuses) it must
run in a private network namespace; tests/integration/test_real_vllm_mm.py starts it::

    unshare -n sh -c 'ip link set lo up && python tests/integration/vllm_mm_driver.py'

A seeded workload of image prompts (one image each, identifiers chosen here) and text-only
prompts over the same token ids. For each: wait until the index has applied what the engine
published, ask ``POST /kv-cache/hit-rate?detail=1`` with ``mm_features`` (the identifier and
the placeholder range), send the request to the engine, record its ``cached_tokens``. Also
per row, the index's answer for the same token ids under other inputs (no item, another
identifier, the item one token earlier): the test checks those were held while neither the
engine nor the index credited them. ``uuid`` requests let vLLM expand the placeholder itself;
the driver records the token ids and ranges the engine reports (``return_token_ids``) so the
test can check the index was asked with exactly those.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

from common.blockhash_extra import HashInputs, MmItem  # noqa: E402
from tests.conftest import RedisServer, wait_for  # noqa: E402
from tests.integration import vllm_engine as ve  # noqa: E402
from tests.integration import vllm_mm_engine as mm  # noqa: E402
from tests.integration.vllm_engine_driver import IP, predict  # noqa: E402
from tests.integration.vllm_keyed_run import KeyedRun  # noqa: E402

MODEL = "blip2"
IDS = ("img-0", "img-1", "img-2")
SEEDS = {name: i + 1 for i, name in enumerate(IDS)}
Q = mm.QUERY_TOKENS

Item = tuple[str, int]  # (identifier, offset); length is always Q
Req = dict[str, Any]  # mode ("features" | "uuid" | "text"), tokens (expanded), item


def inputs_of(item: Item | None) -> HashInputs:
    return HashInputs(mm_items=(MmItem(item[0], item[1], Q),) if item else ())


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, mm.IMAGE_TOKEN) for _ in range(n)]


def plan(seed: int, count: int = 40) -> list[Req]:
    """Image prompts at varied offsets (spanning blocks, ending on a block boundary, right
    after an ``<image>`` text token so the item can move by one with the same token ids),
    each later repeated, re-identified, moved, sent without its item, or extended; and
    ``uuid`` prompts (vLLM puts the image first)."""
    rng = random.Random(seed)
    prefixes = [_text(rng, n) for n in (24, 56, 90)]
    reqs: list[Req] = []
    while len(reqs) < count:
        roll = rng.random()
        if reqs and roll < 0.45:
            reqs.append(_variant(rng, rng.choice(reqs[-6:])))
            continue
        if roll < 0.6:
            text = rng.choice(prefixes) + _text(rng, rng.randrange(20, 160))
            reqs.append(
                {
                    "mode": "uuid",
                    "tokens": [mm.IMAGE_TOKEN] * Q + text,
                    "item": (rng.choice(IDS), 0),
                }
            )
            continue
        prefix = rng.choice(prefixes)
        lead = rng.choice([0, 1, 1, 8])  # 1: an <image> token right before the item
        tokens = prefix + [mm.IMAGE_TOKEN] * (lead + Q) + _text(rng, rng.randrange(10, 200))
        reqs.append(
            {"mode": "features", "tokens": tokens, "item": (rng.choice(IDS), len(prefix) + lead)}
        )
    return reqs


def _variant(rng: random.Random, base: Req) -> Req:
    ident, offset = base["item"] if base["item"] else (rng.choice(IDS), -1)
    tokens = list(base["tokens"])
    choices = ["repeat", "other_id", "text", "extend"]
    if base["item"] and offset > 0 and tokens[offset - 1] == mm.IMAGE_TOKEN:
        choices.append("shift")
    kind = rng.choice(choices)
    if kind == "text" or not base["item"]:
        return {
            "mode": "text",
            "tokens": tokens,
            "item": None,
            "was": base["item"] or base.get("was"),
        }
    mode = (
        "uuid"
        if base["mode"] == "uuid" and kind in ("repeat", "other_id", "extend")
        else "features"
    )
    if kind == "other_id":
        ident = rng.choice([i for i in IDS if i != ident])
    elif kind == "shift":
        offset -= 1
    elif kind == "extend":
        tokens += _text(rng, rng.randrange(1, 100))
    return {"mode": mode, "tokens": tokens[: ve.MAX_MODEL_LEN - 8], "item": (ident, offset)}


class MmRun(KeyedRun):
    """The BLIP-2 engine's :class:`Run`: its tokenizer files, the token-in endpoint."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        super().__init__(MODEL, tmp, redis_url)
        self.pixels = mm.encoded_pixels(sorted(SEEDS.values()))

    def _spawn(self, log: str, argv: list[str], env: dict[str, str]) -> Any:
        if log == "engine.log":
            mm.write_processor_files(Path(argv[argv.index("--model") + 1]))
            argv = mm.engine_argv(argv)
        return super()._spawn(log, argv, env)

    def ask(self, tokens: list[int], item: Item | None) -> dict[str, Any]:
        body: dict[str, Any] = {"token_ids": tokens, "block_size": ve.BLOCK}
        if item:
            body["mm_features"] = [{"identifier": item[0], "offset": item[1], "length": Q}]
        resp = httpx.post(
            f"http://127.0.0.1:{self.api}/kv-cache/hit-rate",
            params={"detail": 1},
            json={"server_ip": [IP], "body": body},
            timeout=10,
        )
        if resp.status_code != 200:
            raise RuntimeError(f"hit-rate answered {resp.status_code}: {resp.text[:500]}")
        return dict(resp.json()["server_score_list"][0])

    def generate(self, req: Req) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "sampling_params": {"max_tokens": 1, "temperature": 0},
            "return_token_ids": True,
        }
        item = req["item"]
        if req["mode"] == "uuid":
            body["token_ids"] = req["tokens"][Q:]
            url = mm.png_data_uri(SEEDS[item[0]])
            body["content_parts"] = [{"type": "image_url", "url": url, "uuid": item[0]}]
        else:
            body["token_ids"] = req["tokens"]
        if req["mode"] == "features":
            body["features"] = {
                "mm_hashes": {"image": [item[0]]},
                "mm_placeholders": {"image": [{"offset": item[1], "length": Q}]},
                "kwargs_data": {"image": [self.pixels[SEEDS[item[0]]]]},
            }
        resp = httpx.post(
            f"http://{IP}:{self.engine_port}/inference/v1/generate", json=body, timeout=120
        )
        if resp.status_code != 200:
            raise RuntimeError(f"the engine answered {resp.status_code}: {resp.text[:500]}")
        return dict(resp.json())

    def others(self, req: Req) -> dict[str, int]:
        """The index's answer for the same token ids under other inputs."""
        tokens, item = req["tokens"], req["item"]
        out = {}
        if item:
            out["text"] = _tokens(self.ask(tokens, None))
            for other in IDS:
                if other != item[0]:
                    out[f"id:{other}"] = _tokens(self.ask(tokens, (other, item[1])))
            if item[1] > 0 and tokens[item[1] - 1] == mm.IMAGE_TOKEN:
                out["earlier"] = _tokens(self.ask(tokens, (item[0], item[1] - 1)))
            if item[1] + Q < len(tokens) and tokens[item[1] + Q] == mm.IMAGE_TOKEN:
                out["later"] = _tokens(self.ask(tokens, (item[0], item[1] + 1)))
        elif req.get("was"):
            for other in IDS:
                out[f"id:{other}"] = _tokens(self.ask(tokens, (other, req["was"][1])))
        return out

    def run_mm(self, seed: int) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        previous: list[int] | None = None
        answered = time.monotonic()
        for i, req in enumerate(plan(seed)):
            note = self.settle(previous, answered)
            score = self.ask(req["tokens"], req["item"])
            others = self.others(req)
            out = self.generate(req)
            answered = time.monotonic()
            details = out["usage"].get("prompt_tokens_details") or {}
            rows.append(
                {
                    "i": i,
                    "mode": req["mode"],
                    "item": req["item"],
                    "len": len(req["tokens"]),
                    **predict(score, len(req["tokens"]), False),
                    "cached_tokens": int(details.get("cached_tokens") or 0),
                    "others": others,
                    "engine_tokens_equal": out.get("prompt_token_ids") == req["tokens"],
                    "engine_placeholders": out.get("mm_placeholders"),
                    **note,
                }
            )
            previous, self.previous_inputs = req["tokens"], inputs_of(req["item"])
        assert self.capture is not None
        self.capture.wait_quiet(answered)
        return {"rows": rows}


def _tokens(score: dict[str, Any]) -> int:
    return int(score.get("l1_hit_tokens", -1))


def mm_events(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``extra_keys`` the engine published on BlockStored: per-block entries seen."""
    keyed, plain, negative = 0, 0, 0
    sample = None
    for batch in batches:
        for ev in batch["events"]:
            if ev["type"] != "BlockStored":
                continue
            for keys in ev.get("extra_keys") or [None] * len(ev["block_hashes"]):
                if keys is None:
                    plain += 1
                    continue
                keyed += 1
                negative += any(k[1] < 0 for k in keys)
                sample = sample or keys
    return {
        "keyed_blocks": keyed,
        "plain_blocks": plain,
        "negative_offsets": negative,
        "sample": sample,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=31)
    args = p.parse_args()
    ve.MODELS.setdefault(MODEL, mm.SPEC)  # Run looks the model up there (this process only)
    with tempfile.TemporaryDirectory(prefix="vllm-mm-") as tmp:
        server = RedisServer().start()
        run = None
        try:
            redis.Redis.from_url(server.url).flushall()
            run = MmRun(Path(tmp), server.url)
            started = time.monotonic()
            run.start()
            ready = time.monotonic()
            out = run.run_mm(args.seed)
            assert run.capture is not None
            state = run.store.l1_state
            wait_for(lambda: state(IP).get("hash_check"), timeout=30, what="a hash check verdict")
            batches = run.capture.decoded()
            result = {
                "model": MODEL,
                "rows": out["rows"],
                "hash_check": {k: v for k, v in state(IP).items() if k.startswith("hash_check")},
                "events": {**ve.event_summary(batches), **mm_events(batches)},
                "seconds": {
                    "start": round(ready - started, 1),
                    "workload": round(time.monotonic() - ready, 1),
                },
            }
        except Exception as exc:  # noqa: BLE001 - reported to the test with the logs
            logs = {}
            if run is not None:
                logs = {
                    p.name: p.read_text(errors="replace")[-4000:] for p in run.tmp.glob("*.log")
                }
            result = {"model": MODEL, "error": repr(exc), "logs": logs}
        finally:
            if run is not None:
                run.stop()
            server.cleanup()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
