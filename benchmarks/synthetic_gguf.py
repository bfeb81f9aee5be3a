"""A GGUF with a real model's shapes, tokenizer and quantization recipe but random weights, to
measure start time, memory and speed at sizes no package on the index ships (its text is
meaningless; the packaged 0.5B answers the questions of quality). The vocabulary, merges and chat
template are the packaged Qwen2.5-Coder-0.5B's (the Qwen2.5 family shares them). The weights are
written in F16 and quantized by llama.cpp's own ``llama-quantize``, so every tensor gets the type
its recipe gives a real model of these shapes (Q4_K_M: Q6_K for a tied embedding and for half of
the value and down projections, Q4_K elsewhere).

    python benchmarks/synthetic_gguf.py OUT.gguf --llama-cpp BUILD/bin [--shape qwen2.5-1.5b] [--type Q4_K_M]

then ``python benchmarks/bench_gguf.py OUT.gguf --llama-cpp BUILD/bin``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the published configs of the Qwen2.5 instruct models
SHAPES = {
    "qwen2.5-1.5b": {"block_count": 28, "embedding_length": 1536, "feed_forward_length": 8960,
                     "head_count": 12, "head_count_kv": 2, "tied": True},
    "qwen2.5-3b": {"block_count": 36, "embedding_length": 2048, "feed_forward_length": 11008,
                   "head_count": 16, "head_count_kv": 2, "tied": True},
    "qwen2.5-7b": {"block_count": 28, "embedding_length": 3584, "feed_forward_length": 18944,
                   "head_count": 28, "head_count_kv": 4, "tied": False},
}
_DIMENSION_KEYS = {f"qwen2.{k}" for k in ("block_count", "embedding_length", "feed_forward_length")} | {
    "qwen2.attention.head_count", "qwen2.attention.head_count_kv"}


def _tensors(shape: dict[str, int | bool], vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    hidden, ffn, layers = int(shape["embedding_length"]), int(shape["feed_forward_length"]), int(shape["block_count"])
    kv = hidden // int(shape["head_count"]) * int(shape["head_count_kv"])

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    out = {"token_embd.weight": weight(vocab, hidden), "output_norm.weight": np.ones(hidden, np.float32)}
    if not shape["tied"]:
        out["output.weight"] = weight(vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": np.ones(hidden, np.float32), p + "ffn_norm.weight": np.ones(hidden, np.float32),
                p + "attn_q.weight": weight(hidden, hidden), p + "attn_q.bias": np.zeros(hidden, np.float32),
                p + "attn_k.weight": weight(kv, hidden), p + "attn_k.bias": np.zeros(kv, np.float32),
                p + "attn_v.weight": weight(kv, hidden), p + "attn_v.bias": np.zeros(kv, np.float32),
                p + "attn_output.weight": weight(hidden, hidden), p + "ffn_gate.weight": weight(ffn, hidden),
                p + "ffn_up.weight": weight(ffn, hidden), p + "ffn_down.weight": weight(hidden, ffn)}
    return out


def write_f16(template: Path, out: Path, shape_name: str, seed: int = 0) -> None:
    """The template's metadata (its tokenizer) with the shape's dimensions, and random F16 weights."""
    import gguf

    from radixgen.models.gguf_file import GGUFFile

    shape = SHAPES[shape_name]
    reader = gguf.GGUFReader(template)
    writer = gguf.GGUFWriter(out, "qwen2")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _DIMENSION_KEYS or key in ("general.architecture", "general.file_type"):
            continue
        value = field.contents()
        if key == "general.name":
            value = f"synthetic {shape_name} (random weights)"
        writer.add_key_value(key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for key in ("block_count", "embedding_length", "feed_forward_length"):
        writer.add_key_value(f"qwen2.{key}", shape[key], gguf.GGUFValueType.UINT32)
    writer.add_key_value("qwen2.attention.head_count", shape["head_count"], gguf.GGUFValueType.UINT32)
    writer.add_key_value("qwen2.attention.head_count_kv", shape["head_count_kv"], gguf.GGUFValueType.UINT32)
    writer.add_key_value("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16), gguf.GGUFValueType.UINT32)
    vocab = GGUFFile(template).tensors["token_embd.weight"].shape[0]  # the template's rows (a padded vocabulary)
    for name, array in _tensors(shape, vocab, np.random.default_rng(seed)).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="the folder holding llama-quantize")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from radixgen.models.packaged_models import real_model_gguf

    with tempfile.TemporaryDirectory(prefix="radixgen-synthetic-", dir=args.out.parent) as tmp:
        f16 = Path(tmp) / "model-f16.gguf"
        write_f16(real_model_gguf(), f16, args.shape)
        subprocess.run([str(args.llama_cpp / "llama-quantize"), str(f16), str(args.out), args.type, str(args.threads)],
                       check=True)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
