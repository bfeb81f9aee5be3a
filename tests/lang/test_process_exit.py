"""A DSL program in a process of its own exits cleanly, every time: one run printed its result
and then aborted with 'terminate called without an active exception' (exit 134) in 2 of 6 runs,
a native thread outliving interpreter shutdown. Several runs, with and without shutdown()."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = """
import sys
from radixgen.lang import Runtime, function, gen, select

@function
def prog(s):
    with s.user():
        s += "Pick a colour and describe a person."
    with s.assistant():
        s += "Colour: " + select("colour", ["red", "green", "blue"])
        s += " Code: " + gen("code", regex=r"[A-Z]{3}-[0-9]{3}", max_tokens=12)
        s += " Person: " + gen("person", json_schema={"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}, "required": ["name", "age"]},
            max_tokens=40)

rt = Runtime(sys.argv[1], kv_cache_tokens=2048, max_context_len=512)
state = prog.run(backend=rt, temperature=0)
print("result", state["colour"], state["code"])
if sys.argv[2] == "shutdown":
    rt.shutdown()
"""


@pytest.mark.parametrize("ending", ["shutdown", "none"])
def test_a_dsl_program_exits_cleanly_every_time(tiny_model_dir: Path, tmp_path: Path, ending: str) -> None:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    for _ in range(3):
        done = subprocess.run([sys.executable, str(script), str(tiny_model_dir), ending], capture_output=True,
                              text=True, timeout=120, env={"RADIXGEN_TUNE_KERNELS": "0", **_env()})
        assert done.returncode == 0 and "result" in done.stdout, done.stderr[-2000:]
        assert "terminate called" not in done.stderr, done.stderr[-2000:]


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "RADIXGEN_TUNE_KERNELS"}
