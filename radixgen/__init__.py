"""radixgen: serve language models with a radix prefix cache and fast structured output."""

from radixgen.config import EngineConfig, ServerConfig
from radixgen.engine import Engine, FinishReason, GenerationOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "FinishReason", "GenerationOutput", "SamplingParams", "ServerConfig"]
__version__ = "0.1.0"
