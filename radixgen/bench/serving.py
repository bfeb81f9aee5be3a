"""Serving load generator: realistic sessions against any OpenAI-compatible URL.

Sessions arrive at ``session_rate`` per second (exponential gaps), at most ``sessions`` at once.
Each session sends ``turns`` chat requests with exponential think time between them; a request
is a short question, a long context, a question under one of a few shared system prompts, or
the next turn of a conversation that resends its history (the last two are what a prefix cache
serves); a share asks for JSON under a schema. Outputs are forced to a length drawn from
[min_output, max_output] with ``ignore_eos`` (vLLM and radixgen both accept it). Everything is
streamed; per request we measure time to first token, time per output token (mean gap after
the first) and end-to-end latency. Requests that start during the warm-up are excluded.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

TOPICS = ["shipping delays", "a refund", "the radix cache", "batch scheduling", "a broken charger", "train tickets",
          "a tax form", "a lost parcel", "GPU memory", "a hotel booking", "the weather", "a password reset"]
FILLER = ("The customer wrote at length about the order, the delivery window, the tracking page and "
          "what the support agent had promised on the phone the week before. ")
SYSTEM_PROMPTS = [
    "You are the support assistant of Northwind Logistics. Be precise and polite. " + FILLER * 12,
    "You are a senior engineer reviewing serving systems. Answer with concrete numbers. " + FILLER * 10,
    "You are a travel agent. Offer at most two options and state prices in euros. " + FILLER * 11,
]
ANSWER_SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40}, "urgent": {"type": "boolean"},
    "next_step": {"enum": ["refund", "replace", "escalate", "answer"]}}, "required": ["topic", "urgent", "next_step"],
    "additionalProperties": False}

JSON_MIN_TOKENS = 32


@dataclass(frozen=True)
class Workload:
    sessions: int = 64
    """Sessions open at once (the concurrency)."""
    session_rate: float = 1.0
    """New sessions per second."""
    turns: int = 3
    think_time_s: float = 1.0
    """Mean pause between a session's requests."""
    num_requests: int = 400
    duration_s: float = 300.0
    warmup_s: float = 10.0
    min_output: int = 32
    max_output: int = 256
    share_long: float = 0.25
    """Long contexts (200-600 tokens)."""
    share_shared_prefix: float = 0.35
    """Questions under one of the shared system prompts."""
    share_json: float = 0.15
    ignore_eos: bool = True
    seed: int = 0


PRESETS = {
    "mixed-64": Workload(),
    # the load issue 24 measured against vLLM: sessions arriving at 4/s, and all 128 at once
    "arrival-4": Workload(session_rate=4.0),
    "saturation-128": Workload(sessions=128, session_rate=float("inf"), think_time_s=0.0, warmup_s=0.0),
    "smoke": Workload(sessions=4, session_rate=20.0, turns=2, think_time_s=0.05, num_requests=16, duration_s=60,
                      warmup_s=0.0, min_output=4, max_output=12),
    "shared-prefix-16": Workload(sessions=16, session_rate=4.0, share_long=0.0, share_shared_prefix=1.0, share_json=0.0),
    "json-16": Workload(sessions=16, session_rate=4.0, share_json=1.0, min_output=8, max_output=96, ignore_eos=False),
}


@dataclass
class RequestRecord:
    kind: str
    start: float
    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class ServingReport:
    target: str
    workload: dict[str, Any]
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    server_metrics: dict[str, float] = field(default_factory=dict)

    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if r.start >= self.workload["warmup_s"]]

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.measured() if r.error is None and r.latency is not None]
        window = max(1e-9, self.wall_s - self.workload["warmup_s"])
        out: dict[str, Any] = {"target": self.target, "requests": len(self.measured()), "completed": len(done),
                               "errors": sum(r.error is not None for r in self.measured()),
                               "request_throughput": len(done) / window,
                               "output_tokens_per_s": sum(r.output_tokens for r in done) / window}
        for metric in ("ttft", "tpot", "latency"):
            values = sorted(v for r in done if (v := getattr(r, metric)) is not None)
            for q in (50, 95, 99):
                out[f"{metric}_p{q}"] = _percentile(values, q)
        out.update(self.server_metrics)
        return out


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


