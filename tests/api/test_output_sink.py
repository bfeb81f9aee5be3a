"""The sink a streaming route reads its engine requests' outputs from."""

from __future__ import annotations

import asyncio

from radixgen.engine.output import RequestOutput
from radixgen.ipc.handle import OutputSink, pump_into


def _out(rid: str, text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [1], text, finished)


def test_take_returns_everything_that_arrived_together_and_none_after_quiet() -> None:
    async def scenario() -> None:
        sink = OutputSink()
        assert await sink.take(0.01) is None  # quiet: the caller sends a keep-alive
        sink.put(0, _out("a", "x"))
        sink.put(1, _out("b", "y"))
        sink.put(0, _out("a", "z"))
        assert [(tag, out.new_text) for tag, out in await sink.take(1.0) or []] == [(0, "x"), (1, "y"), (0, "z")]

        async def later() -> None:
            await asyncio.sleep(0.01)
            sink.put(1, _out("b", "w", finished=True))

        task = asyncio.create_task(later())
        started = asyncio.get_running_loop().time()
        got = await sink.take(5.0)  # woken by the put, not by the timeout
        assert got is not None and got[0][1].finished
        assert asyncio.get_running_loop().time() - started < 1.0
        await task

    asyncio.run(scenario())


def test_a_pumped_iterator_delivers_its_failure_and_closes_when_cancelled() -> None:
    closed: list[bool] = []

    async def outputs(fail: bool):  # type: ignore[no-untyped-def]
        try:
            yield _out("a", "x")
            if fail:
                raise RuntimeError("replica gone")
            await asyncio.sleep(60)
            yield _out("a", "never")
        finally:
            closed.append(True)

    async def scenario() -> None:
        sink = OutputSink()
        await pump_into(sink, 3, outputs(fail=True))
        items = await sink.take(1.0) or []
        assert [tag for tag, _ in items] == [3, 3]
        assert isinstance(items[1][1], RuntimeError)
        task = asyncio.create_task(pump_into(sink, 4, outputs(fail=False)))
        assert (await sink.take(1.0) or [])[0][1].new_text == "x"
        task.cancel()  # the route went away: the iterator is closed (aborting the request)
        await asyncio.gather(task, return_exceptions=True)
        assert closed == [True, True]

    asyncio.run(scenario())
