// The extension's one translation unit: every kernel source compiled together. Each source
// includes ATen's headers, which take most of a source's compile time; one unit parses them
// once (a cold build: ~27 s of CPU instead of ~60 s for four).
#include "decode_attention.cpp"
#include "prefill_attention_float.cpp"
#include "prefill_attention.cpp"
#include "small_linear.cpp"
#include "fused_ops.cpp"
#include "quant_linear.cpp"
#include "quant_tiles.cpp"
#include "gguf_repack.cpp"
