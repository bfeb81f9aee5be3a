"""Scale-out on a local Ray: two replicas of the tiny model behind `radixgen serve --replicas 2`,
driven through the official OpenAI client."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixgen.ipc.launch import ServerProcess

pytestmark = pytest.mark.ray

SYSTEM = "You are the order desk of a small bakery. Answer in one short sentence. " * 6
MODEL = "tiny"


def _start(tiny_model_dir: Path) -> ServerProcess:
    pytest.importorskip("ray", reason="the scale-out extra is not installed: pip install 'radixgen[ray]'")
    try:
        return ServerProcess("--model", str(tiny_model_dir), "--kv-cache-tokens", "8192", "--max-context-len", "1024",
                             "--served-model-name", MODEL, "--replicas", "2", timeout=240)
    except RuntimeError as e:
        # only Ray itself failing to start is a reason to skip (e.g. a sandbox without shared
        # memory); anything in our code fails the test
        text = str(e)
        if "ray.init" in text and ("RaySystemError" in text or "Failed to start" in text or "raylet" in text):
            pytest.skip(f"Ray could not start on this machine: {text.splitlines()[-1]}")
        raise


def _replicas(server: ServerProcess) -> dict[int, dict[str, Any]]:
    stats = httpx.get(server.url + "/internal/stats", timeout=10).json()
    return {s["replica"]: s for s in stats["replicas"]}


def test_prefix_affinity_and_a_replica_failure(tiny_model_dir: Path) -> None:
    from openai import APIStatusError, OpenAI

    server = _start(tiny_model_dir)
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def ask(question: str, max_tokens: int = 6) -> Any:
            return client.chat.completions.create(model=MODEL, max_tokens=max_tokens, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])

        first = ask("Is the rye bread ready?")
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        later = [ask(q) for q in ("Do you deliver?", "When do you open?")]
        for reply in later:
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            assert reply.usage.prompt_tokens_details.cached_tokens > 0, "routed to the replica holding the prefix"
        replicas = _replicas(server)
        assert sorted(replicas) == [0, 1]
        home = max(replicas, key=lambda r: replicas[r]["routed_requests"])
        assert replicas[home]["routed_requests"] == 3 and replicas[1 - home]["routed_requests"] == 0
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert f'radixgen_replica_routed_requests{{replica="{home}"}} 3.0' in metrics

        # kill the replica that holds the prefix while it serves a long request
        outcome: list[str] = []

        def long_request() -> None:
            try:
                ask("Tell me everything.", max_tokens=600)
                outcome.append("finished")
            except APIStatusError as e:
                outcome.append(f"status {e.status_code}")

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(1.0)
        os.kill(replicas[home]["pid"], signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the in-flight request must end, not hang"
        assert outcome in (["status 503"], ["finished"]), outcome

        for question in ("Still open?", "Any croissants?", "Gluten free?"):  # service goes on
            reply = ask(question)
            assert reply.choices[0].finish_reason in ("length", "stop")
        deadline = time.monotonic() + 90
        while len(_replicas(server)) < 2:  # Ray Serve brings the dead replica back
            assert time.monotonic() < deadline, "the killed replica was not replaced"
            time.sleep(1)
        assert _replicas(server)[home]["pid"] != replicas[home]["pid"]
        for stats in _replicas(server).values():  # no slot leaked on either replica
            assert stats["held_by_requests"] == 0 and stats["free"] + stats["held_by_tree"] == stats["pool_size"]
    finally:
        server.stop()
    assert server.proc.returncode is not None
