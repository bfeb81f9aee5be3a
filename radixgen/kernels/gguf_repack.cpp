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
// The legacy types become group records (each group's float16 factors beside its values), the
// K-quants super-block records that keep the codes and float16 factors as they are, so that every
// record is exact and no larger than the blocks it came from.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "quant_records.h"

// named: one translation unit holds every kernel source (kernels.cpp), and helpers in anonymous
// namespaces of the other sources would meet these
namespace radixgen_gguf {

// ggml's type ids
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct TypeInfo {
  int64_t block_weights, block_bytes, record_kind;
};

constexpr TypeInfo type_info(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18, radixgen::records::kOffset + 4};
    case kQ4_1: return {32, 20, 4};
    case kQ5_0: return {32, 22, radixgen::records::kOffset + 5};
    case kQ5_1: return {32, 24, 5};
    case kQ8_0: return {32, 34, 8};
    case kQ4_K: return {256, 144, radixgen::records::kSuper + 4};
    case kQ5_K: return {256, 176, radixgen::records::kSuper + 5};
    case kQ6_K: return {256, 210, radixgen::records::kSuper + 6};
    default: TORCH_CHECK(false, "gguf_repack: unsupported ggml type id ", type);
  }
}

using namespace radixgen::records;

// One group of 32 weights of a K-quant block: its values (unsigned; Q6_K's before the - 32).
struct Group {
  int32_t q[kGroup];
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

// The values of one group of a K-quant block; templated on the type so that every layout choice
// and loop bound folds at compile time (a start repacks every weight of the file).
template <int64_t kType>
inline void decode_group(const uint8_t* row, int64_t g, Group& out) {
  if constexpr (kType == kQ4_K || kType == kQ5_K) {
    const int s = static_cast<int>(g % 8);
    const uint8_t* b = row + (g / 8) * (kType == kQ4_K ? 144 : 176);
    const uint8_t* qs = b + (kType == kQ4_K ? 16 : 48) + 32 * (s / 2);
    const int shift = s % 2 ? 4 : 0;
    for (int l = 0; l < 32; ++l) out.q[l] = (qs[l] >> shift) & 0xF;
    if constexpr (kType == kQ5_K)
      for (int l = 0; l < 32; ++l) out.q[l] |= ((b[16 + l] >> s) & 1) << 4;
  } else {
    static_assert(kType == kQ6_K, "a block type without a decoder");
    const int s = static_cast<int>(g % 8), half = s / 4, quarter = s % 4;
    const uint8_t* b = row + (g / 8) * 210;
    const uint8_t* ql = b + 64 * half + (quarter % 2) * 32;
    const uint8_t* qh = b + 128 + 32 * half;
    const int low_shift = quarter < 2 ? 0 : 4, high_shift = 2 * quarter;
    for (int l = 0; l < 32; ++l) out.q[l] = ((ql[l] >> low_shift) & 0xF) | (((qh[l] >> high_shift) & 3) << 4);
  }
}

// One group's values in a record: the same group of 16 rows (rows past the tensor's end hold
// zeros), each byte composed once from the rows' values and stored, instead of nibbles OR-ed in
// one at a time.
template <int kBits>
inline void write_values(const Group* grp, uint8_t* rec) {
  static_assert(kBits != 8, "8-bit records come from Q8_0 blocks (write_legacy_record)");
  // lane 2r + j of nibble chunk c: element 2c + j (low nibble) and 2c + j + 16 (high nibble)
  for (int64_t c = 0; c < 8; ++c)
    for (int64_t r = 0; r < kBlockRows; ++r)
      for (int64_t j = 0; j < 2; ++j)
        rec[32 * c + 2 * r + j] =
            static_cast<uint8_t>((grp[r].q[2 * c + j] & 0xF) | ((grp[r].q[2 * c + j + 16] & 0xF) << 4));
  if constexpr (kBits != 4) {
    // the bits above the nibble: chunks c and c + h share byte row c % h, at shift (c / h) * 2 * ex
    constexpr int ex = extra_bits(kBits), h = high_rows(kBits);
    for (int k = 0; k < h; ++k)
      for (int64_t r = 0; r < kBlockRows; ++r)
        for (int64_t j = 0; j < 2; ++j) {
          uint32_t byte = 0;
          for (int c = k; c < 8; c += h) {
            const int shift = (c / h) * 2 * ex;
            byte |= static_cast<uint32_t>(grp[r].q[2 * c + j] >> 4) << shift;
            byte |= static_cast<uint32_t>(grp[r].q[2 * c + j + 16] >> 4) << (shift + ex);
          }
          rec[256 + k * 32 + 2 * r + j] = static_cast<uint8_t>(byte);
        }
  }
}

// Super-block j of rows [first, first + rows_here) as one super-block record (quant_records.h):
// the values regrouped, the codes and float16 factors copied as the blocks hold them.
template <int64_t kType>
inline void write_super_record(const uint8_t* first_row, int64_t row_bytes, int64_t rows_here, int64_t j,
                               uint8_t* rec) {
  constexpr int64_t kKind = type_info(kType).record_kind, qbytes = quant_bytes(kKind);
  constexpr int kBits = value_bits(kKind);
  uint8_t* parts = rec + kSuperGroups * qbytes;
  uint8_t* head = parts + kSuperGroups * super_scale_bytes(kKind);
  // the codes are OR-ed into their bytes; rows past the tensor's end have zero factors (and values)
  std::memset(parts, 0, kSuperGroups * super_scale_bytes(kKind));
  if (rows_here < kBlockRows) std::memset(head, 0, super_head_bytes(kKind));
  for (int64_t r = 0; r < rows_here; ++r) {
    const uint8_t* b = first_row + r * row_bytes + j * type_info(kType).block_bytes;
    if constexpr (kBits == 6) {
      std::memcpy(head + 2 * r, b + 208, 2);
      for (int s = 0; s < 8; ++s) {  // the int8 scales of elements 0..15 and 16..31 of group s
        parts[32 * s + r] = b[192 + 2 * s];
        parts[32 * s + 16 + r] = b[192 + 2 * s + 1];
      }
    } else {
      std::memcpy(head + 2 * r, b, 2);
      std::memcpy(head + kScaleBytes + 2 * r, b + 2, 2);
      const int i = static_cast<int>(r % 8), upper = static_cast<int>(r / 8);
      for (int s = 0; s < 8; ++s) {  // quant_records.h's super_code reads them back
        int sc, m;
        scale_min_k4(s, b + 4, &sc, &m);
        uint8_t* part = parts + 24 * s;
        part[r] = static_cast<uint8_t>((sc & 0xF) | (m & 0xF) << 4);
        part[16 + i] |= static_cast<uint8_t>(((sc >> 4) | (m >> 4) << 2) << (4 * upper));
      }
    }
  }
  for (int s = 0; s < 8; ++s) {
    Group grp[kBlockRows] = {};
    for (int64_t r = 0; r < rows_here; ++r) decode_group<kType>(first_row + r * row_bytes, j * 8 + s, grp[r]);
    write_values<kBits>(grp, rec + s * qbytes);
  }
}

constexpr bool is_legacy(int64_t type) { return type_info(type).block_weights == kGroup; }

// The 32-weight types store byte j of a block's values as element j's nibble under element
// j + 16's, which is how a record pairs them too: a record's nibbles (Q8_0: its int8 values) are
// the rows' bytes moved two at a time, with no value decoded (a start repacks every weight).
template <int64_t kType>
inline void write_legacy_record(const uint8_t* first_row, int64_t row_bytes, int64_t rows_here, int64_t g,
                                uint8_t* rec) {
  constexpr TypeInfo info = type_info(kType);
  constexpr int64_t kKind = info.record_kind;
  constexpr int kBits = value_bits(kKind);
  constexpr bool with_min = kType == kQ4_1 || kType == kQ5_1, five_bits = kBits == 5;
  constexpr int64_t qbytes = quant_bytes(kKind);
  if (rows_here < kBlockRows) std::memset(rec, 0, record_bytes(kKind));  // rows past the end: zero weights
  for (int64_t r = 0; r < rows_here; ++r) {
    const uint8_t* b = first_row + r * row_bytes + g * info.block_bytes;
    const uint8_t* qs = b + (with_min ? 4 : 2) + (five_bits ? 4 : 0);
    constexpr int64_t pairs = kBits == 8 ? 16 : 8;  // 32 int8 values, or 16 bytes of nibbles
    for (int64_t pair = 0; pair < pairs; ++pair)
      std::memcpy(rec + 32 * pair + 2 * r, qs + 2 * pair, 2);
    if constexpr (five_bits) {
      uint32_t qh;
      std::memcpy(&qh, b + (with_min ? 4 : 2), 4);
      // the records' high-bit byte k of lane j holds chunks k, k + 2, k + 4, k + 6, each as its
      // element 2c + j's bit under element 2c + j + 16's
      for (int k = 0; k < 2; ++k)
        for (int j = 0; j < 2; ++j) {
          uint32_t byte = 0;
          for (int i = 0; i < 4; ++i) {
            const int e = 2 * (k + 2 * i) + j;
            byte |= ((qh >> e) & 1u) << (2 * i) | ((qh >> (e + 16)) & 1u) << (2 * i + 1);
          }
          rec[256 + 32 * k + 2 * r + j] = static_cast<uint8_t>(byte);
        }
    }
    std::memcpy(rec + qbytes + 2 * r, b, 2);  // the float16 scale (and minimum) as the block holds them
    if constexpr (with_min) std::memcpy(rec + qbytes + kScaleBytes + 2 * r, b + 2, 2);
  }
}

template <int64_t kType>
void repack_rows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t groups, int64_t row_bytes) {
  constexpr int64_t kKind = type_info(kType).record_kind, stride = record_bytes(kKind);
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * kBlockRows, here = std::min(kBlockRows, rows - first);
      uint8_t* records = dst + b * groups * stride;
      if constexpr (is_legacy(kType)) {
        for (int64_t g = 0; g < groups; ++g)
          write_legacy_record<kType>(src + first * row_bytes, row_bytes, here, g, records + g * stride);
      } else {
        for (int64_t j = 0; j < groups / kSuperGroups; ++j)
          write_super_record<kType>(src + first * row_bytes, row_bytes, here, j, records + j * super_bytes(kKind));
      }
    }
  });
}

