// Attention of a few queries per row (a decode's one, a speculative verification's few) that
// reads the KV pages where they lie: no gather (model/paged_decode_kernel.py says when it
// serves and why).
//
//   query        [num_tokens, num_heads, head_size]     float32, head_size contiguous; the
//                tokens row by row: row b's are [row_starts[b], row_starts[b + 1])
//   layer_cache  [num_blocks, entries, block_size, kv_heads, head_size]   one layer's view of
//                the KV tensor, any strides but the last (entries 2: K then V; 1: latent rows,
//                the values are the keys: MLA's absorbed form); float32, or float16 /
//                bfloat16 (a 16-bit kv_cache_dtype), widened to float32 as it is read
//   tables       [batch, width] int64   the row's pages, from the first one it reads
//   low, high    [num_tokens] int64     token t sees keys [low[t], high[t]) of its row,
//                counted from tables[b][0] (a causal limit and a window's start per token)
//
// A row's keys are walked in spans of kSpan. For each token, each key of the span the token
// sees is scored by every query head, KV head after KV head: a key slot holds every KV
// head's row side by side, so it is read once, in order (walking one KV head over the span,
// then the next, read every slot in strided pieces: 1.08-1.13x the time at 8 rows x 8k,
// 1.19-1.26x over float16 pages). Then each query head updates its softmax once for the span
// (flash-decoding's running max and sum) and weighs the values in, slot by slot likewise.
// The common shapes (head size 64 or 128, groups of 1 to 8) are compiled with both sizes
// fixed; any other shape takes the same loop with sizes known at run time.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kSpan = 128;
constexpr float kLowest = -std::numeric_limits<float>::max();  // finite: -ffast-math

// How a page's row becomes floats: float32 pages read as they are; 16-bit pages (a
// kv_cache_dtype of float16 or bfloat16 under a float32 model) widened once per row into a
// buffer, which every query head of the row's group then reads (widening element by element
// inside each head's dot product did it once per head: 3x for smollm2's group of 3).
struct Float32 {
  using Element = float;
  static const float* widened(const float* row, int64_t, float*) { return row; }
};
struct BFloat16 {
  using Element = uint16_t;
  static float widen(uint16_t x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
  static const float* widened(const uint16_t* row, int64_t n, float* buffer) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) buffer[d] = widen(row[d]);
    return buffer;
  }
};
// IEEE half to float: sixteen at a time with AVX-512's vcvtph2ps, then eight with F16C's
// (exact for every half, subnormals, infinities and NaNs included: 0.61x the time of widening
// in software at 1 x 8k, bench/bench_paged_attention.py's shape); elsewhere, and for a row's
// last few, in integer and float operations the compiler vectorizes (a conversion of _Float16 is a library call per element
// without AVX512-FP16: 20x slower). The exponent is rebased; infinities and NaNs keep an
// all-ones exponent, and subnormal halves are renormalised by one float subtraction.
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
  static const float* widened(const uint16_t* row, int64_t n, float* buffer) {
    int64_t d = 0;
#ifdef __AVX512F__
    for (; d + 16 <= n; d += 16) {
      const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d));
      _mm512_storeu_ps(buffer + d, _mm512_cvtph_ps(halves));
    }
#endif
#ifdef __F16C__
    for (; d + 8 <= n; d += 8) {
      const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
      _mm256_storeu_ps(buffer + d, _mm256_cvtph_ps(halves));
    }
#endif
#pragma omp simd
    for (int64_t e = d; e < n; ++e) buffer[e] = widen(row[e]);
    return buffer;
  }
};

struct Pages {
  const float* query;
  int64_t query_row, query_head;
  const void* cache;
  int64_t block_stride, entry_stride, slot_stride, head_stride, value_entry;
  const int64_t* tables;
  int64_t width, block_size;
  const int64_t* row_starts;
  const int64_t* low;
  const int64_t* high;
  float* out;
  int64_t num_heads, kv_heads, head_size, group;
  float scale;
};

