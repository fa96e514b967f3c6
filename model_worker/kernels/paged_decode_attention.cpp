// Paged decode attention for bf16 KV caches on AVX512-BF16 CPUs: one query token per sequence,
// keys and values read in place from the paged cache through each sequence's block table.
//
// Why a kernel: in torch ops the decode step's attention was an index_select of every
// sequence's keys and values (a copy), an upcast to float32 (a second copy of twice the
// bytes) and SDPA's flash kernel, whose tasks of one query row are overhead-bound; on
// SmolLM2 at 32 streams that was ~40% of the decode step. Here each task reads its cached
// rows once, 16 positions at a time (flash decoding):
// - q.k with VDPBF16PS (bf16 products, exact in float32, float32 sums), the 16 positions'
//   horizontal sums in one transposed reduction;
// - an online float32 softmax (running max and sum, rescaled per 16 positions);
// - P.V with VDPBF16PS too, on P rounded to bf16 as flash attention rounds it for its P.V
//   product, with float32 sums;
// - the next 16 positions' rows prefetched: in a real step the cache comes from DRAM (each
//   layer's share is touched once per step, between the other layers' weights);
// - a task is (sequence, kv head, up to 256 positions), handed out from a shared counter, so
//   one long sequence still keeps every thread busy and uneven lengths balance; the last of a
//   sequence's partitions to finish merges them.
// Results match the float32 SDPA path to about bf16 rounding (P's rounding and the summation
// order differ).
//
// Built at run time by model_worker/kernels/__init__.py with -march=native; the Python side
// uses it only when this file compiled with AVX512-BF16 (vectorized() is true).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TOKENWIRE_AVX512_BF16 1
#include "vec_math.h"
#endif

