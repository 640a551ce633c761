// x @ W.T for one 4-bit plane held in torch's int4 CPU layout, with float32 activations:
// the weights are widened to float32 in registers, never written out
// (model/quantization/int4_tiles_kernel.py says when it serves and why).
//
//   x             [M, K] float32, contiguous
//   packed        [N, K / 2] uint8: N / T tiles of [K, T / 2] bytes; byte [k, j] of tile t
//                 holds row Tt + j (low nibble) and row Tt + T/2 + j (high nibble) at input
//                 k. T is 64 where torch dispatches to AVX-512, 32 on AVX2 (tile_rows)
//   scales_zeros  [K / 32, N, 2] float16: per group of 32 inputs and row, S then Z
//   out           [M, N] float32: sum over groups g of S (sum_k x_k q_k) + Z xs_g,
//                 xs_g the group's sum of x
//
// A code of 5-8 bits is two planes (int4_planes.py): high nibbles h with (16 s, Z_h), low
// ones l with (s, Z_l). Both are read in one pass as the code c = 16 h + l, whose weight is
// s c + (Z_h + Z_l): one set of sums, the products' count of one plane.
//
// A tile is walked group by group; per input k its T / 2 bytes become the T rows' weights
// in four registers (16 lanes on AVX-512, 8 on AVX2: the first and second halves of the low
// nibbles, then of the high), and kRows rows of x at a time accumulate them (the tile's
// bytes stay in L1 across the row blocks). Each group's sums are scaled into the totals
// once, in float32 throughout.

#include <torch/extension.h>
#include <pybind11/stl.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

#ifdef __AVX512F__
constexpr int64_t kTileRows = 64;

inline __m512 half_low(__m512i pairs) {  // S of each (S, Z) float16 pair, as float32
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
}

inline __m512 half_high(__m512i pairs) {  // Z of each (S, Z) pair
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
}

