"""radixgen's language for LLM programs: prompts built step by step, constrained generations
captured into variables, forks that share their prefix in the radix cache.

    from radixgen.lang import Runtime, function, gen, select

    @function
    def qa(s, question):
        with s.user():
            s += question
        with s.assistant():
            s += gen("answer", max_tokens=64)

    state = qa.run("What is 2 + 2?", backend=Runtime(), temperature=0)
    print(state["answer"])
"""

from radixgen.lang.backends import Backend, Endpoint, GenResult, Runtime
from radixgen.lang.ir import gen, select
from radixgen.lang.program import Program, function, set_default_backend
from radixgen.lang.state import ProgramError, ProgramState
from radixgen.lang.tool import Tool, ToolRun, run_tools, tool

__all__ = [
    "Backend", "Endpoint", "GenResult", "Program", "ProgramError", "ProgramState", "Runtime", "Tool", "ToolRun",
    "function", "gen", "run_tools", "select", "set_default_backend", "tool",
]
