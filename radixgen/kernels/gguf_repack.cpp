// GGUF's quantized blocks rewritten as quant_linear.cpp's records, one pass over the file's bytes
// and no float copy: each group of 32 weights of a row becomes the lane of that row in its block's
// record. ggml's layouts (its ggml-quants.c, dequantize_row_*) per type:
//   Q4_0 18 bytes / 32: d, 16 bytes of nibbles (element j low, j + 16 high); w = d * (q - 8)
//   Q4_1 20 bytes: d, m, nibbles; w = d * q + m
//   Q5_0 22 bytes: d, 32 high bits, nibbles; w = d * (q - 16)
//   Q5_1 24 bytes: d, m, high bits, nibbles; w = d * q + m
//   Q8_0 34 bytes: d, 32 int8; w = d * q
//   Q4_K 144 bytes / 256: d, dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32,
//        128 bytes of nibbles (sub-block 2i: low nibbles of bytes 32i.., 2i + 1: high); w = d * sc * q - dmin * m
//   Q5_K 176 bytes: as Q4_K with 32 bytes of high bits (bit s of byte l: sub-block s, element l)
//   Q6_K 210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16), d;
//        w = d * sc * (q - 32)
// The K-quants' products d * sc and dmin * m are rounded to float16, the records' scale type
// (within 2^-11 of the float32 product).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "quant_records.h"

// named: one translation unit holds every kernel source (kernels.cpp), and helpers in anonymous
// namespaces of the other sources would meet these
namespace radixgen_gguf {

// ggml's type ids
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct TypeInfo {
  int64_t block_weights, block_bytes, record_bits;
};

TypeInfo type_info(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18, 4};
    case kQ4_1: return {32, 20, 4};
    case kQ5_0: return {32, 22, 5};
    case kQ5_1: return {32, 24, 5};
    case kQ8_0: return {32, 34, 8};
    case kQ4_K: return {256, 144, 4};
    case kQ5_K: return {256, 176, 5};
    case kQ6_K: return {256, 210, 6};
    default: TORCH_CHECK(false, "gguf_repack: unsupported ggml type id ", type);
  }
}

using namespace radixgen::records;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One group of 32 weights as the record holds it: q (unsigned, 8 bits: signed), its scale(s) and min.
struct Group {
  int32_t q[kGroup];
  float scale[2];
  float min;
};

// Q4_K / Q5_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63, *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode_group(int64_t type, const uint8_t* row, int64_t g, Group& out) {
  out.scale[1] = 0.f, out.min = 0.f;
  switch (type) {
    case kQ4_0:
    case kQ4_1:
    case kQ5_0:
    case kQ5_1: {
      // d, then m (the _1 types), then 32 high bits (the Q5 types), then 16 bytes of nibbles
      const bool with_min = type == kQ4_1 || type == kQ5_1, five_bits = type == kQ5_0 || type == kQ5_1;
      const uint8_t* b = row + g * type_info(type).block_bytes;
      const float d = half_at(b);
      out.scale[0] = d, out.min = with_min ? half_at(b + 2) : (five_bits ? -16.f : -8.f) * d;
      const uint8_t* qs = b + (with_min ? 4 : 2);
      uint32_t qh = 0;
      if (five_bits) std::memcpy(&qh, qs, 4), qs += 4;
      for (int j = 0; j < 16; ++j) {
        out.q[j] = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
        out.q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      return;
    }
    case kQ8_0: {
      const uint8_t* b = row + g * 34;
      out.scale[0] = half_at(b);
      for (int j = 0; j < 32; ++j) out.q[j] = reinterpret_cast<const int8_t*>(b + 2)[j];
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const int s = static_cast<int>(g % 8);
      const uint8_t* b = row + (g / 8) * (type == kQ4_K ? 144 : 176);
      int sc, m;
      scale_min_k4(s, b + 4, &sc, &m);
      out.scale[0] = half_at(b) * sc, out.min = -half_at(b + 2) * m;
      const uint8_t* qs = b + (type == kQ4_K ? 16 : 48) + 32 * (s / 2);
      for (int l = 0; l < 32; ++l) out.q[l] = s % 2 ? qs[l] >> 4 : qs[l] & 0xF;
      if (type == kQ5_K)
        for (int l = 0; l < 32; ++l) out.q[l] |= ((b[16 + l] >> s) & 1) << 4;
      return;
    }
    case kQ6_K: {
      const int s = static_cast<int>(g % 8), half = s / 4, quarter = s % 4;
      const uint8_t* b = row + (g / 8) * 210;
      const uint8_t* ql = b + 64 * half + (quarter % 2) * 32;
      const uint8_t* qh = b + 128 + 32 * half;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * quarter;
      const float d = half_at(b + 208);
      for (int l = 0; l < 32; ++l)
        out.q[l] = (quarter < 2 ? ql[l] & 0xF : ql[l] >> 4) | (((qh[l] >> (2 * quarter)) & 3) << 4);
      out.scale[0] = d * sc[0], out.scale[1] = d * sc[1];
      return;
    }
    default: TORCH_CHECK(false, "gguf_repack: unsupported ggml type id ", type);
  }
}