// One thread's buffers: a span's scores (per query head) and key slots, a widened 16-bit
// row, and the running state of a row's tokens (max, sum and accumulated values per token
// and query head).
struct Scratch {
  std::vector<float> scores, running_max, running_sum, accumulated, row;
  std::vector<const void*> rows;
  Scratch(const Pages& p, int64_t max_tokens)
      : scores(p.num_heads * kSpan),
        running_max(max_tokens * p.num_heads),
        running_sum(max_tokens * p.num_heads),
        accumulated(max_tokens * p.num_heads * p.head_size),
        row(p.head_size),
        rows(kSpan) {}
};

// The pointers to the key slots of keys [start, start + n) of row b (KV head h's row:
// h * head_stride further).
template <typename T>
inline void key_rows(const Pages& p, int64_t b, int64_t start, int64_t n, const T** rows) {
  const int64_t* table = p.tables + b * p.width;
  const T* cache = static_cast<const T*>(p.cache);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t key = start + j;
    rows[j] = cache + table[key / p.block_size] * p.block_stride +
              (key % p.block_size) * p.slot_stride;
  }
}

// Scores of a span to probabilities under the running max; returns the span's rescale of
// what was accumulated before it.
inline float softmax_update(float* scores, int64_t n, float& running_max, float& running_sum) {
  float span_max = kLowest;
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

// Row b. D and G are the head size and the group (query heads per KV head) fixed at compile
// time, or 0: known at run time (p.head_size, p.group).
template <typename E, int D, int G>
void attend_row(const Pages& p, int64_t b, Scratch& s) {
  using T = typename E::Element;
  constexpr bool fixed = D > 0 && G > 0;
  const int64_t head_size = fixed ? D : p.head_size;
  const int64_t group = fixed ? G : p.group;
  const T** rows = reinterpret_cast<const T**>(s.rows.data());
  float* scores = s.scores.data();
  float row_fixed[fixed ? D : 1];
  float* row = fixed ? row_fixed : s.row.data();  // a 16-bit row, widened
  const int64_t first_token = p.row_starts[b], num_tokens = p.row_starts[b + 1] - first_token;
  int64_t row_low = p.low[first_token], row_high = p.high[first_token];
  for (int64_t i = 1; i < num_tokens; ++i) {
    row_low = std::min(row_low, p.low[first_token + i]);
    row_high = std::max(row_high, p.high[first_token + i]);
  }
  std::fill_n(s.running_max.data(), num_tokens * p.num_heads, kLowest);
  std::fill_n(s.running_sum.data(), num_tokens * p.num_heads, 0.f);
  std::fill_n(s.accumulated.data(), num_tokens * p.num_heads * head_size, 0.f);
  const int64_t kv_heads = p.kv_heads;
  for (int64_t start = row_low; start < row_high; start += kSpan) {
    const int64_t n = std::min(kSpan, row_high - start);
    key_rows(p, b, start, n, rows);
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t token = first_token + i;
      const int64_t j0 = std::max(p.low[token], start) - start;
      const int64_t j1 = std::min(p.high[token], start + n) - start;
      if (j0 >= j1) continue;
      const float* source = p.query + token * p.query_row;
      float* held = s.accumulated.data() + i * p.num_heads * head_size;
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          const float* key = E::widened(rows[j] + h * p.head_stride, head_size, row);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = source + (h * group + g) * p.query_head;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_size; ++d) dot += qg[d] * key[d];
            scores[(h * group + g) * kSpan + j] = dot * p.scale;
          }
        }
      }
      for (int64_t hq = 0; hq < p.num_heads; ++hq) {
        const int64_t state = i * p.num_heads + hq;
        const float rescale = softmax_update(scores + hq * kSpan + j0, j1 - j0,
                                             s.running_max[state], s.running_sum[state]);
        float* ag = held + hq * head_size;
#pragma omp simd
        for (int64_t d = 0; d < head_size; ++d) ag[d] *= rescale;
      }
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          const float* value = E::widened(
              rows[j] + p.value_entry * p.entry_stride + h * p.head_stride, head_size, row);
          for (int64_t g = 0; g < group; ++g) {
            const float weight = scores[(h * group + g) * kSpan + j];
            float* ag = held + (h * group + g) * head_size;
#pragma omp simd
            for (int64_t d = 0; d < head_size; ++d) ag[d] += weight * value[d];
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < num_tokens; ++i) {
    for (int64_t head = 0; head < p.num_heads; ++head) {
      const int64_t state = i * p.num_heads + head;
      float* out = p.out + ((first_token + i) * p.num_heads + head) * head_size;
      const float sum = s.running_sum[state];
      const float inverse = sum > 0.f ? 1.f / sum : 0.f;
      const float* held = s.accumulated.data() + state * head_size;
      for (int64_t d = 0; d < head_size; ++d) out[d] = held[d] * inverse;
    }
  }
}

