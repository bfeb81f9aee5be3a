"""One engine replica as a Ray Serve deployment (imported only when Ray is used).

Each replica holds its own model copy, KV pool and radix cache, and streams ``RequestOutput``
deltas to the front through a Serve handle. Serve restarts a replica whose actor dies or whose
health check fails (the engine loop died).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from radixgen.config import EngineConfig
from radixgen.engine.engine import Engine
from radixgen.engine.output import FinishReason, RequestOutput
from radixgen.engine.params import SamplingParams


@serve.deployment(
    max_ongoing_requests=100_000,  # the engine queues and refuses by itself (max_queued_requests)
    health_check_period_s=2.0,
    health_check_timeout_s=30.0,
    graceful_shutdown_timeout_s=5.0,
)
class EngineReplica:
    def __init__(self, config: EngineConfig, index: int) -> None:
        self.index = index
        self.engine = Engine(config)

    async def info(self) -> dict[str, Any]:
        return {**self.engine.info(), "replica": self.index, "pid": os.getpid()}

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       stream: bool) -> AsyncIterator[RequestOutput]:
        outputs = self.engine.generate_stream(prompt_ids, params, request_id=request_id, stream=stream)
        try:
            first = await outputs.__anext__()
        except ValueError as e:  # a user error the front did not catch
            yield RequestOutput(request_id=request_id, new_token_ids=[], new_text="", finished=True,
                                finish_reason=FinishReason.ERROR, error=str(e), user_error=True)
            return
        try:
            yield first
            async for out in outputs:
                yield out
        finally:  # the front went away (client disconnect): closing the stream aborts the request
            await outputs.aclose()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        stats = await asyncio.to_thread(self.engine.stats_snapshot)
        return {**stats, "replica": self.index, "pid": os.getpid()}

    def check_health(self) -> None:
        if self.engine.dead_reason is not None:  # the engine loop died: Serve replaces this replica
            raise RuntimeError(f"engine replica {self.index} is down: {self.engine.dead_reason}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
