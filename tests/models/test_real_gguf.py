"""A real model as users bring it: Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF (Q5_0, Q8_0, Q4_K
and Q6_K tensors; ``radixgen/models/packaged_models.py``), run with its blocks as they are.

Greedy output equals a float32 model built from the gguf package's own dequantization of the same
file (an implementation independent of the repacking and the kernels); a JSON-schema extraction is
answered right; the server runs on it; memory follows the file and nothing of it is copied to
disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from radixgen.models.packaged_models import real_model_gguf

pytestmark = pytest.mark.real_model

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "What does HTTP status 404 mean? Answer in one sentence.",
           "Explain what a hash map is to a beginner."]
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    return real_model_gguf()


def _greedy(model: Any, ids: list[int], kernels: Any) -> list[int]:
    from tests.models.harness import PoolHarness

    harness = PoolHarness(model, attention_kernels=kernels, max_context_len=512)
    logits = harness.extend([(0, ids)])[0][-1]
    out: list[int] = []
    for _ in range(GREEDY_TOKENS):
        out.append(int(logits.argmax()))
        logits = harness.extend([(0, [out[-1]])])[0][-1]
    return out


def test_greedy_output_equals_the_float_reference(real_gguf: Path, kernels: Any) -> None:
    from radixgen.models import build_model, load_model
    from radixgen.models.gguf_weights import RECORD_KINDS, GGUFTensor, read_gguf

    ours = load_model(real_gguf, dtype="float32")
    kinds = {w for m in ours.model.modules() for w in getattr(m, "kinds", ())}
    assert kinds == {RECORD_KINDS[name] for name in ("Q5_0", "Q6_K", "Q8_0", "Q4_K")}, \
        "Q5_0, Q6_K, Q8_0 and Q4_K run as records of their own kinds"
    assert ours.model.embed.numel() == 0, "no float embedding"
    from transformers import AutoConfig

    state, _ = read_gguf(real_gguf, ours.config, None, AutoConfig.from_pretrained(ours.path))
    floats = {name: v.floats() if isinstance(v, GGUFTensor) else v for name, v in state.items()}
    reference = build_model(ours.config, floats, dtype=torch.float32)
    del floats, state
    tok = ours.tokenizer
    for prompt in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        assert _greedy(ours.model, ids, kernels) == _greedy(reference, ids, kernels), prompt


def test_the_tokenizer_read_as_it_is_equals_its_family_class(real_gguf: Path) -> None:
    """The converted folder's tokenizer.json, read by the shared fast class (as every start reads
    it), tokenizes, decodes and templates as transformers' Qwen2 class does."""
    from transformers import AutoTokenizer

    from radixgen.models.loader import load_tokenizer, resolve_model_dir

    folder = resolve_model_dir(real_gguf, float_weights=False)
    ours, family = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(family).__name__ == "Qwen2Tokenizer" and type(ours) is not type(family)
    texts = [*PROMPTS, "def f(x):\n\treturn x ** 2  # 平方\n", "<|im_start|>user\nhi<|im_end|>\n",
             '{"total": 1234.50, "items": ["a", "b"]}', "  leading and trailing  ", "émojis 🙂 and ünïcode"]
    for text in texts:
        assert ours.encode(text) == family.encode(text), text
        assert ours.decode(family.encode(text)) == family.decode(family.encode(text)), text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        family.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.pad_token_id, ours.all_special_ids, len(ours)) == \
        (family.eos_token_id, family.pad_token_id, family.all_special_ids, len(family))


def test_an_extraction_is_answered_right_and_memory_follows_the_file(real_gguf: Path) -> None:
    import jsonschema

    from radixgen import Engine, EngineConfig, SamplingParams
    from radixgen.models.loader import resolve_model_dir
    from radixgen.paths import cache_dir

    engine = Engine(EngineConfig(model=str(real_gguf), kv_cache_tokens=4096, max_context_len=2048))
    try:
        weights = engine.runner.model.weight_bytes() if hasattr(engine, "runner") else None
        schema = {"type": "object", "properties": {
            "invoice_id": {"type": "string"}, "customer": {"type": "string"}, "total_eur": {"type": "number"},
            "due": {"type": "string", "format": "date"}},
            "required": ["invoice_id", "customer", "total_eur", "due"], "additionalProperties": False}
        document = ("Invoice INV-2291 was issued to Harbor Foods Ltd on 3 March 2025. The total of "
                    "1,840.50 EUR is due on 2025-04-02.")
        ids = engine.apply_chat_template([{"role": "user", "content": f"Extract the invoice fields as JSON.\n\n{document}"}])
        out = engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=96, json_schema=schema))
        answer = json.loads(out.text)
        jsonschema.validate(answer, schema)
        assert answer["invoice_id"] == "INV-2291" and "Harbor Foods" in answer["customer"]
        assert answer["total_eur"] == 1840.5 and answer["due"] == "2025-04-02"
        assert "4/5/6/8-bit blocks" in engine.info()["weights"]
        if weights is not None:
            assert weights <= 1.25 * real_gguf.stat().st_size
    finally:
        engine.shutdown()
    folder = resolve_model_dir(real_gguf, float_weights=False)
    assert folder.is_relative_to(cache_dir())
    # model.safetensors: only what weights="float" writes, if it was ever asked for on this file
    held = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.name != "model.safetensors")
    assert held <= 0.05 * real_gguf.stat().st_size, "config, tokenizer and index only: no copy of the weights"


def test_the_server_answers_a_schema_request_on_it(real_gguf: Path) -> None:
    from openai import OpenAI

    from tests.api.conftest import LiveServer

    server = LiveServer(["--model", str(real_gguf), "--kv-cache-tokens", "4096", "--max-context-len", "2048",
                         "--served-model-name", "coder"])
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        schema = {"type": "object", "properties": {"language": {"type": "string", "enum": ["python", "rust", "go"]},
                                                    "lines": {"type": "integer"}},
                  "required": ["language", "lines"], "additionalProperties": False}
        reply = client.chat.completions.create(
            model="coder", temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": "This snippet is `fn main() { println!(\"hi\"); }`. "
                                                  "Which language is it, and how many lines?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "snippet", "schema": schema}})
        answer = json.loads(reply.choices[0].message.content or "")
        assert answer["language"] == "rust" and answer["lines"] == 1
        assert reply.choices[0].finish_reason == "stop"
    finally:
        server.stop()
