// x @ W.T for 4-bit planes held in torch's int4 CPU layout, with float32 activations, two
// ways (model/quantization/int4_tiles_kernel.py says when each serves and why): exact, the
// weights widened to float32 in registers, never written out (first below); and by integer
// dot products over x rounded to 16 bits (tile_dot512).
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
// s c + (Z_h + Z_l): one set of sums, the products' count of one plane. int4_planes.py puts
// the whole zero in the low plane (Z_h = 0), so the integer-dot kernel reads the low plane's
// pairs only (a tenth of an 8-bit weight's bytes); the exact kernels add both.
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
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

// A tile's scale pairs lie a row of scales_zeros apart per group (N pairs: 192 KiB for
// smollm2's 49k-row LM head), so no hardware prefetcher follows them and, with the weights
// out of cache, each group's read waits on memory. The next tile's pairs of a group are the
// T right after this tile's: asked for at the group's start, they arrive while this tile is
// multiplied. Measured on smollm2 decoding (Zen 5, one thread): 1.09x at batch 1, 1.06x at 16.
template <int64_t T>
inline void prefetch_next_tile_pairs(const uint32_t* pairs) {
  const char* next = reinterpret_cast<const char*>(pairs + T);
  for (int64_t line = 0; line < T * 4; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
}

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
    prefetch_next_tile_pairs<kTileRows>(scales_zeros + g * N);
    if constexpr (kTwoPlanes) prefetch_next_tile_pairs<kTileRows>(high_scales_zeros + g * N);
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

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// The integer-dot variant: x rounded to 16 bits per group of 32 (x_k ~ e A_k, e = max |x| /
// (127 * 254), A_k = 254 A_1 + A_0 in two int8 digits), and per input quad the tile's 4 x 32
// bytes regathered by one byte permute per 32 rows into dwords of one row's 4 codes, which
// vpdpbusd multiplies by the quad's 4 digits and sums into int32: 64 products an
// instruction where the float kernel makes 16, and no widening of the codes. Per group:
// S e (sum A q) + Z xs, xs the exact float sum of x over the group.
//
// A tile is walked group by group: the group's codes are regathered once into 2 KiB of L1
// (8 quads x 4 registers of 16 rows), then every block of kRows rows of x reads them there;
// each row's 64 totals live in L1 across the groups.

constexpr int kQuads = kGroup / 4;

struct GroupCodes {
  __m512i quad[kQuads][4];  // [input quad][rows 16 j .. 16 j + 15], 4 codes a dword
};

// Byte 4 j + q of the first (second) gather: input q of row j (16 + j) in the low nibbles,
// row 32 + j (48 + j) in the high ones, from a quad's 128 bytes [4 inputs][32].
struct QuadGather {
  __m512i first, second;
  QuadGather() {
    alignas(64) static const auto indices = [] {
      std::array<uint8_t, 128> index{};
      for (int j = 0; j < 16; ++j)
        for (int q = 0; q < 4; ++q) {
          index[4 * j + q] = static_cast<uint8_t>(32 * q + j);
          index[64 + 4 * j + q] = static_cast<uint8_t>(32 * q + 16 + j);
        }
      return index;
    }();
    first = _mm512_load_si512(indices.data());
    second = _mm512_load_si512(indices.data() + 64);
  }
};

// The codes of one plane's group (32 inputs of 64 rows: bytes [32 inputs][32]) into codes.
inline void gather_group(const uint8_t* group, GroupCodes& codes) {
  const QuadGather gather;
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int q = 0; q < kQuads; ++q) {
    const __m512i inputs01 = _mm512_loadu_si512(group + 128 * q);
    const __m512i inputs23 = _mm512_loadu_si512(group + 128 * q + 64);
    const __m512i first = _mm512_permutex2var_epi8(inputs01, gather.first, inputs23);
    const __m512i second = _mm512_permutex2var_epi8(inputs01, gather.second, inputs23);
    codes.quad[q][0] = _mm512_and_si512(first, nibble);
    codes.quad[q][1] = _mm512_and_si512(second, nibble);
    codes.quad[q][2] = _mm512_and_si512(_mm512_srli_epi16(first, 4), nibble);
    codes.quad[q][3] = _mm512_and_si512(_mm512_srli_epi16(second, 4), nibble);
  }
}

