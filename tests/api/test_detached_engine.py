"""An engine started on its own (``radixgen engine --listen``) outlives the servers attached to
it (``--engine-address``): a front killed under load is replaced without reloading the model or
losing the prefix cache, what it left running is aborted, and a dead engine gives 503s."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.api.conftest import LiveServer

PROMPT = "The engine outlives its fronts: " + "a warm prefix cache is worth keeping. " * 6


def _start_engine(folder: Path, model_dir: Path) -> tuple[subprocess.Popen[str], Any]:
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - read when a test fails
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixgen.cli", "engine", "--listen", str(folder), "--model", str(model_dir),
         "--kv-cache-tokens", "20000", "--max-context-len", "1024", "--log-level", "info"],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, log


def _front(folder: Path) -> LiveServer:
    return LiveServer(["--engine-address", str(folder), "--served-model-name", "tiny"])


LONG, CHOICES = 1000, 16  # the stream left running: it takes longer than a front takes to start


def _stream_until_it_breaks(server: LiveServer, started: threading.Event, ended: list[str]) -> None:
    body = {"model": "tiny", "prompt": "go", "max_tokens": LONG, "n": CHOICES, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if response.status_code != 200:
                    ended.append(f"HTTP {response.status_code}: {line}")
                started.set()
        ended.append("finished")
    except httpx.HTTPError as e:
        ended.append(type(e).__name__)
    finally:
        started.set()


def _log(log: Any) -> str:
    log.seek(0)
    return str(log.read())


def test_a_front_killed_under_load_is_replaced_and_the_engine_keeps_its_model_and_cache(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "engine"
    engine, log = _start_engine(folder, tiny_model_dir)
    fronts: list[LiveServer] = []
    try:
        first = _front(folder)
        fronts.append(first)
        pid = first.stats()["engine_pid"]
        assert pid == engine.pid
        warm = openai.OpenAI(base_url=first.url + "/v1", api_key="unused").completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        started, ended = threading.Event(), []
        reader = threading.Thread(target=_stream_until_it_breaks, args=(first, started, ended))
        reader.start()
        assert started.wait(30)
        assert first.stats()["active_requests"] == CHOICES, (ended, first.stats())
        first.proc.kill()  # SIGKILL: no drain, no goodbye to the engine
        first.proc.wait(10)
        reader.join(30)
        assert ended and ended[0] != "finished", "a stream outlived its server"

        second = _front(folder)
        fronts.append(second)
        stats = second.wait_idle()  # its hello aborted the stream the dead front left running
        assert stats["active_requests"] == 0 and stats["held_by_requests"] == 0, stats
        assert stats["generated_tokens"] < 0.75 * CHOICES * LONG, f"the orphaned stream ran on: {stats}"
        assert second.stats()["engine_pid"] == pid, "the engine was restarted, not kept"
        again = openai.OpenAI(base_url=second.url + "/v1", api_key="unused").completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        assert again.choices[0].text == warm.choices[0].text
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
        assert f"aborted the {CHOICES} requests an earlier one left running" in _log(log)

        second.stop()  # a graceful stop lets go of the engine, which goes on
        time.sleep(0.5)
        assert engine.poll() is None, _log(log)
        engine.terminate()
        assert engine.wait(30) == 0, _log(log)
    finally:
        for front in fronts:
            front.stop()
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)
        log.close()


def test_an_attached_front_answers_503_when_its_engine_dies(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "engine"
    engine, log = _start_engine(folder, tiny_model_dir)
    front = None
    try:
        front = _front(folder)
        started, ended = threading.Event(), []
        reader = threading.Thread(target=_stream_until_it_breaks, args=(front, started, ended))
        reader.start()
        assert started.wait(30)
        engine.kill()
        engine.wait(10)
        reader.join(30)  # the front notices the silence (FRONT_TIMEOUT_S) and ends the stream
        assert not reader.is_alive() and ended, "a client waited on a dead engine"
        response = httpx.post(front.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                              timeout=30)
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable", response.text
    finally:
        if front is not None:
            front.stop()
        if engine.poll() is None:
            engine.kill()
        log.close()