namespace {

#ifdef TOKENWIRE_AVX512_BF16

constexpr int64_t kMaxGroup = 16;   // query heads per kv head
constexpr int64_t kMaxChunks = 8;   // head_dim / 16, so head_dim <= 128

constexpr int64_t kChunk = 16;        // keys scored together: one transposed reduction per 16
constexpr int64_t kPartition = 256;   // positions per task: longer contexts split across tasks

// Horizontal sums of 16 vectors at once: lane j of the result is the sum of v[j]'s lanes.
// 15 shuffle-and-add steps instead of 16 separate reductions (~8 dependent ops each).
inline __m512 reduce16(__m512 v[16]) {
  __m512 s[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 r[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v[4i..4i+3]
    const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    r[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x88), _mm512_shuffle_f32x4(r[0], r[1], 0xDD));
  const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(r[2], r[3], 0x88), _mm512_shuffle_f32x4(r[2], r[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

// One task's running softmax state per query head of a kv head's group: the max score seen,
// the sum of exp(score - max) and the value rows weighted by those exps.
alignas(64) const uint16_t kZeroRow[kMaxChunks * 16] = {};

struct Partial {
  float max[kMaxGroup];
  float sum[kMaxGroup];
  __m512 acc[kMaxGroup][kMaxChunks];
};

// Cache row offsets of positions [t, t + n) (n <= 16) through a block table; the slots past n
// repeat the first row, a real one, so a full 16-wide pass reads nothing out of bounds.
inline void chunk_rows(const int64_t* table, int64_t block_size, int64_t row_stride, int64_t t, int64_t n,
                       int64_t (&rows)[kChunk]) {
  int64_t block = t / block_size, offset = t % block_size;
  for (int64_t j = 0; j < kChunk; ++j) {
    rows[j] = j < n ? (table[block] * block_size + offset) * row_stride : rows[0];
    if (++offset == block_size) offset = 0, ++block;
  }
}

// Attends one kv head's group of query heads (qv: their rows as bf16 pairs) to positions
// [p0, p1) of one sequence through its block table, one online-softmax update per 16 positions.
void attend_range(const __m512bh (&qv)[kMaxGroup][kMaxChunks / 2], int64_t group, int64_t pairs, int64_t chunks,
                  const uint16_t* k_base, const uint16_t* v_base, const int64_t* table, int64_t block_size,
                  int64_t row_stride, int64_t p0, int64_t p1, float scale, Partial& part) {
  for (int64_t g = 0; g < group; ++g) {
    part.max[g] = -INFINITY;
    part.sum[g] = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) part.acc[g][c] = _mm512_setzero_ps();
  }
  alignas(64) float probs[kMaxGroup][kChunk];
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t rows[kChunk], next_rows[kChunk];
  chunk_rows(table, block_size, row_stride, p0, std::min(kChunk, p1 - p0), rows);
  for (int64_t t0 = p0; t0 < p1; t0 += kChunk) {
    const int64_t n = std::min(kChunk, p1 - t0);
    const __mmask16 live = tokenwire::lanes(n);
    // The next chunk's rows, on their way in while this one computes.
    const int64_t next_n = std::min(kChunk, p1 - t0 - kChunk);
    if (next_n > 0) {
      chunk_rows(table, block_size, row_stride, t0 + kChunk, next_n, next_rows);
      for (int64_t j = 0; j < next_n; ++j)
        for (int64_t line = 0; line < pairs; ++line) {
          _mm_prefetch(reinterpret_cast<const char*>(k_base + next_rows[j] + 32 * line), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v_base + next_rows[j] + 32 * line), _MM_HINT_T0);
        }
    }
    for (int64_t g = 0; g < group; ++g) {
      __m512 dots[kChunk];
      for (int64_t j = 0; j < kChunk; ++j) {
        const uint16_t* k = k_base + rows[j];
        __m512 dot = _mm512_setzero_ps();
        for (int64_t c = 0; c < pairs; ++c)
          dot = _mm512_dpbf16_ps(dot, qv[g][c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
        dots[j] = dot;
      }
      const __m512 scores = _mm512_mul_ps(reduce16(dots), vscale);
      // A NaN score (a NaN or inf in q or k) must poison the output as it does in torch: if the
      // masked max drops it, exp_ps keeps it in p, and from there the sums.
      const float chunk_max = _mm512_mask_reduce_max_ps(live, scores);
      const float new_max = std::isnan(chunk_max) ? chunk_max : std::max(part.max[g], chunk_max);
      // While every score so far is -inf (an inf in q or k), exps are taken against 0, so those
      // positions weigh 0 as in torch's softmax instead of exp(-inf - -inf) = NaN.
      const float shift = new_max == -INFINITY ? 0.0f : new_max;
      const float rescale = std::exp(part.max[g] - shift);  // 0 on the first chunk (max -inf)
      part.max[g] = new_max;
      const __m512 p = _mm512_maskz_mov_ps(live, tokenwire::exp_ps(_mm512_sub_ps(scores, _mm512_set1_ps(shift))));
      part.sum[g] = part.sum[g] * rescale + _mm512_reduce_add_ps(p);
      _mm512_store_ps(probs[g], p);
      const __m512 vr = _mm512_set1_ps(rescale);
      for (int64_t c = 0; c < chunks; ++c) part.acc[g][c] = _mm512_mul_ps(part.acc[g][c], vr);
    }
    // Values two positions at a time: their rows interleaved into bf16 pairs, times the pair of
    // probabilities rounded to bf16, summed in float32 by VDPBF16PS. The accumulators hold the
    // dims in the order the interleave leaves them (store_row puts them back).
    alignas(64) uint32_t prob_pairs[kMaxGroup][kChunk / 2];
    for (int64_t g = 0; g < group; ++g)
      _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs[g]), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(probs[g])));
    for (int64_t j = 0; j < n; j += 2) {
      const uint16_t* va = v_base + rows[j];
      const uint16_t* vb = j + 1 < n ? v_base + rows[j + 1] : kZeroRow;  // p is 0 there; 0 * inf would be NaN
      __m512i lo[kMaxChunks / 2], hi[kMaxChunks / 2];
      for (int64_t c = 0; c < pairs; ++c) {
        const __m512i a = _mm512_loadu_si512(va + 32 * c), b = _mm512_loadu_si512(vb + 32 * c);
        lo[c] = _mm512_unpacklo_epi16(a, b);
        hi[c] = _mm512_unpackhi_epi16(a, b);
      }
      for (int64_t g = 0; g < group; ++g) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_pairs[g][j / 2]));
        for (int64_t c = 0; c < pairs; ++c) {
          part.acc[g][2 * c] = _mm512_dpbf16_ps(part.acc[g][2 * c], pp, (__m512bh)lo[c]);
          part.acc[g][2 * c + 1] = _mm512_dpbf16_ps(part.acc[g][2 * c + 1], pp, (__m512bh)hi[c]);
        }
      }
    }
    if (next_n > 0) std::copy(next_rows, next_rows + kChunk, rows);
  }
}

