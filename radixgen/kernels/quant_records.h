// The quantized linears' record layout (quant_linear.cpp's header describes it): read by
// quant_linear.cpp, written by gguf_repack.cpp, and mirrored in Python by quant_layout.py.
#pragma once

#include <cstdint>

namespace radixgen::records {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockRows = 16;
constexpr int64_t kScaleBytes = kBlockRows * 2;

// bytes of the quantized values of one record (the float16 vectors follow)
constexpr int64_t quant_bytes(int64_t bits) { return bits == 8 ? 512 : 256 + 64 * (bits - 4); }
constexpr int64_t record_bytes(int64_t bits) { return quant_bytes(bits) + (bits == 8 ? 1 : 2) * kScaleBytes; }
constexpr bool has_min(int64_t bits) { return bits == 4 || bits == 5; }
// extra bits above the nibble, and how many nibble chunks share a byte position of the high part
constexpr int extra_bits(int64_t bits) { return bits == 5 ? 1 : bits == 6 ? 2 : 0; }
constexpr int high_rows(int64_t bits) { return bits == 5 ? 2 : 4; }

}  // namespace radixgen::records