// The 8-bit codes 16 h + l of two planes' group (high and low nibbles, each laid out as
// gather_group reads one): both permuted alike, then each code's nibbles joined by one
// bitwise select (vpternlogd: low nibble from the low plane, high from the high), 16
// instructions a quad where gathering each plane and joining them took 26.
inline void gather_group_pair(const uint8_t* low, const uint8_t* high, GroupCodes& codes) {
  const QuadGather gather;
  const __m512i low_nibble = _mm512_set1_epi8(15);
  constexpr int kSelect = 0xE4;  // (c & a) | (~c & b), c the low nibbles' mask
  for (int q = 0; q < kQuads; ++q) {
    const auto permuted = [&](const uint8_t* group, const __m512i& index) {
      return _mm512_permutex2var_epi8(_mm512_loadu_si512(group + 128 * q), index,
                                      _mm512_loadu_si512(group + 128 * q + 64));
    };
    const __m512i low_first = permuted(low, gather.first);
    const __m512i low_second = permuted(low, gather.second);
    const __m512i high_first = permuted(high, gather.first);
    const __m512i high_second = permuted(high, gather.second);
    codes.quad[q][0] = _mm512_ternarylogic_epi32(
        low_first, _mm512_slli_epi16(high_first, 4), low_nibble, kSelect);
    codes.quad[q][1] = _mm512_ternarylogic_epi32(
        low_second, _mm512_slli_epi16(high_second, 4), low_nibble, kSelect);
    codes.quad[q][2] = _mm512_ternarylogic_epi32(
        _mm512_srli_epi16(low_first, 4), high_first, low_nibble, kSelect);
    codes.quad[q][3] = _mm512_ternarylogic_epi32(
        _mm512_srli_epi16(low_second, 4), high_second, low_nibble, kSelect);
  }
}

// kRows rows of x by one group's codes, added into their totals: S e (sum A q) + Z xs. Each
// row's group is 64 bytes at a (row stride 2 K): x's 16-bit value A = 254 A_1 + A_0 as two
// int8 digits, the high then the low (32 bytes each), so sum A q = 254 sum A_1 q + sum A_0 q,
// accumulated in int32 (|254 sum A_1 q| <= 254 * 32 * 255 * 127 < 2^31); e is its step.
template <int kRows>
inline void dot_rows(const GroupCodes& codes, const int8_t* a, int64_t K, const float* steps,
                     const float* sums, int64_t G, const __m512 scale[4], const __m512 zero[4],
                     float* totals) {
  __m512i acc[kRows][4];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_si512();
  const auto add_digit = [&](int digit) {
    for (int q = 0; q < kQuads; ++q) {
      for (int i = 0; i < kRows; ++i) {
        int32_t quad;
        std::memcpy(&quad, a + i * 2 * K + kGroup * digit + 4 * q, sizeof(quad));
        const __m512i xq = _mm512_set1_epi32(quad);
        for (int j = 0; j < 4; ++j)
          acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], _mm512_load_si512(&codes.quad[q][j]), xq);
      }
    }
  };
  add_digit(0);
  const __m512i radix = _mm512_set1_epi32(254);
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_mullo_epi32(acc[i][j], radix);
  add_digit(1);
  for (int i = 0; i < kRows; ++i) {
    const __m512 step = _mm512_set1_ps(steps[i * G]);
    const __m512 sum = _mm512_set1_ps(sums[i * G]);
    for (int j = 0; j < 4; ++j) {
      float* total = totals + i * kTileRows + 16 * j;
      __m512 running = _mm512_load_ps(total);
      running = _mm512_fmadd_ps(_mm512_mul_ps(scale[j], step), _mm512_cvtepi32_ps(acc[i][j]),
                                running);
      _mm512_store_ps(total, _mm512_fmadd_ps(zero[j], sum, running));
    }
  }
}

// All M rows of x by one tile of 64 rows: out[m, 0..63], row stride N.
template <bool kTwoPlanes>
void tile_dot512(const int8_t* a, int64_t M, int64_t K, const uint8_t* tile,
                 const uint32_t* scales_zeros, const uint8_t* high_tile, int64_t N,
                 const float* group_sums, const float* steps, int64_t G, float* out) {
  std::vector<__m512> totals(M * 4, _mm512_setzero_ps());  // [M][64 rows], 64-byte aligned
  float* total = reinterpret_cast<float*>(totals.data());
  GroupCodes codes;
  for (int64_t g = 0; g < G; ++g) {
    prefetch_next_tile_pairs<kTileRows>(scales_zeros + g * N);
    if constexpr (kTwoPlanes) {
      gather_group_pair(tile + g * kGroup * 32, high_tile + g * kGroup * 32, codes);
    } else {
      gather_group(tile + g * kGroup * 32, codes);
    }
    __m512 scale[4], zero[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i pairs = _mm512_loadu_si512(scales_zeros + g * N + 16 * j);
      scale[j] = half_low(pairs);
      zero[j] = half_high(pairs);  // two planes: the whole zero (the high plane's are 0)
    }
    const auto rows = [&](auto count, int64_t m) {
      dot_rows<decltype(count)::value>(codes, a + 2 * (m * K + g * kGroup), K, steps + m * G + g,
                                       group_sums + m * G + g, G, scale, zero,
                                       total + m * kTileRows);
    };
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) rows(std::integral_constant<int, 4>{}, m);
    for (; m < M; ++m) rows(std::integral_constant<int, 1>{}, m);
  }
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(out + m * N, total + m * kTileRows, kTileRows * sizeof(float));
}
#endif  // __AVX512VNNI__ && __AVX512VBMI__

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
    prefetch_next_tile_pairs<kRowsPerTile>(scales_zeros + g * N);
    if constexpr (kTwoPlanes) prefetch_next_tile_pairs<kRowsPerTile>(high_scales_zeros + g * N);
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

