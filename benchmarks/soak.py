"""Soak: thousands of mixed requests against a server whose KV pool is deliberately small, so
eviction and retraction happen all the time. Afterwards every request must have ended in a
complete, valid response or a clear 4xx, the KV accounting must balance, /health must be green
and the server's memory flat.

    python benchmarks/soak.py                       # 3000 requests, tiny random model (fast)
    python benchmarks/soak.py --model default       # the bundled SmolLM2
    python benchmarks/soak.py --url http://...      # an already running server (loopback only)

Kinds of request: chat and completions, streamed or not, n > 1, JSON schema and regex
constraints, clients that disconnect mid-stream or give up before the answer, duplicate
request ids on /generate, and deliberately invalid bodies. Bounded by count and by time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, write_json  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima", "Pune"]}, "days": {"enum": [1, 2, 3]},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "days", "ok"], "additionalProperties": False}
REGEX = r"[A-Z]{2}-[0-9]{4}"
WORDS = ["cache", "radix", "token", "batch", "prefix", "decode", "schema", "queue", "slot", "tree", "stream", "model", "engine"]


@dataclass
class SoakReport:
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    requests: int = 0

    def fail(self, kind: str, why: str) -> None:
        self.outcomes[f"FAILED {kind}"] += 1
        if len(self.failures) < 20:
            self.failures.append(f"{kind}: {why}")


def _prompt(rng: random.Random) -> str:
    # a shared head makes prefixes collide in the radix tree; the tail makes them differ
    head = "You are a terse assistant for a logistics company. " * rng.choice([1, 4, 12])
    return head + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))


def _is_error_shaped(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error.get("message"), str) and bool(error["message"]) and error.get("code") == response.status_code


async def _stream_events(response: httpx.Response, limit: int | None = None) -> list[dict[str, Any]]:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
            if limit is not None and len(events) >= limit:
                break
    return events


async def one_request(http: httpx.AsyncClient, rng: random.Random, report: SoakReport, max_tokens: int) -> None:
    kind = rng.choices(
        ["chat", "chat_stream", "completion_n", "schema", "regex", "disconnect", "give_up", "duplicate_id", "invalid"],
        weights=[16, 16, 8, 12, 8, 12, 8, 6, 6])[0]
    messages = [{"role": "user", "content": _prompt(rng)}]
    tokens = rng.randint(4, max_tokens)
    report.requests += 1
    try:
        if kind == "chat":
            r = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": tokens})
            _expect_choices(kind, r, 1, report)
        elif kind == "completion_n":
            r = await http.post("/v1/completions", json={"prompt": _prompt(rng), "max_tokens": tokens, "n": 2})
            _expect_choices(kind, r, 2, report)
        elif kind == "schema":
            body = {"messages": messages, "max_tokens": 60, "temperature": rng.choice([0, 0.7, 1.0]),
                    "response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}}
            r = await http.post("/v1/chat/completions", json=body)
            if _expect_choices(kind, r, 1, report):
                jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)
        elif kind == "regex":
            r = await http.post("/v1/completions", json={"prompt": _prompt(rng), "max_tokens": 12, "regex": REGEX})
            if _expect_choices(kind, r, 1, report) and not re.fullmatch(REGEX, r.json()["choices"][0]["text"]):
                report.fail(kind, f"output {r.json()['choices'][0]['text']!r} does not match")
        elif kind in ("chat_stream", "disconnect"):
            body = {"messages": messages, "max_tokens": tokens, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    _expect_clear_error(kind, r, report)
                    return
                events = await _stream_events(r, limit=2 if kind == "disconnect" else None)
            if kind == "disconnect":
                report.outcomes["disconnected mid-stream"] += 1
            elif not events or events[-1].get("error") or not any(e["choices"] and e["choices"][0].get("finish_reason")
                                                               for e in events):
                report.fail(kind, f"stream ended without a finish_reason: {events[-1:]}")
            else:
                report.outcomes["ok"] += 1
        elif kind == "give_up":
            try:
                await http.post("/v1/completions", json={"prompt": _prompt(rng), "max_tokens": max_tokens,
                                                         "ignore_eos": True}, timeout=0.05)
                report.outcomes["ok"] += 1
            except httpx.TimeoutException:
                report.outcomes["client gave up"] += 1
        elif kind == "duplicate_id":
            body = {"text": _prompt(rng), "request_id": f"dup-{rng.getrandbits(40)}",
                    "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
            first, second = await asyncio.gather(http.post("/generate", json=body), http.post("/generate", json=body))
            codes = sorted([first.status_code, second.status_code])
            if codes == [200, 400] or codes == [200, 200]:  # the same id twice at once: one refused (or in turn)
                report.outcomes["duplicate id handled"] += 1
            else:
                report.fail(kind, f"statuses {codes}")
        else:  # deliberately invalid: must be a clear 4xx
            body = rng.choice([{"messages": []}, {"messages": messages, "temperature": -3},
                               {"messages": messages, "max_tokens": 10**9}, {"prompt": 5},
                               {"messages": messages, "response_format": {"type": "json_schema",
                                                                          "json_schema": {"name": "x", "schema": {"type": "strung"}}}}])
            r = await http.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body)
            if 400 <= r.status_code < 500 and _is_error_shaped(r):
                report.outcomes["invalid refused"] += 1
            else:
                report.fail(kind, f"{r.status_code}: {r.text[:200]}")
    except (httpx.TransportError, ValueError, jsonschema.ValidationError, KeyError) as e:
        report.fail(kind, f"{type(e).__name__}: {e}")


def _expect_clear_error(kind: str, r: httpx.Response, report: SoakReport) -> None:
    if r.status_code == 429 or (400 <= r.status_code < 500 and _is_error_shaped(r)):
        report.outcomes[f"refused {r.status_code}"] += 1
    else:
        report.fail(kind, f"{r.status_code}: {r.text[:200]}")


def _expect_choices(kind: str, r: httpx.Response, n: int, report: SoakReport) -> bool:
    if r.status_code != 200:
        _expect_clear_error(kind, r, report)
        return False
    choices = r.json()["choices"]
    if len(choices) != n or any(c.get("finish_reason") not in ("stop", "length", "tool_calls") for c in choices):
        report.fail(kind, f"bad choices: {choices}")
        return False
    report.outcomes["ok"] += 1
    return True


class RssSampler:
    """Each process's RSS every few seconds on a thread, and its least-squares slope."""

    def __init__(self, pids: dict[str, int], every_s: float) -> None:
        self.pids, self.every_s = pids, every_s
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for name, pid in self.pids.items():
                self.samples[name].append((time.monotonic() - self._start, rss_mb(pid)))
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def slopes_mb_per_min(self) -> dict[str, float]:
        out = {}
        for name, points in self.samples.items():
            if len(points) < 3:
                out[name] = float("nan")
                continue
            t, mb = np.array(points).T
            out[name] = float(np.polyfit(t / 60, mb, 1)[0])
        return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def soak(url: str, *, requests: int, duration_s: float, concurrency: int, max_tokens: int,
               seed: int = 0) -> SoakReport:
    rng = random.Random(seed)
    report = SoakReport()
    deadline = time.monotonic() + duration_s
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 3, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def guarded(child: random.Random) -> None:
            async with gate:
                if time.monotonic() < deadline:
                    await one_request(http, child, report, max_tokens)

        await asyncio.gather(*(guarded(random.Random(rng.getrandbits(64))) for _ in range(requests)))
    return report


