"""The naive baseline users start with: an OpenAI-compatible endpoint over transformers'
``model.generate`` with static batches.

Requests that arrive while a batch runs wait for the next one; a batch is left-padded, generated
to its longest ``max_tokens``, and each answer is sent when the batch ends (``generate`` cannot
stream a batch), so time to first token is the whole batch's time.

    python benchmarks/peers/transformers_server.py --model DIR --port 8001 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer

MAX_BATCH = 32


def build_app(model_dir: str, dtype: str) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    queue: asyncio.Queue[tuple[dict[str, Any], asyncio.Future[tuple[str, int]]]] = asyncio.Queue()
    app = FastAPI()

    def generate(bodies: list[dict[str, Any]]) -> list[tuple[str, int]]:
        prompts = [tokenizer.apply_chat_template(b["messages"], tokenize=False, add_generation_prompt=True)
                   for b in bodies]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        max_new = max(int(b.get("max_tokens") or 128) for b in bodies)
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False,
                                 min_new_tokens=max_new if all(b.get("ignore_eos") for b in bodies) else 0,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        results = []
        for body, row in zip(bodies, out[:, inputs["input_ids"].shape[1]:], strict=True):
            ids = row[: int(body.get("max_tokens") or 128)].tolist()
            results.append((tokenizer.decode(ids, skip_special_tokens=True), len(ids)))
        return results

    async def batcher() -> None:
        while True:
            batch = [await queue.get()]
            while not queue.empty() and len(batch) < MAX_BATCH:
                batch.append(queue.get_nowait())
            try:
                results = await asyncio.to_thread(generate, [b for b, _ in batch])
            except Exception as e:  # noqa: BLE001 - reported to every waiting request
                for _, future in batch:
                    future.set_exception(e)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                future.set_result(result)

    @app.on_event("startup")
    async def start() -> None:
        asyncio.get_running_loop().create_task(batcher())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        future: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
        await queue.put((body, future))
        text, tokens = await future
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:12]}", int(time.time())
        usage = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
        if not body.get("stream"):
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": "baseline",
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": "length"}], "usage": usage})

        async def events() -> Any:
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": "baseline",
                     "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "length"}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    uvicorn.run(build_app(args.model, args.dtype), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
