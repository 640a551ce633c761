// Decode attention that reads the KV pages where they lie: one pass over each row's keys,
// no gather (model/paged_decode_kernel.py says when it serves and why).
//
//   query        [batch, num_heads, head_size]                 float32, head_size contiguous
//   layer_cache  [num_blocks, entries, block_size, kv_heads, head_size]   one layer's view of
//                the KV tensor, any strides but the last (entries 2: K then V; 1: latent rows,
//                the values are the keys: MLA's absorbed form); float32, or float16 /
//                bfloat16 (a 16-bit kv_cache_dtype), widened to float32 as it is read
//   tables       [batch, width] int64   the row's pages, from the first one it reads
//   low, high    [batch] int64          the row sees keys [low, high), counted from tables[b][0]
//
// A row's keys are walked in spans of kSpan. For each KV head, the group of query heads
// that share it scores the span (each key row read once for the whole group), updates its
// softmax once (flash-decoding's running max and sum) and weighs the values in. The common
// shapes (head size 64 or 128, groups of 1 to 8) are compiled with both sizes fixed: every
// KV head takes the span while its pages are still in the cache, its accumulators held in
// registers for the span. Any other shape takes the same loop, head by head over the whole
// row, with sizes known at run time.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kSpan = 128;

// How a page's element becomes a float: float32 pages as they are; 16-bit pages (a
// kv_cache_dtype of float16 or bfloat16 under a float32 model) widened as they are read.
struct Float32 {
  using Element = float;
  static float widen(float x) { return x; }
};
struct BFloat16 {
  using Element = uint16_t;
  static float widen(uint16_t x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
};
// IEEE half to float in integer and float operations the compiler vectorizes (a conversion
// of _Float16 is a library call per element without AVX512-FP16: 20x slower here). The
// exponent is rebased; infinities and NaNs keep an all-ones exponent, and subnormal halves
// are renormalised by one float subtraction.
struct Float16 {
  using Element = uint16_t;
  static float widen(uint16_t half) {
    const uint32_t magnitude = static_cast<uint32_t>(half & 0x7fff) << 13;
    const uint32_t exponent = magnitude & (0x7c00u << 13);
    uint32_t bits = magnitude + ((127 - 15) << 23);
    bits += exponent == (0x7c00u << 13) ? ((128 - 16) << 23) : 0;  // inf, NaN
    float value = std::bit_cast<float>(bits + (exponent == 0 ? (1u << 23) : 0));
    value -= exponent == 0 ? std::bit_cast<float>(113u << 23) : 0.f;  // subnormal, zero
    const uint32_t sign = static_cast<uint32_t>(half & 0x8000) << 16;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(value) | sign);
  }
};

struct Pages {
  const float* query;
  int64_t query_row, query_head;
  const void* cache;
  int64_t block_stride, entry_stride, slot_stride, head_stride, value_entry;
  const int64_t* tables;
  int64_t width, block_size;
  const int64_t* low;
  const int64_t* high;
  float* out;
  int64_t num_heads, kv_heads;
  float scale;
};

// The pointers to the key rows of keys [start, start + n) of row b, KV head h.
template <typename T>
inline void key_rows(const Pages& p, int64_t b, int64_t h, int64_t start, int64_t n,
                     const T** rows) {
  const int64_t* table = p.tables + b * p.width;
  const T* cache = static_cast<const T*>(p.cache);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t key = start + j;
    rows[j] = cache + table[key / p.block_size] * p.block_stride +
              (key % p.block_size) * p.slot_stride + h * p.head_stride;
  }
}

// Scores of a span to probabilities under the running max; returns the span's rescale of
// what was accumulated before it.
inline float softmax_update(float* scores, int64_t n, float& running_max, float& running_sum) {
  float span_max = -std::numeric_limits<float>::max();
  for (int64_t j = 0; j < n; ++j) span_max = std::max(span_max, scores[j]);
  const float new_max = std::max(running_max, span_max);
  const float rescale = std::exp(running_max - new_max);
  running_max = new_max;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float probability = std::exp(scores[j] - new_max);
    scores[j] = probability;
    sum += probability;
  }
  running_sum = running_sum * rescale + sum;
  return rescale;
}

