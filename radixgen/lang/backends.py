"""Where a program's generations run: an in-process ``Runtime`` or a server's ``Endpoint``.

Both take the same sampling parameters (SamplingParams field names) and return the same
``GenResult``, so a program runs unchanged on either; with the same seeds, the outputs are the
same because the same engine computes them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from radixgen.errors import InvalidParamsError
from radixgen.templates import RoleMarkers, role_markers

Prompt = str | list[int]
OnText = Callable[[str], None]


@dataclass
class GenResult:
    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    """request_id, finish_reason, prompt_tokens, completion_tokens, cached_tokens, shortened, and
    constraint (the constraint's report as a dict: ``radixgen.constraints.report``; None when
    unconstrained)."""
    prompt_logprobs: list[float] | None = None


class Backend:
    """What a program needs from a model server."""

    def generate(self, prompt: Prompt, params: dict[str, Any], on_text: OnText | None = None) -> GenResult:
        raise NotImplementedError

    def generate_batch(self, prompts: Sequence[Prompt], params: Sequence[dict[str, Any]]) -> list[GenResult]:
        raise NotImplementedError

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        raise NotImplementedError

    @cached_property
    def markers(self) -> RoleMarkers:
        return self._markers()

    def _markers(self) -> RoleMarkers:
        raise NotImplementedError

    def cache_prefix(self, prompt: Prompt) -> None:
        """Prefill ``prompt`` alone so that requests sent next, together, find it in the cache
        (requests admitted in one step cannot share what none of them has computed yet)."""
        if prompt:
            self.generate(prompt, {"max_new_tokens": 1, "temperature": 0.0})

    def score_choices(self, prefix: str, choices: Sequence[str]) -> list[GenResult]:
        """Score each choice after ``prefix``: its ``prompt_logprobs`` are the choice's tokens.

        The prefix is prefilled once on its own, so the choices' requests find it in the radix
        cache; each choice is then scored from where its tokens part from the prefix's (a choice
        may merge with the prefix's last token)."""
        ids = self.tokenize([prefix, *(prefix + c for c in choices)])
        prefix_ids = ids[0]
        self.cache_prefix(prefix_ids)
        jobs = []
        for full in ids[1:]:
            shared = next((i for i, (a, b) in enumerate(zip(prefix_ids, full, strict=False)) if a != b),
                          min(len(prefix_ids), len(full)))
            jobs.append({"max_new_tokens": 1, "temperature": 0.0,
                         "prompt_logprob_start": max(1, min(shared, len(full) - 1))})
        results = self.generate_batch(ids[1:], jobs)
        if any(r.prompt_logprobs is None for r in results):
            raise RuntimeError("the backend did not return prompt log-probabilities; is it a radixgen server?")
        return results

    def close(self) -> None:
        pass

    def shutdown(self) -> None:
        """``close`` under the name SGLang's ``Runtime`` and radixgen's ``Engine`` use."""
        self.close()

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Runtime(Backend):
    """An Engine in this process: ``Runtime()`` loads the bundled model; keywords are
    EngineConfig fields (``Runtime(model="path", dtype="bfloat16")``)."""

    def __init__(self, model: str | None = None, *, engine: Any = None, **engine_options: Any) -> None:
        """``engine=`` wraps an Engine you already have (it is not shut down by ``close``)."""
        from radixgen.engine.engine import Engine

        self._owns_engine = engine is None
        self.engine = engine if engine is not None else Engine(model=model, **engine_options)

    def _params(self, params: dict[str, Any]) -> Any:
        from radixgen.engine.params import SamplingParams

        return SamplingParams(**params)

    @staticmethod
    def _result(out: Any) -> GenResult:
        """A GenerationOutput or a final RequestOutput -> GenResult."""
        if out.error is not None:
            raise (InvalidParamsError if getattr(out, "user_error", False) else RuntimeError)(out.error)
        meta = {"request_id": out.request_id, "finish_reason": out.finish_reason.value,
                "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "cached_tokens": out.cached_tokens, "shortened": bool(getattr(out, "shortened", False)),
                "constraint": out.constraint.to_dict() if getattr(out, "constraint", None) is not None else None}
        return GenResult(out.text or "", meta, out.prompt_logprobs)

    def generate(self, prompt: Prompt, params: dict[str, Any], on_text: OnText | None = None) -> GenResult:
        sampling = self._params(params)
        if on_text is None:
            return self._result(self.engine.generate(prompt, sampling))
        with contextlib.closing(self.engine.iter_outputs(prompt, sampling)) as outputs:  # an error in on_text aborts
            for out in outputs:
                if out.new_text:
                    on_text(out.new_text)
        return self._result(out)

    def generate_batch(self, prompts: Sequence[Prompt], params: Sequence[dict[str, Any]]) -> list[GenResult]:
        outs = self.engine.generate(list(prompts), [self._params(p) for p in params])
        return [self._result(out) for out in outs]

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.engine.tokenize(text) for text in texts]

    def _markers(self) -> RoleMarkers:
        return role_markers(self.engine.tokenizer)

    def close(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()


class Endpoint(Backend):
    """A running ``radixgen serve``, through its native ``/generate`` route."""

    def __init__(self, base_url: str = "http://127.0.0.1:30000", *, api_key: str | None = None,
                 timeout: float = 600.0, max_parallel: int = 64) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="radixgen-endpoint")

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        import httpx

        try:
            response = self._http.post(path, json=body)
        except httpx.TransportError as e:
            raise ConnectionError(f"cannot reach the radixgen server at {self.base_url}: {e}") from e
        return self._json(response)

    @staticmethod
    def _json(response: Any) -> Any:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            error = InvalidParamsError if response.status_code in (400, 413, 422) else RuntimeError
            raise error(f"server answered {response.status_code}: {message}")
        return response.json()

    @staticmethod
    def _wire_params(params: dict[str, Any]) -> dict[str, Any]:
        wire = dict(params)
        if wire.get("validators"):
            raise InvalidParamsError("validators are Python callables and run in-process only: use Runtime, "
                                     "or check the value after the program ran")
        wire.pop("validators", None)
        schema = wire.get("json_schema")
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            wire["json_schema"] = schema.model_json_schema()
        return wire

    @staticmethod
    def _body(prompt: Prompt, params: dict[str, Any], stream: bool) -> dict[str, Any]:
        key = "text" if isinstance(prompt, str) else "input_ids"
        return {key: prompt, "sampling_params": Endpoint._wire_params(params), "stream": stream}

    def generate(self, prompt: Prompt, params: dict[str, Any], on_text: OnText | None = None) -> GenResult:
        if on_text is None:
            data = self._post("/generate", self._body(prompt, params, False))
            meta = data["meta"]
            return GenResult(data["text"], meta, meta.get("prompt_logprobs"))
        return self._stream(prompt, params, on_text)

    def _stream(self, prompt: Prompt, params: dict[str, Any], on_text: OnText) -> GenResult:
        import httpx

        text, meta = "", {}
        try:
            with self._http.stream("POST", "/generate", json=self._body(prompt, params, True)) as response:
                if response.status_code >= 400:
                    response.read()
                    self._json(response)
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        error = InvalidParamsError if event["error"].get("code") == 400 else RuntimeError
                        raise error(event["error"].get("message", "generation failed"))
                    if event["text"]:
                        text += event["text"]
                        on_text(event["text"])
                    meta = event["meta"]
        except httpx.TransportError as e:
            raise ConnectionError(f"cannot reach the radixgen server at {self.base_url}: {e}") from e
        return GenResult(text, meta, meta.get("prompt_logprobs"))

    def generate_batch(self, prompts: Sequence[Prompt], params: Sequence[dict[str, Any]]) -> list[GenResult]:
        futures = [self._pool.submit(self.generate, p, q) for p, q in zip(prompts, params, strict=True)]
        return [f.result() for f in futures]

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return list(self._post("/tokenize", {"text": list(texts)})["tokens"])

    def _markers(self) -> RoleMarkers:
        import httpx

        try:
            info = self._json(self._http.get("/model_info"))
        except httpx.TransportError as e:
            raise ConnectionError(f"cannot reach the radixgen server at {self.base_url}: {e}") from e
        if info.get("chat_roles") is None:
            raise ValueError("the server's model has no chat template; role blocks need one")
        return RoleMarkers.from_json(info["chat_roles"])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
