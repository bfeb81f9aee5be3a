"""radixgen: serve language models with a radix prefix cache and fast structured output."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from radixgen.config import EngineConfig, ServerConfig

if TYPE_CHECKING:
    from radixgen.engine import Engine, FinishReason, GenerationOutput, SamplingParams



def __getattr__(name: str) -> Any:
    # the engine (and torch under it) loads on first use: the server's HTTP process, the HTTP
    # client of the DSL and the CLI's argument parsing never touch it
    if name in ("Engine", "FinishReason", "GenerationOutput", "SamplingParams"):
        return getattr(importlib.import_module("radixgen.engine"), name)
    raise AttributeError(f"module 'radixgen' has no attribute {name!r}")


__all__ = ["Engine", "EngineConfig", "FinishReason", "GenerationOutput", "SamplingParams", "ServerConfig"]
__version__ = "0.1.0"