// Sizes fixed at compile time: D the head size, G the query heads per KV head. A span's
// pages are read by every KV head before the next span's (they are still in the cache), and
// a head's accumulators live in registers for the span, in `state` between spans.
template <typename E, int D, int G>
void attend_fixed(const Pages& p, int64_t b, float* scores, const void** untyped_rows,
                  float* state) {
  using T = typename E::Element;
  const T** rows = reinterpret_cast<const T**>(untyped_rows);
  float* running_max = state;                         // [kv_heads, G]
  float* running_sum = running_max + p.kv_heads * G;  // [kv_heads, G]
  float* accumulated = running_sum + p.kv_heads * G;  // [kv_heads, G, D]
  std::fill(running_max, running_sum, -std::numeric_limits<float>::max());
  std::fill(running_sum, accumulated + p.kv_heads * G * D, 0.f);
  for (int64_t start = p.low[b]; start < p.high[b]; start += kSpan) {
    const int64_t n = std::min(kSpan, p.high[b] - start);
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      float q[G][D], acc[G][D];
      for (int g = 0; g < G; ++g) {
        const float* source = p.query + b * p.query_row + (h * G + g) * p.query_head;
        const float* held = accumulated + (h * G + g) * D;
        for (int d = 0; d < D; ++d) q[g][d] = source[d];
        for (int d = 0; d < D; ++d) acc[g][d] = held[d];
      }
      key_rows(p, b, h, start, n, rows);
      for (int64_t j = 0; j < n; ++j) {
        const T* key = rows[j];
        for (int g = 0; g < G; ++g) {
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < D; ++d) dot += q[g][d] * E::widen(key[d]);
          scores[g * kSpan + j] = dot * p.scale;
        }
      }
      for (int g = 0; g < G; ++g) {
        const float rescale = softmax_update(scores + g * kSpan, n, running_max[h * G + g],
                                             running_sum[h * G + g]);
        for (int d = 0; d < D; ++d) acc[g][d] *= rescale;
      }
      for (int64_t j = 0; j < n; ++j) {
        const T* value = rows[j] + p.value_entry * p.entry_stride;
        for (int g = 0; g < G; ++g) {
          const float weight = scores[g * kSpan + j];
#pragma omp simd
          for (int d = 0; d < D; ++d) acc[g][d] += weight * E::widen(value[d]);
        }
      }
      for (int g = 0; g < G; ++g) {
        float* held = accumulated + (h * G + g) * D;
        for (int d = 0; d < D; ++d) held[d] = acc[g][d];
      }
    }
  }
  for (int64_t h = 0; h < p.kv_heads; ++h) {
    for (int g = 0; g < G; ++g) {
      float* out = p.out + (b * p.num_heads + h * G + g) * D;
      const float sum = running_sum[h * G + g];
      const float inverse = sum > 0.f ? 1.f / sum : 0.f;
      const float* held = accumulated + (h * G + g) * D;
      for (int d = 0; d < D; ++d) out[d] = held[d] * inverse;
    }
  }
}

// The same loop, sizes known at run time (MLA's latent rows, unusual head sizes or groups).
template <typename E>
void attend_any(const Pages& p, int64_t b, int64_t head_size, int64_t group, float* scores,
                const void** untyped_rows) {
  using T = typename E::Element;
  const T** rows = reinterpret_cast<const T**>(untyped_rows);
  std::vector<float> acc(group * head_size), running_max(group), running_sum(group);
  for (int64_t h = 0; h < p.kv_heads; ++h) {
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::max());
    std::fill(running_sum.begin(), running_sum.end(), 0.f);
    const float* q = p.query + b * p.query_row + h * group * p.query_head;
    for (int64_t start = p.low[b]; start < p.high[b]; start += kSpan) {
      const int64_t n = std::min(kSpan, p.high[b] - start);
      key_rows(p, b, h, start, n, rows);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t g = 0; g < group; ++g) {
          const float* query = q + g * p.query_head;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_size; ++d) dot += query[d] * E::widen(rows[j][d]);
          scores[g * kSpan + j] = dot * p.scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float rescale =
            softmax_update(scores + g * kSpan, n, running_max[g], running_sum[g]);
        float* a = acc.data() + g * head_size;
#pragma omp simd
        for (int64_t d = 0; d < head_size; ++d) a[d] *= rescale;
      }
      for (int64_t j = 0; j < n; ++j) {
        const T* value = rows[j] + p.value_entry * p.entry_stride;
        for (int64_t g = 0; g < group; ++g) {
          const float weight = scores[g * kSpan + j];
          float* a = acc.data() + g * head_size;
#pragma omp simd
          for (int64_t d = 0; d < head_size; ++d) a[d] += weight * E::widen(value[d]);
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* out = p.out + (b * p.num_heads + h * group + g) * head_size;
      const float inverse = running_sum[g] > 0.f ? 1.f / running_sum[g] : 0.f;
      for (int64_t d = 0; d < head_size; ++d) out[d] = acc[g * head_size + d] * inverse;
    }
  }
}