using RowFn = void (*)(const Pages&, int64_t, Scratch&);

template <typename E, int D>
RowFn fixed_for_group(int64_t group) {
  switch (group) {
    case 1: return attend_row<E, D, 1>;
    case 2: return attend_row<E, D, 2>;
    case 3: return attend_row<E, D, 3>;
    case 4: return attend_row<E, D, 4>;
    case 5: return attend_row<E, D, 5>;
    case 6: return attend_row<E, D, 6>;
    case 7: return attend_row<E, D, 7>;
    case 8: return attend_row<E, D, 8>;
    default: return attend_row<E, 0, 0>;
  }
}

template <typename E>
RowFn row_function(int64_t head_size, int64_t group) {
  return head_size == 64 ? fixed_for_group<E, 64>(group)
         : head_size == 128 ? fixed_for_group<E, 128>(group)
                            : attend_row<E, 0, 0>;
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor layer_cache, torch::Tensor tables,
                           torch::Tensor row_starts, torch::Tensor low, torch::Tensor high,
                           double scale) {
  TORCH_CHECK(query.dim() == 3 && layer_cache.dim() == 5, "query 3-d, layer_cache 5-d");
  const auto page_type = layer_cache.scalar_type();
  TORCH_CHECK(query.scalar_type() == torch::kFloat &&
                  (page_type == torch::kFloat || page_type == torch::kHalf ||
                   page_type == torch::kBFloat16),
              "a float32 query over float32, float16 or bfloat16 pages");
  TORCH_CHECK(query.stride(2) == 1 && layer_cache.stride(4) == 1, "head_size contiguous");
  for (const auto& index : {tables, row_starts, low, high}) {
    TORCH_CHECK(index.scalar_type() == torch::kLong && index.is_contiguous(),
                "contiguous int64 tables, row starts and key ranges");
  }
  const int64_t num_tokens = query.size(0), num_heads = query.size(1);
  const int64_t head_size = query.size(2), kv_heads = layer_cache.size(3);
  const int64_t batch = tables.size(0);
  TORCH_CHECK(layer_cache.size(4) == head_size && num_heads % kv_heads == 0,
              "pages of the query's head size, a whole group per KV head");
  TORCH_CHECK(row_starts.numel() == batch + 1 && low.numel() == num_tokens &&
                  high.numel() == num_tokens,
              "a start per row and a key range per token");
  const int64_t* starts = row_starts.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[batch] == num_tokens, "rows cover the tokens");
  int64_t max_tokens = 1;
  for (int64_t b = 0; b < batch; ++b) max_tokens = std::max(max_tokens, starts[b + 1] - starts[b]);
  auto out = torch::empty({num_tokens, num_heads, head_size}, query.options());
  const Pages pages{query.data_ptr<float>(),   query.stride(0),
                    query.stride(1),           layer_cache.data_ptr(),
                    layer_cache.stride(0),     layer_cache.stride(1),
                    layer_cache.stride(2),     layer_cache.stride(3),
                    layer_cache.size(1) > 1 ? 1 : 0, tables.data_ptr<int64_t>(),
                    tables.size(1),            layer_cache.size(2),
                    starts,                    low.data_ptr<int64_t>(),
                    high.data_ptr<int64_t>(),  out.data_ptr<float>(),
                    num_heads,                 kv_heads,
                    head_size,                 num_heads / kv_heads,
                    static_cast<float>(scale)};
  const RowFn attend = page_type == torch::kFloat  ? row_function<Float32>(head_size, pages.group)
                       : page_type == torch::kHalf ? row_function<Float16>(head_size, pages.group)
                                                   : row_function<BFloat16>(head_size, pages.group);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(pages, max_tokens);
    for (int64_t b = begin; b < end; ++b) attend(pages, b, scratch);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "a few queries per row over paged KV, read in place");
}
