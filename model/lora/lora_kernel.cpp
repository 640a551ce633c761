// One LoRA site of one layer for every adapter of a step, on float32 CPU rows: each
// adapter's rows times its A (all parts side by side), then each part's B, added into the
// part's columns of the fused output. See lora_kernel.py for why.
//
// Plain pybind11 over raw addresses (no torch headers: a build of seconds); the Python side
// checks dtypes, devices, shapes and strides before it calls.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// 16 floats: one AVX-512 register, two AVX2 ones (GCC's vector extension lowers it to what
// -march=native offers).
typedef float v16 __attribute__((vector_size(64), aligned(4)));
constexpr std::int64_t kLanes = 16;
constexpr std::int64_t kRowBlock = 8;  // rows whose sums stay in registers at once

inline v16 load(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16*>(p) = v; }

// Sums for a block of B rows (a compile-time count: their accumulators stay in registers).
// low[w, chunk] = x[rows[w], :] @ a[:, chunk] for each 16-rank chunk (rank: a multiple of
// 16): each row of A is read once for the block.
template <int B>
void shrink_block(const float* x, std::int64_t x_stride, std::int64_t in,
                  const std::int64_t* rows, const float* a, std::int64_t rank, float* low) {
  const float* x_rows[B];
  for (int w = 0; w < B; ++w) x_rows[w] = x + rows[w] * x_stride;
  for (std::int64_t chunk = 0; chunk < rank; chunk += kLanes) {
    v16 acc[B] = {};
    for (std::int64_t i = 0; i < in; ++i) {
      const v16 a_chunk = load(a + i * rank + chunk);
      for (int w = 0; w < B; ++w) acc[w] += x_rows[w][i] * a_chunk;
    }
    for (int w = 0; w < B; ++w) store(low + w * rank + chunk, acc[w]);
  }
}

// out[rows[w], column0 + c] += low[w, rank0 : rank0 + part_rank] @ b[:, c] for a block of
// B rows, 16 columns at a time (a scalar tail where columns are not a multiple of 16).
template <int B>
void expand_block(const float* low, std::int64_t rank, std::int64_t rank0,
                  std::int64_t part_rank, const float* b, std::int64_t columns,
                  const std::int64_t* rows, float* out, std::int64_t out_stride,
                  std::int64_t column0) {
  const std::int64_t vector_columns = columns - columns % kLanes;
  for (std::int64_t c = 0; c < vector_columns; c += kLanes) {
    v16 acc[B] = {};
    for (std::int64_t r = 0; r < part_rank; ++r) {
      const v16 b_chunk = load(b + r * columns + c);
      for (int w = 0; w < B; ++w) acc[w] += low[w * rank + rank0 + r] * b_chunk;
    }
    for (int w = 0; w < B; ++w) {
      float* o = out + rows[w] * out_stride + column0 + c;
      store(o, load(o) + acc[w]);
    }
  }
  for (std::int64_t c = vector_columns; c < columns; ++c) {
    for (int w = 0; w < B; ++w) {
      float sum = 0.0f;
      for (std::int64_t r = 0; r < part_rank; ++r) {
        sum += low[w * rank + rank0 + r] * b[r * columns + c];
      }
      out[rows[w] * out_stride + column0 + c] += sum;
    }
  }
}

// Calls block<B>(args...) for the rows in blocks of kRowBlock, the last one smaller.
#define FOR_ROW_BLOCKS(m, call)                                  \
  for (std::int64_t w0 = 0; w0 < (m); w0 += kRowBlock) {        \
    switch (std::min(kRowBlock, (m) - w0)) {                    \
      case 1: call(1); break;                                   \
      case 2: call(2); break;                                   \
      case 3: call(3); break;                                   \
      case 4: call(4); break;                                   \
      case 5: call(5); break;                                   \
      case 6: call(6); break;                                   \
      case 7: call(7); break;                                   \
      default: call(8); break;                                  \
    }                                                           \
  }

// x: [rows, in] at row stride x_stride. groups: [adapters, width] row indices, -1 padding.
// a_t: [adapters, in, rank] (every part's A^T side by side along rank, zero-padded to a
// multiple of 16). Part p adds low[:, ranks[p]] @ b_t[p] ([adapters, r_p, cols_p]) into
// out[row, columns[p]], out at row stride out_stride.
void lora_site(std::uintptr_t x_address, std::int64_t x_stride, std::int64_t in,
               std::uintptr_t groups_address, std::int64_t adapters, std::int64_t width,
               std::uintptr_t a_address, std::int64_t rank, std::uintptr_t parts_address,
               std::int64_t num_parts, std::uintptr_t out_address, std::int64_t out_stride) {
  const float* x = reinterpret_cast<const float*>(x_address);
  const std::int64_t* groups = reinterpret_cast<const std::int64_t*>(groups_address);
  const float* a_t = reinterpret_cast<const float*>(a_address);
  // Per part: column start, column end, rank start, rank end, B^T's address.
  const std::int64_t* parts = reinterpret_cast<const std::int64_t*>(parts_address);
  float* out = reinterpret_cast<float*>(out_address);
  std::vector<float> low(static_cast<std::size_t>(width * rank));
  std::vector<std::int64_t> rows(static_cast<std::size_t>(width));
  for (std::int64_t g = 0; g < adapters; ++g) {
    std::int64_t m = 0;
    for (std::int64_t w = 0; w < width; ++w) {
      const std::int64_t row = groups[g * width + w];
      if (row >= 0) rows[m++] = row;
    }
    if (m == 0) continue;
    const float* a = a_t + g * in * rank;
#define SHRINK(B) \
  shrink_block<B>(x, x_stride, in, rows.data() + w0, a, rank, low.data() + w0 * rank)
    FOR_ROW_BLOCKS(m, SHRINK)
#undef SHRINK
    for (std::int64_t p = 0; p < num_parts; ++p) {
      const std::int64_t* part = parts + p * 5;
      const std::int64_t columns = part[1] - part[0], part_rank = part[3] - part[2];
      const float* b = reinterpret_cast<const float*>(part[4]) + g * part_rank * columns;
#define EXPAND(B)                                                                    \
  expand_block<B>(low.data() + w0 * rank, rank, part[2], part_rank, b, columns, \
                  rows.data() + w0, out, out_stride, part[0])
      FOR_ROW_BLOCKS(m, EXPAND)
#undef EXPAND
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_site", &lora_site, "one LoRA site of one layer for a step's adapters");
}