// The records' shape for raw: uint8 [rows, row bytes] of one GGUF tensor (rows of `cols` weights):
// [ceil(rows / 16), cols / 32, record bytes] of the type's record width (4, 5, 6 or 8 bits).
std::vector<int64_t> record_shape(const at::Tensor& raw, int64_t type, int64_t cols) {
  const TypeInfo info = type_info(type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.device().is_cpu(),
              "gguf_repack: raw must be a contiguous uint8 CPU tensor [rows, row bytes]");
  TORCH_CHECK(cols % info.block_weights == 0, "gguf_repack: ", cols, " columns are not whole blocks of ",
              info.block_weights);
  TORCH_CHECK(raw.size(1) == cols / info.block_weights * info.block_bytes, "gguf_repack: rows of ", raw.size(1),
              " bytes, expected ", cols / info.block_weights * info.block_bytes, " for ", cols, " weights");
  return {(raw.size(0) + kBlockRows - 1) / kBlockRows, cols / kGroup, record_bytes(info.record_kind)};
}

// The records of raw written into `out` (a slice of the weights' arena, or fresh memory); every
// byte of a record is written, the rows past the tensor's end as zeros.
void gguf_repack_into(const at::Tensor& raw, int64_t type, int64_t cols, at::Tensor& out) {
  const std::vector<int64_t> shape = record_shape(raw, type, cols);
  TORCH_CHECK(out.sizes() == at::IntArrayRef(shape) && out.scalar_type() == at::kByte && out.is_contiguous() &&
                  out.device().is_cpu(),
              "gguf_repack_into: out must be a contiguous uint8 CPU tensor ", at::IntArrayRef(shape));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t rows = raw.size(0), groups = shape[1], row_bytes = raw.size(1);
  switch (type) {
    case kQ4_0: repack_rows<kQ4_0>(src, dst, rows, groups, row_bytes); break;
    case kQ4_1: repack_rows<kQ4_1>(src, dst, rows, groups, row_bytes); break;
    case kQ5_0: repack_rows<kQ5_0>(src, dst, rows, groups, row_bytes); break;
    case kQ5_1: repack_rows<kQ5_1>(src, dst, rows, groups, row_bytes); break;
    case kQ8_0: repack_rows<kQ8_0>(src, dst, rows, groups, row_bytes); break;
    case kQ4_K: repack_rows<kQ4_K>(src, dst, rows, groups, row_bytes); break;
    case kQ5_K: repack_rows<kQ5_K>(src, dst, rows, groups, row_bytes); break;
    case kQ6_K: repack_rows<kQ6_K>(src, dst, rows, groups, row_bytes); break;
    default: TORCH_CHECK(false, "gguf_repack: unsupported ggml type id ", type);
  }
}

at::Tensor gguf_repack(const at::Tensor& raw, int64_t type, int64_t cols) {
  at::Tensor out = at::empty(record_shape(raw, type, cols), raw.options());
  gguf_repack_into(raw, type, cols, out);
  return out;
}

}  // namespace radixgen_gguf

TORCH_LIBRARY_FRAGMENT(radixgen, m) {
  m.def("gguf_repack(Tensor raw, int type, int cols) -> Tensor");
  m.def("gguf_repack_into(Tensor raw, int type, int cols, Tensor(a!) out) -> ()");
}
TORCH_LIBRARY_IMPL(radixgen, CPU, m) {
  m.impl("gguf_repack", TORCH_FN(radixgen_gguf::gguf_repack));
  m.impl("gguf_repack_into", TORCH_FN(radixgen_gguf::gguf_repack_into));
}