// Undoes the pair interleave: acc[2c] holds dims 8L..8L+3 of 128-bit lane L of the c-th 32
// dims, acc[2c+1] dims 8L+4..8L+7. Writes dims in order, times inv, as bf16.
void store_row(uint16_t* dst, const __m512* acc, float inv, int64_t chunks) {
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < chunks / 2; ++c) {
    const __m512 lo = _mm512_mul_ps(acc[2 * c], vinv), hi = _mm512_mul_ps(acc[2 * c + 1], vinv);
    // [lo.L0, hi.L0, lo.L1, hi.L1] and [lo.L2, hi.L2, lo.L3, hi.L3]
    const __m512 first = _mm512_shuffle_f32x4(_mm512_shuffle_f32x4(lo, hi, 0x44), _mm512_shuffle_f32x4(lo, hi, 0x44), 0xD8);
    const __m512 second = _mm512_shuffle_f32x4(_mm512_shuffle_f32x4(lo, hi, 0xEE), _mm512_shuffle_f32x4(lo, hi, 0xEE), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * c), (__m256i)_mm512_cvtneps_pbh(first));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * c + 16), (__m256i)_mm512_cvtneps_pbh(second));
  }
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

  // Tasks: (sequence, kv head, partition of at most kPartition positions), so one long
  // sequence keeps every thread busy. first_task[b] is sequence b's first task.
  std::vector<int64_t> first_task(batch + 1, 0), first_pos(batch), parts(batch);
  for (int64_t b = 0; b < batch; ++b) {
    first_pos[b] = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    parts[b] = (lens[b] - first_pos[b] + kPartition - 1) / kPartition;
    first_task[b + 1] = first_task[b] + parts[b] * num_kv_heads;
  }
  const int64_t num_tasks = first_task[batch];
  // Split sequences leave each partition's state here (per query head: max, sum, then the
  // head_dim weighted sums); the last of a (sequence, kv head)'s partitions to finish merges
  // them (`remaining` counts down to it), so one parallel region does it all.
  const int64_t state_floats = group * (head_dim + 2);
  std::unique_ptr<float[]> partials(num_tasks > batch * num_kv_heads ? new float[num_tasks * state_floats] : nullptr);
  std::unique_ptr<std::atomic<int64_t>[]> remaining(new std::atomic<int64_t>[batch * num_kv_heads]);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < num_kv_heads; ++h) remaining[b * num_kv_heads + h].store(parts[b], std::memory_order_relaxed);
  // Tasks are handed out one at a time from a shared counter: their costs differ with each
  // sequence's length, and a static split would leave one thread waiting on the other.
  std::atomic<int64_t> next_task{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Partial local;
    int64_t b = 0;
    for (int64_t task = next_task.fetch_add(1); task < num_tasks; task = next_task.fetch_add(1)) {
      while (first_task[b + 1] <= task) ++b;
      const int64_t within = task - first_task[b], h = within / parts[b], part = within % parts[b];
      const int64_t p0 = first_pos[b] + part * kPartition, p1 = std::min(lens[b], p0 + kPartition);
      __m512bh qv[kMaxGroup][kMaxChunks / 2];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < pairs; ++c)
          qv[g][c] = (__m512bh)_mm512_loadu_si512(q + b * q_stride_b + (h * group + g) * q_stride_h + 32 * c);
      const int64_t* table = tables + b * max_blocks;
      attend_range(qv, group, pairs, chunks, k_cache + h * head_dim, v_cache + h * head_dim, table, block_size,
                   row_stride, p0, p1, fscale, local);
      uint16_t* dst = o + (b * num_heads + h * group) * head_dim;
      if (parts[b] == 1) {
        for (int64_t g = 0; g < group; ++g) store_row(dst + g * head_dim, local.acc[g], 1.0f / local.sum[g], chunks);
        continue;
      }
      float* mine = partials.get() + task * state_floats;
      for (int64_t g = 0; g < group; ++g) {
        mine[g * (head_dim + 2)] = local.max[g];
        mine[g * (head_dim + 2) + 1] = local.sum[g];
        for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(mine + g * (head_dim + 2) + 2 + 16 * c, local.acc[g][c]);
      }
      if (remaining[b * num_kv_heads + h].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      // The last partition in: merge all of this (sequence, kv head)'s partitions.
      const float* states = partials.get() + (first_task[b] + h * parts[b]) * state_floats;
      for (int64_t g = 0; g < group; ++g) {
        float max = -INFINITY;
        for (int64_t i = 0; i < parts[b]; ++i) {
          const float m = states[i * state_floats + g * (head_dim + 2)];
          max = std::isnan(m) ? m : std::max(max, m);
        }
        float sum = 0.0f;
        __m512 acc[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < parts[b]; ++i) {
          const float* state = states + i * state_floats + g * (head_dim + 2);
          const float weight = std::exp(state[0] - max);
          sum += weight * state[1];
          const __m512 w = _mm512_set1_ps(weight);
          for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(state + 2 + 16 * c), acc[c]);
        }
        store_row(dst + g * head_dim, acc, 1.0f / sum, chunks);
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
  TORCH_CHECK(num_kv_heads >= 1 && query.size(1) % num_kv_heads == 0 && query.size(1) / num_kv_heads >= 1 &&
                  query.size(1) / num_kv_heads <= 16,
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
