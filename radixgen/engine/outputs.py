"""What a sampled token means for its request: stop checks, text deltas, output callbacks."""

from __future__ import annotations

import time
from typing import Any

from radixgen.engine.detokenizer import IncrementalDetokenizer
from radixgen.engine.request import FinishReason, Request, RequestOutput
from radixgen.engine.sampler import SampleResult


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...], max_context_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context_len = max_context_len
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, req: Request) -> None:
        self.detokenizers[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_ids, skip_special_tokens=req.params.skip_special_tokens,
            stop=req.params.stop,
        )

    def remove(self, req: Request) -> None:
        del self.detokenizers[req.request_id]

    def append_token(self, req: Request, token: int, result: SampleResult, row: int) -> FinishReason | None:
        """Record a sampled token; return why the request ends now, or None to go on."""
        params = req.params
        req.output_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if result.logprobs is not None and params.logprobs:
            req.output_logprobs.append(float(result.logprobs[row]))
        if result.top_ids is not None and result.top_logprobs is not None and params.top_logprobs:
            n = params.top_logprobs
            req.output_top_logprobs.append(
                list(zip(result.top_ids[row, :n].tolist(), result.top_logprobs[row, :n].tolist(), strict=True))
            )
        matcher = req.matcher
        if matcher is not None:
            if not matcher.accept(token):
                req.error = f"internal error: the constraint rejected token {token} that its mask allowed"
                return FinishReason.ERROR
            if matcher.is_terminated():
                return FinishReason.STOP  # the automaton accepted its stop token: output complete
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP  # the stop token's text is not part of the output
        detok = self.detokenizers[req.request_id]
        if self.tokenizer is not None:  # None in the trace simulator: no text at all
            detok.add_token(token)
        if detok.stopped:
            return FinishReason.STOP
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.max_context_len:
            return FinishReason.LENGTH
        return None

    def emit(self, req: Request, *, final: bool, has_new_token: bool) -> RequestOutput | None:
        """Hand a delta to the request's callback; non-streaming requests only get the end."""
        if not final and (not req.stream or req.on_output is None):
            return None
        detok = self.detokenizers[req.request_id]
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.output_ids[-1:] if has_new_token else [],
            new_text=detok.take_delta(final) if self.tokenizer is not None else "",
            finished=final,
            finish_reason=req.finish_reason,
            error=req.error,
            user_error=req.user_error,
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            new_logprobs=req.output_logprobs[-1:] if has_new_token and req.params.logprobs else None,
            new_top_logprobs=req.output_top_logprobs[-1:] if has_new_token and req.params.top_logprobs else None,
            output_ids=list(req.output_ids) if final else None,
            text=detok.text if final else None,
        )
        if req.on_output is not None:
            req.on_output(out)
        return out