template <int kRows, bool kTwoPlanes>
void tile_rows_avx512(const float* x, int64_t K, const uint8_t* tile, const uint32_t* scales_zeros,
               const uint8_t* high_tile, const uint32_t* high_scales_zeros, int64_t N,
               const float* group_sums, int64_t G, float* out) {
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
      __m512i codes[4] = {
          _mm512_and_si512(first, low_mask),
          _mm512_and_si512(second, low_mask),
          _mm512_srli_epi32(first, 4),
          _mm512_srli_epi32(second, 4),
      };
      if constexpr (kTwoPlanes) {
        const __m256i high_bytes =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high_tile + k * 32));
        const __m512i high_first = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(high_bytes));
        const __m512i high_second = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(high_bytes, 1));
        const __m512i high[4] = {
            _mm512_and_si512(high_first, low_mask),
            _mm512_and_si512(high_second, low_mask),
            _mm512_srli_epi32(high_first, 4),
            _mm512_srli_epi32(high_second, 4),
        };
        for (int j = 0; j < 4; ++j) codes[j] = _mm512_or_si512(codes[j], _mm512_slli_epi32(high[j], 4));
      }
      __m512 w[4];
      for (int j = 0; j < 4; ++j) w[j] = _mm512_cvtepi32_ps(codes[j]);
      for (int i = 0; i < kRows; ++i) {
        const __m512 xv = _mm512_set1_ps(x[i * K + k]);
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
      }
    }
    const uint32_t* pairs = scales_zeros + g * N;  // this tile's 64 rows, (S, Z) each
    for (int j = 0; j < 4; ++j) {
      const __m512i packed_pairs = _mm512_loadu_si512(pairs + 16 * j);
      const __m512 scale = half_low(packed_pairs);
      __m512 zero = half_high(packed_pairs);
      if constexpr (kTwoPlanes) {
        const __m512i high_pairs = _mm512_loadu_si512(high_scales_zeros + g * N + 16 * j);
        zero = _mm512_add_ps(zero, half_high(high_pairs));
      }
      for (int i = 0; i < kRows; ++i) {
        const __m512 sum = _mm512_set1_ps(group_sums[i * G + g]);
        __m512 running = kTotalsInRegisters ? held[j] : _mm512_load_ps(&total[i][16 * j]);
        running = _mm512_fmadd_ps(scale, acc[i][j], running);
        running = _mm512_fmadd_ps(zero, sum, running);
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

#endif  // __AVX512F__

// The AVX2 layout's tile (T = 32): 8 lanes a register. F16C widens 8 consecutive halves,
// and the scales interleave with the zeros here: a byte shuffle gathers each (S, Z) pair's
// S (or its Z) into the low 8 bytes of each 128-bit lane, and a lane permute joins them.
inline __m128i halves_of_pairs(__m256i pairs, __m256i pick) {
  const __m256i picked = _mm256_shuffle_epi8(pairs, pick);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(picked, 0b1000));
}

template <int kRows, bool kTwoPlanes>
void tile_rows_avx2(const float* x, int64_t K, const uint8_t* tile, const uint32_t* scales_zeros,
                    const uint8_t* high_tile, const uint32_t* high_scales_zeros, int64_t N,
                    const float* group_sums, int64_t G, float* out) {
  constexpr int64_t kRowsPerTile = 32;
  constexpr bool kTotalsInRegisters = kRows == 1;  // as tile_rows_avx512
  alignas(32) float total[kRows][kRowsPerTile] = {};
  __m256 held[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                    _mm256_setzero_ps()};
  const __m256i low_mask = _mm256_set1_epi32(15);
  const __m256i pick_scale = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1,
                                              -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1,
                                              -1, -1, -1, -1);
  const __m256i pick_zero = _mm256_add_epi8(
      pick_scale, _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2,
                                   2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0));
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[kRows][4];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + k * 16));
      const __m256i first = _mm256_cvtepu8_epi32(bytes);
      const __m256i second = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
      __m256i codes[4] = {
          _mm256_and_si256(first, low_mask),
          _mm256_and_si256(second, low_mask),
          _mm256_srli_epi32(first, 4),
          _mm256_srli_epi32(second, 4),
      };
      if constexpr (kTwoPlanes) {
        const __m128i high_bytes =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(high_tile + k * 16));
        const __m256i high_first = _mm256_cvtepu8_epi32(high_bytes);
        const __m256i high_second = _mm256_cvtepu8_epi32(_mm_srli_si128(high_bytes, 8));
        const __m256i high[4] = {
            _mm256_and_si256(high_first, low_mask),
            _mm256_and_si256(high_second, low_mask),
            _mm256_srli_epi32(high_first, 4),
            _mm256_srli_epi32(high_second, 4),
        };
        for (int j = 0; j < 4; ++j)
          codes[j] = _mm256_or_si256(codes[j], _mm256_slli_epi32(high[j], 4));
      }
      __m256 w[4];
      for (int j = 0; j < 4; ++j) w[j] = _mm256_cvtepi32_ps(codes[j]);
      for (int i = 0; i < kRows; ++i) {
        const __m256 xv = _mm256_set1_ps(x[i * K + k]);
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
      }
    }
    const uint32_t* pairs = scales_zeros + g * N;  // this tile's 32 rows, (S, Z) each
    for (int j = 0; j < 4; ++j) {
      const __m256i packed_pairs =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 8 * j));
      const __m256 scale = _mm256_cvtph_ps(halves_of_pairs(packed_pairs, pick_scale));
      __m256 zero = _mm256_cvtph_ps(halves_of_pairs(packed_pairs, pick_zero));
      if constexpr (kTwoPlanes) {
        const __m256i high_pairs = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(high_scales_zeros + g * N + 8 * j));
        zero = _mm256_add_ps(zero, _mm256_cvtph_ps(halves_of_pairs(high_pairs, pick_zero)));
      }
      for (int i = 0; i < kRows; ++i) {
        const __m256 sum = _mm256_set1_ps(group_sums[i * G + g]);
        __m256 running = kTotalsInRegisters ? held[j] : _mm256_load_ps(&total[i][8 * j]);
        running = _mm256_fmadd_ps(scale, acc[i][j], running);
        running = _mm256_fmadd_ps(zero, sum, running);
        if constexpr (kTotalsInRegisters) {
          held[j] = running;
        } else {
          _mm256_store_ps(&total[i][8 * j], running);
        }
      }
    }
  }
  if constexpr (kTotalsInRegisters) {
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + 8 * j, held[j]);
  } else {
    for (int i = 0; i < kRows; ++i) std::memcpy(out + i * N, total[i], sizeof(total[i]));
  }
}

void check_plane(const torch::Tensor& packed, const torch::Tensor& scales_zeros, int64_t K,
                 int64_t N) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous(), "packed: uint8");
  TORCH_CHECK(scales_zeros.dtype() == torch::kHalf && scales_zeros.is_contiguous(),
              "scales_zeros: float16");
  TORCH_CHECK(packed.size(0) == N && packed.size(1) * 2 == K, "packed: [N, K / 2]");
  TORCH_CHECK(scales_zeros.size(0) == K / kGroup && scales_zeros.size(1) == N,
              "scales_zeros: [K / 32, N, 2]");
}

