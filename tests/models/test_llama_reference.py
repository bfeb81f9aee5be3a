"""Our model's logits equal transformers' on the same weights, through the KV pool.

Tolerance: fp32 logits agree to 2e-4 absolute on the tiny models (their logits are O(1)) and to
2e-3 on SmolLM2-135M (30 layers; different matmul kernels accumulate in different orders).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixgen.models import ModelConfig, build_model
from radixgen.models.attention.cpu import CpuAttention
from tests.conftest import make_tiny_hf_model
from tests.models.harness import PATHS, harness_for

TINY_CASES = {
    "llama": dict(kind="llama"),
    "qwen2-bias": dict(kind="qwen2"),
    "llama-untied": dict(kind="llama", tie_word_embeddings=False),
    "llama3-rope": dict(kind="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear-rope": dict(kind="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mha-head-dim": dict(kind="llama", num_key_value_heads=4, head_dim=32),
}


def ours_from_hf(hf_model: Any) -> Any:
    cfg = ModelConfig.from_hf(hf_model.config)
    return build_model(cfg, hf_model.state_dict(), dtype=torch.float32)


@torch.no_grad()
def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_tiny_prefill_and_decode_match_transformers(case: str, path: str) -> None:
    spec = dict(TINY_CASES[case])
    hf = make_tiny_hf_model(spec.pop("kind"), seed=1, **spec)
    ours = ours_from_hf(hf)
    assert ours.config.attention_bias == (case == "qwen2-bias")
    ids = _prompt(0, 90)
    ref = hf_logits(hf, ids)
    harness = harness_for(ours, path)
    # prefill 80 tokens, then decode the rest one token per step through the pool
    (prefill,) = harness.extend([(0, ids[:80])])
    torch.testing.assert_close(prefill, ref[:80], atol=2e-4, rtol=0)
    for i in range(80, 90):
        (step,) = harness.extend([(0, [ids[i]])])
        torch.testing.assert_close(step[0], ref[i], atol=2e-4, rtol=0)
    assert ref.abs().max() > 0.5, "logits too small for the tolerance to mean anything"


@pytest.mark.parametrize("path", PATHS)
def test_batched_extend_with_cached_prefixes_matches_transformers(path: str) -> None:
    """Requests of different lengths in one step, some extending a cached prefix; decode steps
    of one, two and three requests (the native path changes linear kernels at two tokens)."""
    hf = make_tiny_hf_model("qwen2", seed=2)
    harness = harness_for(ours_from_hf(hf), path)
    a, b, c = _prompt(1, 40), _prompt(2, 75), _prompt(3, 9)
    harness.extend([(0, a[:30]), (1, b[:50])])
    outs = harness.extend([(0, a[30:]), (1, b[50:]), (2, c)])  # extend, extend, fresh prefill
    for out, ids, start in zip(outs, (a, b, c), (30, 50, 0), strict=True):
        torch.testing.assert_close(out, hf_logits(hf, ids)[start:], atol=2e-4, rtol=0)
    seqs = [a, b, c]
    for rows in ([0, 1, 2], [0, 1], [2]):  # decode batches of mixed lengths, 3 / 2 / 1 tokens
        decode = harness.extend([(r, [5 + r]) for r in rows])
        for out, r in zip(decode, rows, strict=True):
            seqs[r] = seqs[r] + [5 + r]
            torch.testing.assert_close(out[0], hf_logits(hf, seqs[r])[-1], atol=2e-4, rtol=0)


@pytest.mark.real_model
def test_smollm2_logits_match_transformers(default_model_dir: Any, tokenizer: Any) -> None:
    from transformers import AutoModelForCausalLM

    from radixgen.models import load_model

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ours = load_model(str(default_model_dir)).model
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three uses of a radix tree."}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    ref = hf_logits(hf, ids)
    harness = harness_for(ours, "native")  # the engine's default path on CPU
    (prefill,) = harness.extend([(0, ids[:-4])])
    torch.testing.assert_close(prefill, ref[:-4], atol=2e-3, rtol=0)
    for i in range(len(ids) - 4, len(ids)):
        (step,) = harness.extend([(0, [ids[i]])])
        torch.testing.assert_close(step[0], ref[i], atol=2e-3, rtol=0)


def test_the_converted_default_model_is_a_plain_hf_checkpoint(default_model_dir: Any) -> None:
    """Other engines (vLLM in the serving comparison) and transformers load the converted GGUF
    as an ordinary float32 checkpoint: no quantization entry left, the architecture named."""
    import json

    from transformers import AutoConfig

    config = json.loads((default_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert AutoConfig.from_pretrained(default_model_dir).architectures == ["LlamaForCausalLM"]


def test_decode_rows_sharing_a_cached_prefix_attend_it_once_and_match_transformers() -> None:
    """Rows whose pool rows begin with the same slots (as the radix tree shares a system prompt)
    decode with the prefix attended once for the group (bf16, AVX-512 BF16 only): logits within
    1.5x transformers' own bf16 error of the float32 reference, as the bf16 family tests hold."""
    import copy

    hf = make_tiny_hf_model("llama", seed=4, head_dim=64)
    ours = build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=torch.bfloat16)
    harness = harness_for(ours, "native")
    attention = harness.attention
    assert isinstance(attention, CpuAttention)
    if attention.shared_prefix_kernel is None:
        pytest.skip("shared-prefix attention needs bf16 dot products (AVX-512 BF16)")
    calls = []
    kernel = attention.shared_prefix_kernel
    attention.shared_prefix_kernel = lambda *args: calls.append(args[5].clone()) or kernel(*args)
    prefix = _prompt(5, 150)
    (_,) = harness.extend([(0, prefix)])
    for row in (1, 2, 3):  # share row 0's prefix slots
        harness.pool.req_to_token[row, :150] = harness.pool.req_to_token[0, :150]
        harness.lengths[row] = 150
    seqs = [prefix + _prompt(10 + r, 5 + 9 * r) for r in range(4)]
    harness.extend([(r, seqs[r][150:]) for r in range(4)])
    ours_logits: list[list[torch.Tensor]] = [[] for _ in range(4)]
    for step in range(3):
        for r, out in enumerate(harness.extend([(r, [100 + step + r]) for r in range(4)])):
            seqs[r] = seqs[r] + [100 + step + r]
            ours_logits[r].append(out[0].float())
    assert calls and all(c.tolist() == [150] * 4 for c in calls)

    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for r in range(4):
        ref = hf_logits(hf, seqs[r])[-3:]
        hf_error = (hf_logits(hf_bf16, seqs[r])[-3:] - ref).abs().max().item()
        our_error = (torch.stack(ours_logits[r]) - ref).abs().max().item()
        assert our_error <= 1.5 * hf_error + 0.02, (r, our_error, hf_error)