class LoadGenerator:
    def __init__(self, url: str, workload: Workload, *, model: str = "default", api_key: str | None = None,
                 progress: bool = True) -> None:
        self.url = url.rstrip("/")
        self.workload = workload
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.progress = progress
        self.rng = random.Random(workload.seed)

    async def run(self) -> ServingReport:
        w = self.workload
        report = ServingReport(self.url, asdict(w))
        before = await self._scrape_metrics()
        budget = {"left": w.num_requests}
        bar = _progress_bar(w.num_requests) if self.progress else None
        limits = httpx.Limits(max_connections=w.sessions + 8, max_keepalive_connections=w.sessions)
        gate = asyncio.Semaphore(w.sessions)
        started = time.perf_counter()
        deadline = started + w.duration_s
        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=600, limits=limits) as http:
            tasks = []
            while budget["left"] > 0 and time.perf_counter() < deadline:
                await gate.acquire()
                session_rng = random.Random(self.rng.getrandbits(64))
                tasks.append(asyncio.create_task(
                    self._session(http, session_rng, started, deadline, budget, report, bar, gate)))
                await asyncio.sleep(self.rng.expovariate(w.session_rate))
            await asyncio.gather(*tasks)
        report.wall_s = time.perf_counter() - started
        if bar is not None:
            bar.close()
        after = await self._scrape_metrics()
        report.server_metrics = _metric_deltas(before, after)
        return report

    async def _session(self, http: httpx.AsyncClient, rng: random.Random, started: float, deadline: float,
                       budget: dict[str, int], report: ServingReport, bar: Any, gate: asyncio.Semaphore) -> None:
        w = self.workload
        try:
            history: list[dict[str, str]] = []
            kind = self._session_kind(rng)
            if kind == "shared_prefix":
                history.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            for turn in range(w.turns):
                if budget["left"] <= 0 or time.perf_counter() >= deadline:
                    return
                budget["left"] -= 1
                history.append({"role": "user", "content": self._question(rng, kind, turn)})
                wants_json = rng.random() < w.share_json
                record = RequestRecord(kind=("json:" if wants_json else "") + (kind if turn == 0 else "multi_turn"),
                                       start=time.perf_counter() - started)
                answer = await self._one(http, rng, history, wants_json, record)
                report.records.append(record)
                if bar is not None:
                    bar.update(1)
                history.append({"role": "assistant", "content": answer})
                await asyncio.sleep(rng.expovariate(1.0 / w.think_time_s) if w.think_time_s > 0 else 0)
        finally:
            gate.release()

    def _session_kind(self, rng: random.Random) -> str:
        w = self.workload
        roll = rng.random()
        if roll < w.share_shared_prefix:
            return "shared_prefix"
        if roll < w.share_shared_prefix + w.share_long:
            return "long"
        return "short"

    @staticmethod
    def _question(rng: random.Random, kind: str, turn: int) -> str:
        topic = rng.choice(TOPICS)
        if turn > 0:
            return f"Thanks. And what about {topic}? Keep it short."
        if kind == "long":
            return FILLER * rng.randint(6, 20) + f"Given all that, what should happen with {topic}?"
        return f"Could you explain {topic} to me in a few sentences, please?"

    async def _one(self, http: httpx.AsyncClient, rng: random.Random, messages: list[dict[str, str]],
                   wants_json: bool, record: RequestRecord) -> str:
        w = self.workload
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True, "temperature": 0.7,
                                "max_tokens": rng.randint(w.min_output, w.max_output),
                                "stream_options": {"include_usage": True}, "seed": rng.getrandbits(31)}
        if w.ignore_eos and not wants_json:
            body["ignore_eos"] = True
        if wants_json:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": ANSWER_SCHEMA}}
            # room for a complete answer: radixgen refuses a budget below the schema's shortest
            # output (~15 tokens), where other engines would return cut-off JSON
            body["max_tokens"] = max(body["max_tokens"], JSON_MIN_TOKENS)
        sent = time.perf_counter()
        chunks: list[float] = []
        text: list[str] = []
        usage_tokens: int | None = None
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return ""
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        record.error = str(event["error"].get("message"))[:200]
                        return "".join(text)
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
                    for choice in event.get("choices", []):
                        delta = choice.get("delta", {}).get("content")
                        if delta:
                            chunks.append(time.perf_counter())
                            text.append(delta)
        except httpx.HTTPError as e:
            record.error = f"{type(e).__name__}: {e}"
            return ""
        end = time.perf_counter()
        if not chunks:
            record.error = "no tokens"
            return ""
        record.ttft = chunks[0] - sent
        record.latency = end - sent
        record.output_tokens = usage_tokens or len(chunks)
        if record.output_tokens > 1 and len(chunks) > 1:  # one chunk (no streaming): no inter-token time
            record.tpot = (chunks[-1] - chunks[0]) / (record.output_tokens - 1)
        return "".join(text)

    async def _scrape_metrics(self) -> dict[str, float]:
        try:
            async with httpx.AsyncClient(headers=self.headers, timeout=10) as http:
                response = await http.get(self.url + "/metrics")
        except httpx.HTTPError:
            return {}
        if response.status_code != 200:
            return {}
        values: dict[str, float] = {}
        for match in re.finditer(r"^(radixgen_[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", response.text, re.M):
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
        return values


def _metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """radixgen's /metrics: gauges as they stand at the end, for this run's view of the server."""
    wanted = {"radixgen_cache_hit_rate": "cache_hit_rate", "radixgen_avg_batch_size": "avg_batch_size",
              "radixgen_scheduler_seconds_per_step": "scheduler_s_per_step"}
    return {name: after[metric] for metric, name in wanted.items() if metric in after}


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")


def plot(reports: list[ServingReport], path: Path) -> Path | None:
    """Latency CDFs (TTFT, TPOT, end-to-end) and an output-throughput bar chart in one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    colors = [f"C{i % 10}" for i in range(len(reports))]  # one color per target in every panel
    for report, color in zip(reports, colors, strict=True):
        done = [r for r in report.measured() if r.error is None]
        for ax, metric in zip(axes[:3], ("ttft", "tpot", "latency"), strict=True):
            values = sorted(v for r in done if (v := getattr(r, metric)) is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=report.target, color=color)
    for ax, title in zip(axes[:3], ("time to first token (s)", "time per output token (s)", "end-to-end (s)"),
                         strict=True):
        ax.set_xlabel(title)
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    summaries = [r.summary() for r in reports]
    axes[3].bar(range(len(summaries)), [s["output_tokens_per_s"] for s in summaries], color=colors)
    axes[3].set_xticks(range(len(summaries)), [s["target"] for s in summaries], rotation=20, fontsize=7)
    axes[3].set_ylabel("output tokens / s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_preset(url: str, preset: str = "mixed-64", *, label: str | None = None, progress: bool = True,
               model: str = "default", **overrides: Any) -> ServingReport:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    workload = replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    report = asyncio.run(LoadGenerator(url, workload, model=model, progress=progress).run())
    if label:
        report.target = label
    return report
