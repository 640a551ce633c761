// x @ W.T for int8 weights with one scale per row (int8_channels.py), by integer dot products
// over x rounded to 16 bits per row (model/quantization/int8_rows_kernel.py says why and
// when it serves).
//
//   x       [M, K] float32, contiguous
//   codes   [N, P] int8, row-major, P >= K a multiple of 32 (zero past K)
//   sums    [N] int32: each row's sum of codes
//   scales  [N] float32
//   out     [M, N] float32
//
// Row m of x is held as A = round(x / e), e = max |x_m| / (127 * 254), in two int8 digits
// A = 254 A_1 + A_0, each stored plus 128 as an unsigned byte (vpdpbusd multiplies unsigned
// by signed bytes): sum_k u_d c = sum A_d c + 128 sum c. So
//
//   y[m, n] = s_n e_m (254 S_1 + S_0 - 128 * 255 * sum_n),   S_d = sum_k u_d[k] c[n, k]
//
// with S_d summed in int32 lanes (exact: |S_d| <= 255 * 127 * P < 2^31 for P < 66k). A block
// of 4 rows of W by 2 rows of x keeps 16 accumulators (4 x 2 x 2 digits) in registers over K,
// 64 inputs an instruction; each output's lanes are summed once, at the end (sum_lanes).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kChunk = 64;  // inputs a vpdpbusd reads: 16 lanes x 4

// x's rows as their digits plus 128, [M][2][P64] bytes (P64: P rounded up to 64, zero past K
// so that a row's last chunk adds nothing), and each row's step e.
void round_rows(const float* x, int64_t M, int64_t K, int64_t P64, uint8_t* digits,
                float* steps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float largest = 0.0f;
    for (int64_t k = 0; k < K; ++k) largest = std::max(largest, std::fabs(row[k]));
    const float high_step = largest / 127.0f;
    steps[m] = high_step / 254.0f;
    const float high_inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
    const float low_inverse = largest > 0.0f ? 254.0f / high_step : 0.0f;
    uint8_t* high = digits + m * 2 * P64;
    uint8_t* low = high + P64;
    for (int64_t k = 0; k < K; ++k) {
      // Nearest (ties to even), as int4_tiles_kernel.cpp rounds: the remainder is within half
      // a high step, so its digit within 127 low steps (clamped where float's rounding strays).
      const float h = std::nearbyint(row[k] * high_inverse);
      const float l = std::nearbyint((row[k] - h * high_step) * low_inverse);
      high[k] = static_cast<uint8_t>(static_cast<int>(h) + 128);
      low[k] = static_cast<uint8_t>(std::clamp(static_cast<int>(l), -127, 127) + 128);
    }
    std::fill(high + K, high + P64, 0);
    std::fill(low + K, low + P64, 0);
  }
}

// The 16-lane sums of 8 vectors, in a tree of 128-bit block shuffles (25 instructions, where
// a reduction of each takes 9, and their shuffles were as many as the dot products at 16
// rows of x).
inline void sum_lanes(const __m512 v[8], float sums[8]) {
  __m512 pairs[4];  // pairs[p]: blocks [v_2p (b0+b2), v_2p (b1+b3), v_2p+1 (..), v_2p+1 (..)]
  for (int p = 0; p < 4; ++p)
    pairs[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
  __m512 quads[2];  // quads[h]: block j's 4 lanes sum to v_4h+j
  for (int h = 0; h < 2; ++h)
    quads[h] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2 * h], pairs[2 * h + 1], 0x88),
                             _mm512_shuffle_f32x4(pairs[2 * h], pairs[2 * h + 1], 0xDD));
  // Block j: [p0 + p2, q0 + q2, p1 + p3, q1 + q3], then lane 4j = v_j, lane 4j + 1 = v_4+j.
  const __m512 halves = _mm512_add_ps(_mm512_unpacklo_ps(quads[0], quads[1]),
                                      _mm512_unpackhi_ps(quads[0], quads[1]));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(halves, _mm512_permute_ps(halves, 0x4E)));
  for (int j = 0; j < 4; ++j) {
    sums[j] = lanes[4 * j];
    sums[4 + j] = lanes[4 * j + 1];
  }
}

