"""Start ``radixgen serve`` as a child process on a free loopback port (notebooks, benchmarks).

    with launch_server() as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, *args: str, model: str | None = None, port: int | None = None, timeout: float = 600.0) -> None:
        """``args`` are more ``radixgen serve`` flags; waits until ``/health`` answers."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "radixgen.api.cli", "serve", "--port", str(self.port), "--log-level", "warning"]
        cmd += ["--model", model] if model else []
        # a file, not a pipe: a pipe nobody reads would block the server once it fills
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen([*cmd, *args], stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                output = self.output()
                raise RuntimeError(f"radixgen serve exited with {self.proc.returncode}:\n{output[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"radixgen serve did not become healthy within {timeout:.0f} s")
            time.sleep(0.3)

    def output(self) -> str:
        """Everything the server printed so far (kept after ``stop``)."""
        if self.log.closed:
            return self._final_output
        self.log.flush()
        self.log.seek(0)
        text = self.log.read()
        self.log.seek(0, 2)
        return text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self.log.closed:
            self._final_output = self.output()
            self.log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_server(*args: str, model: str | None = None, port: int | None = None) -> ServerProcess:
    return ServerProcess(*args, model=model, port=port)