void write_lane(const Group& grp, int64_t bits, int64_t lane_row, uint8_t* rec) {
  const int64_t qbytes = quant_bytes(bits);
  for (int64_t e = 0; e < kGroup; ++e) {
    const int64_t pair = e / 2, lane = 2 * lane_row + e % 2;
    if (bits == 8) {
      rec[32 * pair + lane] = static_cast<uint8_t>(static_cast<int8_t>(grp.q[e]));
      continue;
    }
    const int64_t c = pair % 8;
    const bool high_nibble = pair >= 8;
    rec[32 * c + lane] |= static_cast<uint8_t>((grp.q[e] & 0xF) << (high_nibble ? 4 : 0));
    if (bits != 4) {
      const int ex = extra_bits(bits), h = high_rows(bits);
      rec[256 + (c % h) * 32 + lane] |=
          static_cast<uint8_t>((grp.q[e] >> 4) << ((c / h) * 2 * ex + (high_nibble ? ex : 0)));
    }
  }
  auto put_half = [&](int64_t offset, float value) {
    const uint16_t bits16 = c10::Half(value).x;
    std::memcpy(rec + offset + 2 * lane_row, &bits16, 2);
  };
  put_half(qbytes, grp.scale[0]);
  if (has_min(bits)) put_half(qbytes + kScaleBytes, grp.min);
  if (bits == 6) put_half(qbytes + kScaleBytes, grp.scale[1]);
}

// raw: uint8 [rows, row bytes] of one GGUF tensor (rows of `cols` weights) -> the records
// [ceil(rows / 16), cols / 32, record bytes] of the type's record width (4, 5, 6 or 8 bits).
at::Tensor gguf_repack(const at::Tensor& raw, int64_t type, int64_t cols) {
  const TypeInfo info = type_info(type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.device().is_cpu(),
              "gguf_repack: raw must be a contiguous uint8 CPU tensor [rows, row bytes]");
  TORCH_CHECK(cols % info.block_weights == 0, "gguf_repack: ", cols, " columns are not whole blocks of ",
              info.block_weights);
  TORCH_CHECK(raw.size(1) == cols / info.block_weights * info.block_bytes, "gguf_repack: rows of ", raw.size(1),
              " bytes, expected ", cols / info.block_weights * info.block_bytes, " for ", cols, " weights");
  const int64_t rows = raw.size(0), groups = cols / kGroup, bits = info.record_bits;
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows, stride = record_bytes(bits);
  at::Tensor out = at::zeros({blocks, groups, stride}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = raw.size(1);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Group grp;
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = b * kBlockRows; r < std::min(rows, (b + 1) * kBlockRows); ++r)
        for (int64_t g = 0; g < groups; ++g) {
          decode_group(type, src + r * row_bytes, g, grp);
          write_lane(grp, bits, r % kBlockRows, dst + (b * groups + g) * stride);
        }
  });
  return out;
}

}  // namespace radixgen_gguf

TORCH_LIBRARY_FRAGMENT(radixgen, m) { m.def("gguf_repack(Tensor raw, int type, int cols) -> Tensor"); }
TORCH_LIBRARY_IMPL(radixgen, CPU, m) { m.impl("gguf_repack", TORCH_FN(radixgen_gguf::gguf_repack)); }
