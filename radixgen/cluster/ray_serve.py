"""Scale-out on Ray Serve: N engine replicas (one Serve application each) behind the same
OpenAI-compatible front as the single-node server, with prefix-affinity routing.

The front (FastAPI, in the ``radixgen serve`` process) keeps its routes; only its engine client
changes: ``ClusterClient`` is an ``EngineHandle`` (the front's engine interface) and routes each request to a
replica's Serve handle. One application per replica, rather than one deployment with N
replicas, because the router must choose the replica (Serve's own router balances load but
does not know prefixes). Serve restarts a replica that dies; the requests it was serving get
an error (HTTP 503 or an SSE error event), the router stops sending to it until it answers
again, and forgets which prefixes it held (the new replica starts with an empty cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from radixgen.cluster.routing import UNAVAILABLE, Router, make_router
from radixgen.config import EngineConfig, ServerConfig
from radixgen.engine.output import RequestOutput
from radixgen.engine.params import SamplingParams
from radixgen.errors import EngineDeadError, OverloadedError
from radixgen.ipc.handle import OutputSink, pump_into

logger = logging.getLogger(__name__)

APP_PREFIX = "radixgen-engine-"
_PROBE_PERIOD_S = 1.0


def _ray() -> Any:
    try:
        import ray
        from ray import serve  # noqa: F401 - Serve is part of the extra
    except ImportError as e:
        raise ImportError("--replicas and --ray-address need Ray Serve: pip install 'radixgen[ray]'") from e
    return ray


def start_replicas(config: ServerConfig) -> list[Any]:
    """Connect to (or start, on loopback) a Ray cluster and deploy ``config.replicas`` engines;
    returns their Serve handles."""
    ray = _ray()
    from ray import serve

    from radixgen.cluster.replica import EngineReplica

    if not ray.is_initialized():
        if config.ray_address:
            ray.init(address=config.ray_address, log_to_driver=False)
        else:  # a private local cluster, reachable only from this machine
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"location": "NoServer"})  # our own front serves HTTP
    threads = config.num_threads
    if threads is None and not config.ray_address:  # replicas share this machine's cores
        from radixgen.engine.model_runner import available_cores

        threads = max(1, available_cores() // config.replicas)
    engine_config = EngineConfig(**{f: getattr(config, f) for f in EngineConfig.field_names()})
    engine_config = replace(engine_config, num_threads=threads)
    # Ray's CPU accounting: on our own machine the replicas split its cores (fractions are fine);
    # on a cluster each replica asks for the threads it will run
    cpus = float(threads or 1) if config.ray_address else ray.cluster_resources().get("CPU", 1.0) / config.replicas
    resources: dict[str, float] = {"num_cpus": cpus}
    if config.device.startswith("cuda"):
        resources["num_gpus"] = 1.0
    from ray.serve.api import RunTarget

    apps = [RunTarget(EngineReplica.options(  # type: ignore[attr-defined]  # serve.deployment makes it a Deployment
        name=f"engine-{i}", ray_actor_options=resources).bind(engine_config, i), name=f"{APP_PREFIX}{i}",
        route_prefix=None) for i in range(config.replicas)]
    # deployed together, so the replicas load their models at the same time (one serve.run each
    # waited for the replica before it)
    return list(serve.run_many(apps))


def stop_replicas(num_replicas: int, *, shared_cluster: bool) -> None:
    """Remove our replicas. On a shared cluster only our applications go (Serve and Ray keep
    running for others); the private local Ray is shut down whole, which removes them too."""
    ray = _ray()
    from ray import serve

    if shared_cluster:
        for i in range(num_replicas):
            with contextlib.suppress(Exception):
                serve.delete(f"{APP_PREFIX}{i}")
    else:
        serve.shutdown()
    ray.shutdown()


class ClusterClient:
    """The front's ``EngineHandle`` over N replica handles."""

    def __init__(self, config: ServerConfig, handles: list[Any], router: Router | None = None) -> None:
        self.config = config
        self.handles = handles
        self.router = router or make_router(config.routing)
        self.in_flight = [0] * len(handles)
        self.routed = [0] * len(handles)
        self.down: dict[int, str] = {}  # replica -> why it is not being routed to
        self.info: dict[str, Any] = {}
        self.dead_reason: str | None = "replicas not started"
        self._probe: asyncio.Task[None] | None = None
        self.num_restarts = 0
        self._pumps: dict[str, asyncio.Task[None]] = {}

    async def start(self, timeout: float = 600.0) -> None:
        infos = await asyncio.wait_for(asyncio.gather(*(h.info.remote() for h in self.handles)), timeout)
        self.info = {**infos[0], "replicas": len(self.handles)}
        self.dead_reason = None
        self._probe = asyncio.create_task(self._probe_down_replicas())

    async def shutdown(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        await asyncio.to_thread(stop_replicas, len(self.handles), shared_cluster=bool(self.config.ray_address))

    @property
    def is_healthy(self) -> bool:
        return len(self.down) < len(self.handles)

    @property
    def num_in_flight(self) -> int:
        return sum(self.in_flight)

    @property
    def engine_pid(self) -> int | None:
        return None  # several processes: /internal/stats lists each replica's pid

    def _loads(self) -> list[int]:
        return [UNAVAILABLE if i in self.down else load for i, load in enumerate(self.in_flight)]

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, stream: bool = True
    ) -> AsyncIterator[RequestOutput]:
        replica = self._route(prompt_ids)
        try:
            async for out in self._outputs(replica, request_id, prompt_ids, params, stream):
                yield out
        finally:
            self.in_flight[replica] -= 1

    def _route(self, prompt_ids: list[int]) -> int:
        """The replica that serves a new request (counted in flight there until the caller says it
        ended); raises when none may."""
        if not self.is_healthy:
            raise EngineDeadError("no engine replica is available: " + "; ".join(self.down.values()))
        if self.num_in_flight >= self.config.max_queued_requests * len(self.handles):
            raise OverloadedError(f"{self.num_in_flight} requests in flight across {len(self.handles)} replicas")
        replica = self.router.choose(prompt_ids, self._loads())
        self.in_flight[replica] += 1
        self.routed[replica] += 1
        return replica

    async def _outputs(self, replica: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       stream: bool) -> AsyncIterator[RequestOutput]:
        finished = False
        responses = self.handles[replica].options(stream=True).generate.remote(request_id, prompt_ids, params, stream)
        try:
            async for out in responses:
                finished = out.finished
                yield out
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - Ray reports a dead replica with several exception types
            self._mark_down(replica, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            raise EngineDeadError(f"engine replica {replica} failed while serving this request; retry") from None
        finally:
            if not finished:
                responses.cancel()
                if replica not in self.down:  # the client went away: free the replica's slots now
                    with contextlib.suppress(Exception):
                        self.handles[replica].abort.remote(request_id)

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: OutputSink,
                     tag: int) -> None:
        if request_id in self._pumps:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = self._route(prompt_ids)  # a refusal raises here, as submit promises
        task = asyncio.create_task(pump_into(sink, tag, self._outputs(replica, request_id, prompt_ids, params, True)))
        self._pumps[request_id] = task

        def ended(_: asyncio.Task[None]) -> None:  # also when cancelled before it ran
            self._pumps.pop(request_id, None)
            self.in_flight[replica] -= 1

        task.add_done_callback(ended)

    async def abort(self, request_id: str) -> None:
        task = self._pumps.pop(request_id, None)
        if task is not None:
            task.cancel()  # closes the replica's stream, which aborts the request there

    def _mark_down(self, replica: int, reason: str) -> None:
        if replica not in self.down:
            logger.error("engine replica %d is down (%s); routing around it until it answers", replica, reason)
            self.down[replica] = f"replica {replica}: {reason}"
            self.router.forget_replica(replica)  # Serve restarts it with an empty cache

    async def _probe_down_replicas(self) -> None:
        """Route to a replica again once Serve has it back up."""
        while True:
            await asyncio.sleep(_PROBE_PERIOD_S)
            for replica in list(self.down):
                try:
                    await asyncio.wait_for(self.handles[replica].info.remote(), 5.0)
                except Exception:  # noqa: BLE001 - still restarting
                    continue
                logger.warning("engine replica %d is back", replica)
                self.down.pop(replica, None)
                self.num_restarts += 1

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """Cluster totals, plus ``replicas``: each live replica's own counters."""
        async def one(i: int) -> dict[str, Any] | None:
            if i in self.down:
                return None
            try:
                return dict(await asyncio.wait_for(self.handles[i].stats.remote(), timeout))
            except Exception:  # noqa: BLE001 - a replica that does not answer is left out
                return None

        per_replica = [s for s in await asyncio.gather(*(one(i) for i in range(len(self.handles)))) if s]
        for s in per_replica:
            s["routed_requests"] = self.routed[s["replica"]]
        totals: dict[str, Any] = {"replicas": per_replica, "routing": self.router.name, "time": time.time()}
        for key in ("free", "held_by_requests", "held_by_tree", "pool_size", "active_requests", "queue_depth",
                    "running", "num_steps", "prompt_tokens", "cached_prompt_tokens", "generated_tokens",
                    "num_retractions", "schedule_time_s", "forward_time_s"):
            totals[key] = sum(s.get(key, 0) for s in per_replica)
        totals["cache_hit_rate"] = totals["cached_prompt_tokens"] / max(totals["prompt_tokens"], 1)
        for key in ("avg_batch_size", "avg_decode_batch_size"):
            totals[key] = sum(s.get(key, 0) for s in per_replica) / max(len(per_replica), 1)
        return totals
