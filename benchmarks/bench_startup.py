"""How long users wait before the first request: `radixgen serve` until /health answers (and
until it has stopped after SIGTERM), an in-process ``Engine`` from a fresh interpreter, and the
CLI's own start (``--help``), each in a new process, the median of several rounds.

    python benchmarks/bench_startup.py [--rounds 3] [--model PATH] [--before REV]

``--before REV`` measures another commit (checked out into a temporary worktree) in the same
run, round by round alternating with this tree, so both see the same machine. A first round of
each tree warms the page cache and the kernel build and is not counted.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_ENGINE = ("import sys, time; t = time.monotonic(); from radixgen import Engine, EngineConfig; "
           "e = Engine(EngineConfig(model=sys.argv[1] or None)); print(time.monotonic() - t); e.shutdown()")


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_seconds(tree: Path, model: str | None) -> tuple[float, float]:
    """(seconds until /health is 200, seconds from SIGTERM to exit)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "radixgen.cli", "serve", "--port", str(port), "--log-level", "warning",
           *(["--model", model] if model else [])]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=_env(tree), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"radixgen serve in {tree} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        ready = time.monotonic() - start
        stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        return ready, time.monotonic() - stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def engine_seconds(tree: Path, model: str | None) -> float:
    out = subprocess.run([sys.executable, "-c", _ENGINE, model or ""], cwd=tree, env=_env(tree), check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def cli_seconds(tree: Path) -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "radixgen.cli", "--help"], cwd=tree, env=_env(tree), check=True,
                   capture_output=True)
    return time.monotonic() - start


def measure(tree: Path, model: str | None) -> dict[str, float]:
    ready, stopped = serve_seconds(tree, model)
    return {"serve_ready_s": ready, "serve_stop_s": stopped, "engine_s": engine_seconds(tree, model),
            "cli_help_s": cli_seconds(tree)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--before", default=None, help="a git revision to measure side by side")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import print_table, trees_to_measure, write_json

    with trees_to_measure(args.before) as trees:
        for tree, _ in trees:
            measure(tree, args.model)  # warm-up
        samples: dict[str, list[dict[str, float]]] = {label: [] for _, label in trees}
        for _ in range(args.rounds):
            for tree, label in trees:
                samples[label].append(measure(tree, args.model))
    columns = ["serve_ready_s", "serve_stop_s", "engine_s", "cli_help_s"]
    rows = [{"tree": label, **{c: statistics.median(s[c] for s in runs) for c in columns}}
            for label, runs in samples.items()]
    print_table(rows, ["tree", *columns])
    print("wrote", write_json("bench_startup", {"model": args.model or "bundled", "rounds": args.rounds,
                                                "rows": rows, "samples": samples}))


if __name__ == "__main__":
    main()
