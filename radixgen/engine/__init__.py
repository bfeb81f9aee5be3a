"""The serving engine: requests, KV pool, scheduler, model runner, sampler."""

from radixgen.engine.engine import Engine, GenerationOutput
from radixgen.engine.request import FinishReason, RequestOutput, RequestStatus, SamplingParams

__all__ = ["Engine", "FinishReason", "GenerationOutput", "RequestOutput", "RequestStatus", "SamplingParams"]