// Runs a tile kernel over every tile and every row block of x: rows(t, m, n) multiplies
// rows [m, m + n) by tile t, n = kBlock (4 on AVX-512's 32 registers, 2 on AVX2's 16, where
// 4 rows' sums would spill) while that many are left, then 1.
template <int64_t kTile, int kBlock, typename Rows>
void over_tiles(Rows rows, int64_t M, int64_t N) {
  at::parallel_for(0, N / kTile, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t m = 0;
      for (; m + kBlock <= M; m += kBlock) rows(t, m, std::integral_constant<int, kBlock>{});
      for (; m < M; ++m) rows(t, m, std::integral_constant<int, 1>{});
    }
  });
}

// The operands both kernels read: the planes checked, and each row's sum of x per group.
struct Operands {
  int64_t M, K, N, G;
  const uint8_t* tiles;
  const uint32_t* pairs;
  const uint8_t* high_tiles;  // null with one plane
  const uint32_t* high_pairs;
  std::vector<float> group_sums;  // [M, G]
};

Operands operands(const torch::Tensor& x, const std::vector<torch::Tensor>& planes,
                  int64_t tile_rows) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2,
              "x: [M, K] float32, contiguous");
  TORCH_CHECK(planes.size() == 2 || planes.size() == 4, "one or two (packed, scales) planes");
  TORCH_CHECK(tile_rows == 32 || tile_rows == 64, "tiles of 32 or 64 rows");
  const bool two_planes = planes.size() == 4;
  const torch::Tensor& packed = planes[planes.size() - 2];
  const torch::Tensor& scales_zeros = planes[planes.size() - 1];
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(K % kGroup == 0 && N % tile_rows == 0, "K a multiple of 32, N of the tile");
  check_plane(packed, scales_zeros, K, N);
  if (two_planes) check_plane(planes[0], planes[1], K, N);
  const auto as_pairs = [](const torch::Tensor& t) {
    return reinterpret_cast<const uint32_t*>(t.data_ptr<at::Half>());
  };
  Operands o{M, K, N, K / kGroup, packed.data_ptr<uint8_t>(), as_pairs(scales_zeros),
             two_planes ? planes[0].data_ptr<uint8_t>() : nullptr,
             two_planes ? as_pairs(planes[1]) : nullptr, std::vector<float>(M * (K / kGroup))};
  const float* xs = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < o.G; ++g) {
      float sum = 0.0f;
      for (int64_t k = 0; k < kGroup; ++k) sum += xs[m * K + g * kGroup + k];
      o.group_sums[m * o.G + g] = sum;
    }
  return o;
}

