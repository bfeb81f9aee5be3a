"""Would 8-bit activations (W8A8 through FBGEMM's dynamic int8 linear) make large CPU steps faster
without changing the answers? The probe behind issue 43's "integer large-batch path" question.

Two measurements, one process:

1. the linears of the bundled model's shapes (the four decoder linears and the LM head) at
   ``--rows`` rows: oneDNN fp32 over a packed dense copy, radixgen's quantized blocks (the
   default holding), and ``torch.ops.quantized.linear_dynamic`` over per-channel int8 weights,
   its activations quantized per tensor as it does, and per token (each row scaled to [-1, 1]
   first, the scale multiplied back after);
2. greedy answers to 64 chat prompts (64 new tokens each) with every linear step of 16+ tokens
   on a dense fp32 copy and on each int8 variant, against the blocks: how many answers stay identical, and the mean
   index of the first differing token.

    python benchmarks/probe_int8_activations.py [--rows 64,512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import chat_prompts, first_differences, print_table, write_json  # noqa: E402
from radixgen import Engine, EngineConfig, SamplingParams  # noqa: E402
from radixgen.models.layers import Linear  # noqa: E402
from radixgen.models.quantized import QuantizedLinear  # noqa: E402


class DynamicInt8Linear(nn.Module):
    """y = x @ W.T + b on FBGEMM/oneDNN's u8 x s8 GEMM: W per output channel in int8, x quantized
    on the fly (7-bit range, so AVX2's saturating u8 x s8 pair sums cannot overflow)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, per_token: bool) -> None:
        super().__init__()
        w = weight.float()
        scale = (w.abs().amax(1).clamp_min(1e-12) / 127).double()
        qw = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())
        self.per_token = per_token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.per_token:
            return torch.ops.quantized.linear_dynamic(x, self.packed, True)
        row_scale = x.abs().amax(1, keepdim=True).clamp_min(1e-12)
        return torch.ops.quantized.linear_dynamic(x / row_scale, self.packed, True) * row_scale


def timed_ms(fn: Any, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        samples.append((time.perf_counter() - start) / repeats * 1e3)
    return min(samples)


def linear_rates(engine: Engine, rows_list: list[int]) -> list[dict[str, Any]]:
    model = engine.runner.model
    layer = model.decoder_layers()[0]
    linears = {name: m for name, m in layer.named_modules() if isinstance(m, QuantizedLinear)}
    head = model.lm_head if isinstance(model.lm_head, QuantizedLinear) else model.quantized_embed.head
    linears["lm_head"] = head
    out = []
    for rows in rows_list:
        for name, q in linears.items():
            w = q.weight_q.dequantize(torch.float32)
            dense = Linear(q.in_features, q.out_features, False, torch.float32)
            dense.weight.data = w
            dense.pack(keep_plain=False)
            x = torch.randn(rows, q.in_features)
            ref = x @ w.T
            row: dict[str, Any] = {"rows": rows, "linear": name, "shape": f"{q.in_features}x{q.out_features}"}
            fp32 = timed_ms(lambda d=dense, x=x: d(x))
            blocks = timed_ms(lambda q=q, x=x: q(x))
            row |= {"fp32_ms": fp32, "blocks_ms": blocks}
            for label, per_token in (("int8_tensor", False), ("int8_token", True)):
                m = DynamicInt8Linear(w, None, per_token)
                row[f"{label}_ms"] = timed_ms(lambda m=m, x=x: m(x))
                row[f"{label}_relerr"] = float((m(x) - ref).norm() / ref.norm())
            row["fp32_over_int8"] = fp32 / row["int8_tensor_ms"]
            out.append(row)
    return out


def answers(engine: Engine, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def set_large_steps(engine: Engine, holding: str | None) -> None:
    """Steps of 16+ tokens on another holding of each quantized linear's weight: "dense_fp32"
    (the copy tuning may switch to), "int8_tensor" or "int8_token"; None: every step on the blocks."""
    for m in engine.runner.model.modules():
        if not isinstance(m, QuantizedLinear):
            continue
        m.drop_dense()
        if holding == "dense_fp32":
            m.add_dense(torch.float32, 16)
        elif holding is not None:
            m.dense = DynamicInt8Linear(m.weight_q.dequantize(), m.bias, holding == "int8_token")
            m.dense_min_tokens = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,512")
    args = parser.parse_args()
    engine = Engine(EngineConfig(weights="auto", dtype="float32", kv_cache_gb=1.0, disable_radix_cache=True))
    rates = linear_rates(engine, [int(r) for r in args.rows.split(",")])
    print(f"quantized engine: {torch.backends.quantized.engine}")
    print_table(rates, list(rates[0]))
    prompts = chat_prompts(engine)
    set_large_steps(engine, None)
    base = answers(engine, prompts)
    agreement = []
    for label in ("dense_fp32", "int8_tensor", "int8_token"):
        set_large_steps(engine, label)
        got = answers(engine, prompts)
        first = first_differences(base, got)
        agreement.append({"large_steps_on": label, "identical": sum(f == len(x) for f, x in zip(first, base, strict=True)),
                          "of": len(base), "mean_first_difference": statistics.mean(first),
                          "sample": repr(engine.tokenizer.decode(got[1][:24]))})
    set_large_steps(engine, None)
    print("greedy answers against the blocks (64 chat prompts, 64 new tokens):")
    print_table(agreement, list(agreement[0]))
    print("wrote", write_json("probe_int8_activations", {"rates": rates, "agreement": agreement}))
    engine.shutdown()


if __name__ == "__main__":
    main()
