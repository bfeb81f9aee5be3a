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


class ChildServer:
    """Any HTTP server started as a command on a loopback port: waits until ``/health`` answers,
    keeps its output, stops it on exit (radixgen, or a peer in the serving comparison)."""

    def __init__(self, cmd: list[str], port: int, *, env: dict[str, str] | None = None, timeout: float = 600.0) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        name = " ".join(cmd[1:4] if cmd[0] == sys.executable else cmd[:2])
        # a file, not a pipe: a pipe nobody reads would block the server once it fills
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - open while the server runs
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{name} did not become healthy within {timeout:.0f} s")
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

    def __enter__(self) -> ChildServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess(ChildServer):
    def __init__(
        self, *args: str, model: str | None = None, port: int | None = None, timeout: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """``args`` are more ``radixgen serve`` flags; ``env``, variables added to the child's."""
        port = port or free_port()
        cmd = [sys.executable, "-m", "radixgen.cli", "serve", "--port", str(port), "--log-level", "warning"]
        super().__init__([*cmd, *(["--model", model] if model else []), *args], port, env=env, timeout=timeout)


def launch_server(*args: str, model: str | None = None, port: int | None = None) -> ServerProcess:
    return ServerProcess(*args, model=model, port=port)
