// x @ W.T for one 4-bit plane held in torch's int4 CPU layout, with float32 activations:
// the weights are widened to float32 in registers, never written out
// (model/quantization/int4_tiles_kernel.py says when it serves and why).
//
//   x             [M, K] float32, contiguous
//   packed        [N, K / 2] uint8: N / 64 tiles of [K, 32] bytes; byte [k, j] of tile t holds
//                 row 64t + j (low nibble) and row 64t + 32 + j (high nibble) at input k
//   scales_zeros  [K / 32, N, 2] bfloat16: per group of 32 inputs and row, S then Z
//   out           [M, N] float32: sum over groups g of S (sum_k x_k (q_k - 8)) + Z sum_k x_k
//                 = S (sum_k x_k q_k - 8 xs_g) + Z xs_g, xs_g the group's sum of x
//
// A tile is walked group by group; per input k its 32 bytes become the 64 rows' weights in
// four registers (rows 0-15, 16-31 from the low nibbles, 32-47, 48-63 from the high), and
// kRows rows of x at a time accumulate them (the tile's bytes stay in L1 across the row
// blocks). Each group's sums are scaled into the totals once, in float32 throughout.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTileRows = 64;
constexpr int64_t kGroup = 32;

inline __m512 bf16_low(__m512i pairs) {  // S of each (S, Z) pair, widened to float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}

inline __m512 bf16_high(__m512i pairs) {  // Z of each (S, Z) pair
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xFFFF0000)));
}

template <int kRows>
void tile_rows(const float* x, int64_t K, const uint8_t* tile, const uint32_t* scales_zeros,
               int64_t N, const float* group_sums, int64_t G, float* out) {
  // One row's totals stay in registers; more rows' live in L1, as in registers beside the
  // group's 4 kRows sums they would spill.
  constexpr bool kTotalsInRegisters = kRows == 1;
  alignas(64) float total[kRows][kTileRows] = {};
  __m512 held[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                    _mm512_setzero_ps()};
  const __m512i low_mask = _mm512_set1_epi32(15);
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[kRows][4];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + k * 32));
      const __m512i first = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes));
      const __m512i second = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1));
      const __m512 w[4] = {
          _mm512_cvtepi32_ps(_mm512_and_si512(first, low_mask)),
          _mm512_cvtepi32_ps(_mm512_and_si512(second, low_mask)),
          _mm512_cvtepi32_ps(_mm512_srli_epi32(first, 4)),
          _mm512_cvtepi32_ps(_mm512_srli_epi32(second, 4)),
      };
      for (int i = 0; i < kRows; ++i) {
        const __m512 xv = _mm512_set1_ps(x[i * K + k]);
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
      }
    }
    const uint32_t* pairs = scales_zeros + g * N;  // this tile's 64 rows, (S, Z) each
    for (int j = 0; j < 4; ++j) {
      const __m512i packed_pairs = _mm512_loadu_si512(pairs + 16 * j);
      const __m512 scale = bf16_low(packed_pairs);
      const __m512 zero = bf16_high(packed_pairs);
      for (int i = 0; i < kRows; ++i) {
        const float sum = group_sums[i * G + g];
        const __m512 centred = _mm512_sub_ps(acc[i][j], _mm512_set1_ps(8.0f * sum));
        __m512 running = kTotalsInRegisters ? held[j] : _mm512_load_ps(&total[i][16 * j]);
        running = _mm512_fmadd_ps(scale, centred, running);
        running = _mm512_fmadd_ps(zero, _mm512_set1_ps(sum), running);
        if constexpr (kTotalsInRegisters) {
          held[j] = running;
        } else {
          _mm512_store_ps(&total[i][16 * j], running);
        }
      }
    }
  }
  if constexpr (kTotalsInRegisters) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + 16 * j, held[j]);
  } else {
    for (int i = 0; i < kRows; ++i) std::memcpy(out + i * N, total[i], sizeof(total[i]));
  }
}

torch::Tensor int4_tiles_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: [M, K] float32");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous(), "packed: uint8");
  TORCH_CHECK(scales_zeros.dtype() == torch::kBFloat16 && scales_zeros.is_contiguous(),
              "scales_zeros: bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(K % kGroup == 0 && N % kTileRows == 0 && packed.size(1) * 2 == K, "shapes");
  TORCH_CHECK(scales_zeros.size(0) == K / kGroup && scales_zeros.size(1) == N, "scales shape");
  const int64_t G = K / kGroup;
  auto out = torch::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  std::vector<float> group_sums(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.0f;
      for (int64_t k = 0; k < kGroup; ++k) sum += xs[m * K + g * kGroup + k];
      group_sums[m * G + g] = sum;
    }
  const uint8_t* tiles = packed.data_ptr<uint8_t>();
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(scales_zeros.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N / kTileRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = tiles + t * K * 32;
      const uint32_t* tile_pairs = pairs + t * kTileRows;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4)
        tile_rows<4>(xs + m * K, K, tile, tile_pairs, N, group_sums.data() + m * G, G,
                     o + m * N + t * kTileRows);
      for (; m < M; ++m)
        tile_rows<1>(xs + m * K, K, tile, tile_pairs, N, group_sums.data() + m * G, G,
                     o + m * N + t * kTileRows);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_tiles_mm", &int4_tiles_mm, "x @ W.T over torch's int4 CPU layout, float32 x");
}