using FixedFn = void (*)(const Pages&, int64_t, float*, const void**, float*);
using AnyFn = void (*)(const Pages&, int64_t, int64_t, int64_t, float*, const void**);

template <typename E, int D>
FixedFn fixed_for_group(int64_t group) {
  switch (group) {
    case 1: return attend_fixed<E, D, 1>;
    case 2: return attend_fixed<E, D, 2>;
    case 3: return attend_fixed<E, D, 3>;
    case 4: return attend_fixed<E, D, 4>;
    case 5: return attend_fixed<E, D, 5>;
    case 6: return attend_fixed<E, D, 6>;
    case 7: return attend_fixed<E, D, 7>;
    case 8: return attend_fixed<E, D, 8>;
    default: return nullptr;
  }
}

template <typename E>
FixedFn fixed_for(int64_t head_size, int64_t group) {
  return head_size == 64 ? fixed_for_group<E, 64>(group)
         : head_size == 128 ? fixed_for_group<E, 128>(group)
                            : nullptr;
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor layer_cache, torch::Tensor tables,
                           torch::Tensor low, torch::Tensor high, double scale) {
  TORCH_CHECK(query.dim() == 3 && layer_cache.dim() == 5, "query 3-d, layer_cache 5-d");
  const auto page_type = layer_cache.scalar_type();
  TORCH_CHECK(query.scalar_type() == torch::kFloat &&
                  (page_type == torch::kFloat || page_type == torch::kHalf ||
                   page_type == torch::kBFloat16),
              "a float32 query over float32, float16 or bfloat16 pages");
  TORCH_CHECK(query.stride(2) == 1 && layer_cache.stride(4) == 1, "head_size contiguous");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && tables.is_contiguous() &&
                  low.is_contiguous() && high.is_contiguous(),
              "contiguous int64 tables and key ranges");
  const int64_t batch = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t kv_heads = layer_cache.size(3);
  TORCH_CHECK(layer_cache.size(4) == head_size && num_heads % kv_heads == 0,
              "pages of the query's head size, a whole group per KV head");
  TORCH_CHECK(tables.size(0) == batch && low.numel() == batch && high.numel() == batch,
              "one table and key range per row");
  const int64_t group = num_heads / kv_heads;
  auto out = torch::empty({batch, num_heads, head_size}, query.options());
  const Pages pages{query.data_ptr<float>(),       query.stride(0),
                    query.stride(1),               layer_cache.data_ptr(),
                    layer_cache.stride(0),         layer_cache.stride(1),
                    layer_cache.stride(2),         layer_cache.stride(3),
                    layer_cache.size(1) > 1 ? 1 : 0, tables.data_ptr<int64_t>(),
                    tables.size(1),                layer_cache.size(2),
                    low.data_ptr<int64_t>(),       high.data_ptr<int64_t>(),
                    out.data_ptr<float>(),         num_heads,
                    kv_heads,                      static_cast<float>(scale)};
  FixedFn fixed;
  AnyFn any;
  if (page_type == torch::kFloat) {
    fixed = fixed_for<Float32>(head_size, group), any = attend_any<Float32>;
  } else if (page_type == torch::kHalf) {
    fixed = fixed_for<Float16>(head_size, group), any = attend_any<Float16>;
  } else {
    fixed = fixed_for<BFloat16>(head_size, group), any = attend_any<BFloat16>;
  }
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * kSpan);
    std::vector<const void*> rows(kSpan);
    std::vector<float> state(num_heads * (head_size + 2));  // a row's running max, sum, sums
    for (int64_t b = begin; b < end; ++b) {
      if (fixed != nullptr) {
        fixed(pages, b, scores.data(), rows.data(), state.data());
      } else {
        any(pages, b, head_size, group, scores.data(), rows.data());
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over paged KV, read in place");
}