// planes: [low] (codes of 4 bits) or [high, low] (5-8 bits), as int4_planes.py holds them;
// tile_rows: T of torch's layout here (64 or 32).
torch::Tensor int4_tiles_mm(torch::Tensor x, std::vector<torch::Tensor> planes,
                            int64_t tile_rows) {
#ifndef __AVX512F__
  TORCH_CHECK(tile_rows == 32, "built without AVX-512: tiles of 32 rows only");
#endif
  const Operands o = operands(x, planes, tile_rows);
  auto out = torch::empty({o.M, o.N}, x.options());
  const float* xs = x.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const auto dispatch = [&](auto tile, auto block, auto kernel) {
    constexpr int64_t T = decltype(tile)::value;
    over_tiles<T, decltype(block)::value>(
        [&](int64_t t, int64_t m, auto rows) {
          kernel(rows, xs + m * o.K, o.K, o.tiles + t * o.K * (T / 2), o.pairs + t * T,
                 o.high_tiles ? o.high_tiles + t * o.K * (T / 2) : nullptr,
                 o.high_pairs ? o.high_pairs + t * T : nullptr, o.N,
                 o.group_sums.data() + m * o.G, o.G, y + m * o.N + t * T);
        },
        o.M, o.N);
  };
  const bool two_planes = o.high_tiles != nullptr;
  if (tile_rows == 32) {
    dispatch(std::integral_constant<int64_t, 32>{}, std::integral_constant<int, 2>{},
             [&](auto rows, auto... args) {
               constexpr int n = decltype(rows)::value;
               if (two_planes) tile_rows_avx2<n, true>(args...);
               else tile_rows_avx2<n, false>(args...);
             });
  }
#ifdef __AVX512F__
  if (tile_rows == 64) {
    dispatch(std::integral_constant<int64_t, 64>{}, std::integral_constant<int, 4>{},
             [&](auto rows, auto... args) {
               constexpr int n = decltype(rows)::value;
               if (two_planes) tile_rows_avx512<n, true>(args...);
               else tile_rows_avx512<n, false>(args...);
             });
  }
#endif
  return out;
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// x @ W.T with x rounded to 16 bits per group of 32 (tile_dot512): tiles of 64 rows only.
torch::Tensor int4_tiles_dot(torch::Tensor x, std::vector<torch::Tensor> planes,
                             int64_t tile_rows) {
  TORCH_CHECK(tile_rows == 64, "the integer-dot kernel reads tiles of 64 rows");
  const Operands o = operands(x, planes, tile_rows);
  const float* xs = x.data_ptr<float>();
  std::vector<int8_t> digits(2 * o.M * o.K);  // [M][G][high, low][32]
  std::vector<float> steps(o.M * o.G);
  for (int64_t r = 0; r < o.M * o.G; ++r) {  // one group of one row: r = m G + g
    const __m512 halves[2] = {_mm512_loadu_ps(xs + r * kGroup), _mm512_loadu_ps(xs + r * kGroup + 16)};
    const float largest = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_abs_ps(halves[0]), _mm512_abs_ps(halves[1])));
    const float high_step = largest / 127.0f;  // |x| <= 127 steps
    steps[r] = high_step / 254.0f;
    const __m512 high_inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    const __m512 low_inverse = _mm512_set1_ps(largest > 0.0f ? 254.0f / high_step : 0.0f);
    int8_t* out = digits.data() + 2 * r * kGroup;
    for (int h = 0; h < 2; ++h) {
      // Nearest, ties to even (the default rounding mode): the remainder is within half a
      // high step, so its digit within 127 low steps (saturating where float's rounding
      // strays past).
      const __m512i high = _mm512_cvtps_epi32(_mm512_mul_ps(halves[h], high_inverse));
      const __m512 remainder =
          _mm512_fnmadd_ps(_mm512_cvtepi32_ps(high), _mm512_set1_ps(high_step), halves[h]);
      const __m512i low = _mm512_cvtps_epi32(_mm512_mul_ps(remainder, low_inverse));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h), _mm512_cvtsepi32_epi8(high));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + kGroup + 16 * h),
                       _mm512_cvtsepi32_epi8(low));
    }
  }
  auto out = torch::empty({o.M, o.N}, x.options());
  float* y = out.data_ptr<float>();
  // Rows of x in blocks of kRowBlock, each block by every tile of the thread's share: the
  // block's int8 rows (K bytes each) stay in L2 while the tiles stream past.
  constexpr int64_t kRowBlock = 256;
  const auto each_tile = [&](auto kernel) {
    at::parallel_for(0, o.N / 64, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = 0; m < o.M; m += kRowBlock)
        for (int64_t t = begin; t < end; ++t)
          kernel(digits.data() + 2 * m * o.K, std::min(kRowBlock, o.M - m), o.K,
                 o.tiles + t * o.K * 32, o.pairs + t * 64,
                 o.high_tiles ? o.high_tiles + t * o.K * 32 : nullptr, o.N,
                 o.group_sums.data() + m * o.G, steps.data() + m * o.G, o.G,
                 y + m * o.N + t * 64);
    });
  };
  if (o.high_tiles) each_tile(tile_dot512<true>);
  else each_tile(tile_dot512<false>);
  return out;
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_tiles_mm", &int4_tiles_mm, "x @ W.T over torch's int4 CPU layout, float32 x");
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  m.def("int4_tiles_dot", &int4_tiles_dot, "x @ W.T, x rounded to 16 bits per group of 32");
  m.attr("dot_tile_rows") = std::vector<int64_t>{64};
#else
  m.attr("dot_tile_rows") = std::vector<int64_t>{};
#endif
#ifdef __AVX512F__
  m.attr("tile_rows") = std::vector<int64_t>{32, 64};
#else
  m.attr("tile_rows") = std::vector<int64_t>{32};
#endif
}
