// Paged decode attention for bf16 KV caches on AVX512-BF16 CPUs: one query token per sequence,
// keys and values read in place from the paged cache through each sequence's block table.
//
// Why a kernel: in torch ops the decode step's attention was an index_select of every
// sequence's keys and values (a copy), an upcast to float32 (a second copy of twice the
// bytes) and SDPA's flash kernel, whose tasks of one query row are overhead-bound; on
// SmolLM2 at 32 streams that was ~40% of the decode step. Here each (sequence, kv head)
// task reads its cached rows once: q.k with VDPBF16PS (bf16 products, exact in float32,
// float32 sums), a float32 softmax, and float32 accumulation of the values. Results match
// the float32 SDPA path to bf16 rounding (the summation order differs).
//
// Built at run time by model_worker/kernels/__init__.py with -march=native; the Python side
// uses it only when this file compiled with AVX512-BF16 (vectorized() is true).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TOKENWIRE_AVX512_BF16 1
#endif

namespace {

#ifdef TOKENWIRE_AVX512_BF16

constexpr int64_t kMaxGroup = 16;   // query heads per kv head
constexpr int64_t kMaxChunks = 8;   // head_dim / 16, so head_dim <= 128

// exp(x) for x <= 0 (scores minus their max): 2^n * e^r with |r| <= ln2/2, a degree-6
// polynomial for e^r (relative error ~1e-7, about one float32 ulp). NaN stays NaN: max_ps
// returns its second operand when either is NaN, so x goes second, and a NaN score (a NaN or
// inf in q or k) poisons the output as it does in torch instead of vanishing into a clamp.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Softmax numerators of one row of scores in place; returns their sum.
float exp_row(float* s, int64_t count) {
  __m512 m = _mm512_set1_ps(-3.0e38f);
  int64_t t = 0;
  for (; t + 16 <= count; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  float max_score = _mm512_reduce_max_ps(m);
  for (; t < count; ++t) max_score = std::max(max_score, s[t]);
  const __m512 mv = _mm512_set1_ps(max_score);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t < count; t += 16) {
    const __mmask16 live = count - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - t)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), mv));
    _mm512_mask_storeu_ps(s + t, live, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, e));
  }
  return _mm512_reduce_add_ps(sum);
}

void decode_attention_bf16(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window, double scale,
                           at::Tensor& out) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t pairs = head_dim / 32, chunks = head_dim / 16;
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const auto* k_cache = reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>());
  const auto* v_cache = reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t q_stride_b = query.stride(0), q_stride_h = query.stride(1);
  const int64_t row_stride = num_kv_heads * head_dim;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t count = len - first;
      const int64_t* table = tables + b * max_blocks;
      __m512bh qv[kMaxGroup][kMaxChunks / 2];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < pairs; ++c)
          qv[g][c] = (__m512bh)_mm512_loadu_si512(q + b * q_stride_b + (h * group + g) * q_stride_h + 32 * c);
      scores.resize(group * count);
      for (int64_t t = 0; t < count; ++t) {
        const int64_t pos = first + t;
        const uint16_t* k = k_cache + (table[pos / block_size] * block_size + pos % block_size) * row_stride + h * head_dim;
        __m512bh kv[kMaxChunks / 2];
        for (int64_t c = 0; c < pairs; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + 32 * c);
        for (int64_t g = 0; g < group; ++g) {
          __m512 dot = _mm512_setzero_ps();
          for (int64_t c = 0; c < pairs; ++c) dot = _mm512_dpbf16_ps(dot, qv[g][c], kv[c]);
          scores[g * count + t] = _mm512_reduce_add_ps(dot) * fscale;
        }
      }
      float inv_sums[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) inv_sums[g] = 1.0f / exp_row(scores.data() + g * count, count);
      __m512 acc[kMaxGroup][kMaxChunks];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int64_t t = 0; t < count; ++t) {
        const int64_t pos = first + t;
        const uint16_t* v = v_cache + (table[pos / block_size] * block_size + pos % block_size) * row_stride + h * head_dim;
        __m512 vf[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c)
          vf[c] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c)));
        for (int64_t g = 0; g < group; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * count + t]);
          for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        uint16_t* dst = o + (b * num_heads + h * group + g) * head_dim;
        const __m512 inv = _mm512_set1_ps(inv_sums[g]);
        for (int64_t c = 0; c < chunks; ++c)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv)));
      }
    }
  });
}

#endif  // TOKENWIRE_AVX512_BF16

}  // namespace

bool vectorized() {
#ifdef TOKENWIRE_AVX512_BF16
  return true;
#else
  return false;
#endif
}

// query [B, H, D] bf16 (unit last stride), caches [num_blocks, block_size, Hkv, D] bf16 and
// contiguous, block_tables [B, max_blocks] int64, seq_lens [B] int64 (each >= 1; the
// sequence attends to its first seq_len positions), window > 0: only to the last `window`
// of them. Returns [B, H, D] bf16.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window,
                                  double scale) {
  TORCH_CHECK(vectorized(), "built without AVX512-BF16");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 &&
              value_cache.scalar_type() == at::kBFloat16, "bf16 query and caches only");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [B, H, D] with a unit last stride");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              value_cache.sizes() == key_cache.sizes(), "caches must be contiguous [num_blocks, block_size, Hkv, D]");
  const int64_t head_dim = query.size(2), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && head_dim % 32 == 0 && head_dim <= 128,
              "head_dim must match the cache and be a multiple of 32 up to 128");
  TORCH_CHECK(query.size(1) % num_kv_heads == 0 && query.size(1) / num_kv_heads <= 16,
              "query heads must be 1-16 times the kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
              block_tables.size(0) == query.size(0), "block_tables must be contiguous int64 [B, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.numel() == query.size(0),
              "seq_lens must be contiguous int64 [B]");
  TORCH_CHECK(block_tables.device().is_cpu() && seq_lens.device().is_cpu(), "CPU block_tables and seq_lens only");
  // Every block a sequence reads must exist: a bad id would read outside the cache.
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0), max_blocks = block_tables.size(1);
  for (int64_t b = 0; b < seq_lens.numel(); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size,
                "seq_lens must be in [1, max_blocks * block_size], got ", lens[b]);
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the cache's ", num_blocks, " blocks");
    }
  }
  at::Tensor out = at::empty({query.size(0), query.size(1), head_dim}, query.options());
#ifdef TOKENWIRE_AVX512_BF16
  decode_attention_bf16(query, key_cache, value_cache, block_tables, seq_lens, window, scale, out);
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "whether this build has the AVX512-BF16 kernel");
  // Without the GIL, as torch's own ops run: the model worker's serving thread goes on
  // framing and sending while the engine thread is in here.
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention, bf16 caches, one query token per sequence",
        py::call_guard<py::gil_scoped_release>());
}
