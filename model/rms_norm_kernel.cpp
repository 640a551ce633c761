// RMSNorm of float32 rows in one pass over each row: torch's CPU rms_norm is a composite of
// six operations (pow, mean, add, rsqrt, mul, mul), ~16 us a call on a decode step's rows,
// where the arithmetic takes under one. See rms_norm_kernel.py.
//
// Plain pybind11 over raw addresses (no torch headers: a build of seconds, not of ~20 s);
// the Python side checks dtypes, devices and strides before it calls.

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>

namespace {

// x: rows [outer, inner, columns] at strides (x_outer, x_inner, 1); out: the same rows at
// (out_outer, out_inner, 1). out[r] = (x[r] * rsqrt(mean(x[r]^2) + eps)) * (w + offset), in
// the order transformers' RMSNorm multiplies.
void rms_norm(std::uintptr_t x_address, std::int64_t outer, std::int64_t inner,
              std::int64_t columns, std::int64_t x_outer, std::int64_t x_inner,
              std::uintptr_t out_address, std::int64_t out_outer, std::int64_t out_inner,
              std::uintptr_t weight_address, double weight_offset, double eps) {
  const float* x = reinterpret_cast<const float*>(x_address);
  const float* weight = reinterpret_cast<const float*>(weight_address);
  float* out = reinterpret_cast<float*>(out_address);
  const float offset = static_cast<float>(weight_offset);
  const float epsilon = static_cast<float>(eps);
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t i = 0; i < inner; ++i) {
      const float* row = x + o * x_outer + i * x_inner;
      float* normed = out + o * out_outer + i * out_inner;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (std::int64_t c = 0; c < columns; ++c) squares += row[c] * row[c];
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(columns) + epsilon);
#pragma omp simd
      for (std::int64_t c = 0; c < columns; ++c) {
        normed[c] = (row[c] * scale) * (weight[c] + offset);
      }
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows, one pass a row");
}