def check_server(url: str) -> dict[str, Any]:
    """After the load: idle, KV accounting balanced, healthy."""
    deadline = time.monotonic() + 60
    while True:
        stats = httpx.get(url + "/internal/stats", timeout=10).json()
        if stats["active_requests"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    stats["kv_balanced"] = stats["held_by_requests"] == 0 and stats["free"] + stats["held_by_tree"] == stats["pool_size"]
    stats["healthy"] = httpx.get(url + "/health", timeout=10).status_code == 200
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an already running server (loopback); default: start one")
    parser.add_argument("--model", default="tiny", help="'tiny' (random weights, fast), 'default', or a path")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--duration", type=float, default=900.0, help="stop sending after this many seconds")
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--kv-cache-tokens", type=int, default=2048, help="small on purpose: eviction and retraction")
    parser.add_argument("--warmup-requests", type=int, default=300)
    parser.add_argument("--rss-every", type=float, default=10.0, help="seconds between memory samples")
    args = parser.parse_args()

    server = None
    if args.url is None:
        from radixgen.ipc.launch import launch_server

        model = _model_path(args.model)
        server = launch_server("--kv-cache-tokens", str(args.kv_cache_tokens), "--max-context-len", "1024",
                               "--max-running-requests", "32", model=model)
        url = server.url
    else:
        url = args.url
    try:
        engine_pid = httpx.get(url + "/internal/stats", timeout=10).json()["engine_pid"]
        pids = {"server": server.proc.pid if server else None, "engine": engine_pid}
        rss_boot = {name: rss_mb(pid) for name, pid in pids.items() if pid}
        # a warm-up load first: allocator pools, compiled grammars and caches fill once; memory
        # must be flat from there on
        warmup = asyncio.run(soak(url, requests=args.warmup_requests, duration_s=args.duration,
                                  concurrency=args.concurrency, max_tokens=args.max_tokens, seed=1))
        rss_start = {name: rss_mb(pid) for name, pid in pids.items() if pid}
        started = time.perf_counter()
        sampler = RssSampler({name: pid for name, pid in pids.items() if pid}, args.rss_every)
        report = asyncio.run(soak(url, requests=args.requests, duration_s=args.duration,
                                  concurrency=args.concurrency, max_tokens=args.max_tokens))
        sampler.stop()
        report.failures += [f"warm-up {f}" for f in warmup.failures]
        elapsed = time.perf_counter() - started
        stats = check_server(url)
        rss_end = {name: rss_mb(pid) for name, pid in pids.items() if pid}
    finally:
        if server is not None:
            server.stop()
    rows = [{"outcome": k, "count": v} for k, v in sorted(report.outcomes.items())]
    print_table(rows, ["outcome", "count"])
    print(f"\n{report.requests} requests in {elapsed:.0f} s; retractions {stats.get('num_retractions')}, "
          f"evicted tokens {stats.get('evicted_tokens')}; KV balanced: {stats['kv_balanced']}; healthy: {stats['healthy']}")
    slopes = sampler.slopes_mb_per_min()
    for name in rss_start:
        print(f"RSS {name}: {rss_boot[name]:.0f} MB at boot, {rss_start[name]:.0f} MB after warm-up, "
              f"{rss_end[name]:.0f} MB at the end; slope after warm-up {slopes[name]:+.2f} MB/min "
              f"({len(sampler.samples[name])} samples)")
    for failure in report.failures:
        print("  failure:", failure)
    path = write_json("soak", {"requests": report.requests, "seconds": elapsed, "outcomes": dict(report.outcomes),
                               "failures": report.failures, "stats": stats, "rss_boot_mb": rss_boot, "rss_start_mb": rss_start,
                               "rss_end_mb": rss_end, "rss_slope_mb_per_min": slopes,
                               "rss_samples": sampler.samples, "args": vars(args)})
    print(f"wrote {path}")
    ok = not report.failures and stats["kv_balanced"] and stats["healthy"]
    return 0 if ok else 1


def _model_path(name: str) -> str | None:
    if name == "default":
        return None
    if name != "tiny":
        return name
    from transformers import AutoTokenizer

    from radixgen.models.loader import resolve_model_dir
    from tests.conftest import save_tiny_model

    target = Path.home() / ".cache" / "radixgen" / "tiny-random-llama"
    if not (target / "config.json").exists():
        save_tiny_model(target, AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    return str(target)


if __name__ == "__main__":
    sys.exit(main())