// kW rows of W (from n) by kX rows of x (from m), kW kX <= 8.
template <int kW, int kX>
inline void block(const int8_t* codes, int64_t P, const uint8_t* digits, int64_t P64,
                  const int32_t* sums, const float* scales, const float* steps, int64_t n,
                  int64_t m, int64_t N, float* out) {
  __m512i acc[kW][kX][2];
  for (int w = 0; w < kW; ++w)
    for (int i = 0; i < kX; ++i) acc[w][i][0] = acc[w][i][1] = _mm512_setzero_si512();
  const auto add = [&](int64_t k, const __m512i* weight) {
    for (int i = 0; i < kX; ++i) {
      const uint8_t* row = digits + (m + i) * 2 * P64 + k;
      const __m512i high = _mm512_loadu_si512(row);
      const __m512i low = _mm512_loadu_si512(row + P64);
      for (int w = 0; w < kW; ++w) {
        acc[w][i][0] = _mm512_dpbusd_epi32(acc[w][i][0], high, weight[w]);
        acc[w][i][1] = _mm512_dpbusd_epi32(acc[w][i][1], low, weight[w]);
      }
    }
  };
  __m512i weight[kW];
  int64_t k = 0;
  for (; k + kChunk <= P; k += kChunk) {
    for (int w = 0; w < kW; ++w) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + (n + kW + w) * P + k), _MM_HINT_T0);
      weight[w] = _mm512_loadu_si512(codes + (n + w) * P + k);
    }
    add(k, weight);
  }
  if (k < P) {  // a row whose P is not a multiple of 64 ends in 32 bytes
    for (int w = 0; w < kW; ++w)
      weight[w] = _mm512_zextsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (n + w) * P + k)));
    add(k, weight);
  }
  // Each output's lanes: 254 S_1 + S_0 in float (at most 2^31 in magnitude: rounded by a few
  // parts in 10^8, far inside the activations' rounding), then summed across lanes.
  __m512 lanes[8];
  for (int w = 0; w < kW; ++w)
    for (int i = 0; i < kX; ++i)
      lanes[w * kX + i] = _mm512_fmadd_ps(_mm512_set1_ps(254.0f),
                                          _mm512_cvtepi32_ps(acc[w][i][0]),
                                          _mm512_cvtepi32_ps(acc[w][i][1]));
  for (int v = kW * kX; v < 8; ++v) lanes[v] = _mm512_setzero_ps();
  float dots[8];
  sum_lanes(lanes, dots);
  for (int w = 0; w < kW; ++w)
    for (int i = 0; i < kX; ++i) {
      const double dot = static_cast<double>(dots[w * kX + i]) - 32640.0 * sums[n + w];
      out[(m + i) * N + n + w] = scales[n + w] * steps[m + i] * static_cast<float>(dot);
    }
}

template <int kW>
inline void rows_of_w(const int8_t* codes, int64_t P, const uint8_t* digits, int64_t P64,
                      const int32_t* sums, const float* scales, const float* steps, int64_t n,
                      int64_t M, int64_t N, float* out) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) block<kW, 2>(codes, P, digits, P64, sums, scales, steps, n, m, N, out);
  if (m < M) block<kW, 1>(codes, P, digits, P64, sums, scales, steps, n, m, N, out);
}

}  // namespace

torch::Tensor int8_rows_dot(torch::Tensor x, torch::Tensor codes, torch::Tensor sums,
                            torch::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x: [M, K] float32, contiguous");
  TORCH_CHECK(codes.scalar_type() == torch::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "codes: [N, P] int8, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), P = codes.size(1);
  TORCH_CHECK(P >= K && P % 32 == 0 && P < 65536, "codes: rows of P >= K inputs, P % 32 == 0");
  TORCH_CHECK(sums.scalar_type() == torch::kInt && sums.numel() == N && sums.is_contiguous(),
              "sums: [N] int32");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.numel() == N &&
                  scales.is_contiguous(),
              "scales: [N] float32");
  const int64_t P64 = (P + kChunk - 1) / kChunk * kChunk;
  std::vector<uint8_t> digits(M * 2 * P64);
  std::vector<float> steps(M);
  round_rows(x.data_ptr<float>(), M, K, P64, digits.data(), steps.data());
  auto out = torch::empty({M, N}, x.options());
  const int8_t* c = codes.data_ptr<int8_t>();
  const int32_t* s = sums.data_ptr<int32_t>();
  const float* f = scales.data_ptr<float>();
  float* y = out.data_ptr<float>();
  constexpr int64_t kW = 4;
  at::parallel_for(0, (N + kW - 1) / kW, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kW;
      if (n + kW <= N) {
        rows_of_w<kW>(c, P, digits.data(), P64, s, f, steps.data(), n, M, N, y);
      } else {
        for (int64_t r = n; r < N; ++r)
          rows_of_w<1>(c, P, digits.data(), P64, s, f, steps.data(), r, M, N, y);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_rows_dot", &int8_rows_dot, "x @ W.T, int8 rows, x rounded to 16 bits per row");
}