// Runs one tile kernel over every tile and every row block of x (kBlock rows, then 1 at a
// time: 4 on AVX-512's 32 registers, 2 on AVX2's 16, where 4 rows' sums would spill).
template <int64_t kTile, int64_t kBlock, typename Block, typename One>
void over_tiles(Block block, One one, const float* xs, int64_t M, int64_t K, int64_t N,
                const uint8_t* tiles, const uint32_t* pairs, const uint8_t* high_tiles,
                const uint32_t* high_pairs, const float* group_sums, int64_t G, float* o) {
  at::parallel_for(0, N / kTile, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = tiles + t * K * (kTile / 2);
      const uint8_t* high_tile = high_tiles ? high_tiles + t * K * (kTile / 2) : nullptr;
      const uint32_t* high_tile_pairs = high_pairs ? high_pairs + t * kTile : nullptr;
      const auto rows = [&](auto run, int64_t m) {
        run(xs + m * K, K, tile, pairs + t * kTile, high_tile, high_tile_pairs, N,
            group_sums + m * G, G, o + m * N + t * kTile);
      };
      int64_t m = 0;
      for (; m + kBlock <= M; m += kBlock) rows(block, m);
      for (; m < M; ++m) rows(one, m);
    }
  });
}

// planes: [low] (codes of 4 bits) or [high, low] (5-8 bits), as int4_planes.py holds them;
// tile_rows: T of torch's layout here (64 or 32).
torch::Tensor int4_tiles_mm(torch::Tensor x, std::vector<torch::Tensor> planes,
                            int64_t tile_rows) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2,
              "x: [M, K] float32, contiguous");
  TORCH_CHECK(planes.size() == 2 || planes.size() == 4, "one or two (packed, scales) planes");
  TORCH_CHECK(tile_rows == 32 || tile_rows == 64, "tiles of 32 or 64 rows");
#ifndef __AVX512F__
  TORCH_CHECK(tile_rows == 32, "built without AVX-512: tiles of 32 rows only");
#endif
  const bool two_planes = planes.size() == 4;
  const torch::Tensor& packed = planes[planes.size() - 2];
  const torch::Tensor& scales_zeros = planes[planes.size() - 1];
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(K % kGroup == 0 && N % tile_rows == 0, "K a multiple of 32, N of the tile");
  check_plane(packed, scales_zeros, K, N);
  if (two_planes) check_plane(planes[0], planes[1], K, N);
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
  const auto as_pairs = [](const torch::Tensor& t) {
    return reinterpret_cast<const uint32_t*>(t.data_ptr<at::Half>());
  };
  const uint8_t* tiles = packed.data_ptr<uint8_t>();
  const uint32_t* pairs = as_pairs(scales_zeros);
  const uint8_t* high_tiles = two_planes ? planes[0].data_ptr<uint8_t>() : nullptr;
  const uint32_t* high_pairs = two_planes ? as_pairs(planes[1]) : nullptr;
  const auto run = [&](auto tile, auto block_rows, auto block, auto one) {
    over_tiles<decltype(tile)::value, decltype(block_rows)::value>(
        block, one, xs, M, K, N, tiles, pairs, high_tiles, high_pairs, group_sums.data(), G,
        out.data_ptr<float>());
  };
  using Avx2 = std::integral_constant<int64_t, 32>;
  using TwoRows = std::integral_constant<int64_t, 2>;
  if (tile_rows == 32) {
    if (two_planes) run(Avx2{}, TwoRows{}, tile_rows_avx2<2, true>, tile_rows_avx2<1, true>);
    else run(Avx2{}, TwoRows{}, tile_rows_avx2<2, false>, tile_rows_avx2<1, false>);
  }
#ifdef __AVX512F__
  using Avx512 = std::integral_constant<int64_t, 64>;
  using FourRows = std::integral_constant<int64_t, 4>;
  if (tile_rows == 64) {
    if (two_planes)
      run(Avx512{}, FourRows{}, tile_rows_avx512<4, true>, tile_rows_avx512<1, true>);
    else
      run(Avx512{}, FourRows{}, tile_rows_avx512<4, false>, tile_rows_avx512<1, false>);
  }
#endif
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_tiles_mm", &int4_tiles_mm, "x @ W.T over torch's int4 CPU layout, float32 x");
#ifdef __AVX512F__
  m.attr("tile_rows") = std::vector<int64_t>{32, 64};
#else
  m.attr("tile_rows") = std::vector<int64_t>{32};
#endif
}
