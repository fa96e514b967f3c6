// The sampler's token picks on CPU, on float32 logits [S, V] with contiguous rows.
//
// argmax_rows: the greedy pick, the argmax of each row. torch's CPU argmax over a 49152-wide
// vocabulary took 57 us a row at one row and 0.9 ms for 32 rows (2 threads, measured on this
// project's 2-core AVX-512 machine): about 3% of a 32-stream decode step, for a reduction that
// reads 6 MB already in cache. Here each row is one pass of 16-lane compares. Same answer as
// torch.argmax(dim=-1): the first index of the largest value; a row with a NaN gives the index of
// its first NaN (torch counts NaN as the largest); a row of all -inf gives 0.
//
// gumbel_argmax_rows: the sampled pick, argmax(logits + Gumbel noise) with the noise of
// model_worker/sampling/counter_random.py (a hash of row key and column counter -> a 24-bit
// uniform u -> -log(-log(u))), fused into one pass instead of torch's ~10 passes over [S, V], and
// skipping the noise of every token too unlikely to win: the noise is at most G_MAX (u's largest
// value), so a token whose logit + G_MAX is below a score already seen cannot be drawn. Ties and
// NaN as argmax_rows. The log here is not Sleef's (within 1 ulp of torch.log over all 2^24 values
// of u), so a noise can differ from torch's path by an ulp of the noise (up to ~1e-6): a draw
// differs only where the top two scores are that close.
//
// top_p_rows: top_p's mask (processors.top_p_removed) without sorting the vocabulary, as its
// Python band path does but in three passes over each row held in cache: the largest logit, then
// exp(x - max) with its sum and a histogram of that mass over bins of 1/32 logit down from the
// top, then the tokens of the three bins around the one where the mass reaches p, sorted alone. A
// row it cannot settle (a NaN or infinite logit, a cut the histogram misses, a band of more than
// V/8 tokens) is reported so, and the caller sorts that row whole. 12-17 ms of torch ops for 32 x
// 49152 became ~1 ms here.
//
// vectorized() is false where the compiler was not given AVX-512 (the sampler then keeps torch's).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#define TOKENWIRE_SAMPLING_OPS 1
#include <immintrin.h>

#include "vec_math.h"
#endif

namespace {

bool vectorized() {
#ifdef TOKENWIRE_SAMPLING_OPS
  return true;
#else
  return false;
#endif
}

#ifdef TOKENWIRE_SAMPLING_OPS
int64_t argmax_row(const float* x, int64_t V) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = minus_inf;
  // Lane j starts at index j: if nothing beats -inf, the smallest of them, 0, is the answer.
  __m512i best_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i index = best_index;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan_seen = 0;
  for (int64_t k = 0; k < V; k += 16) {
    const __mmask16 live = tokenwire::lanes(V - k);
    const __m512 v = _mm512_mask_loadu_ps(minus_inf, live, x + k);
    nan_seen |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    // Strictly greater: each lane keeps the first index of its own maximum.
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
    index = _mm512_add_epi32(index, step);
  }
  if (nan_seen) {
    for (int64_t k = 0; k < V; ++k)
      if (std::isnan(x[k])) return k;
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_top, best_index);
}
#endif

// What every op here reads: float32 logits [S, V] on the CPU, each row contiguous, V in [1, 2^31 - 1).
void check_logits(const torch::Tensor& logits) {
  TORCH_CHECK(vectorized(), "built without AVX-512");
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  (logits.size(1) == 1 || logits.stride(1) == 1),
              "logits must be a float32 CPU tensor [S, V] with contiguous rows");
  const int64_t V = logits.size(1);
  TORCH_CHECK(V >= 1 && V < std::numeric_limits<int32_t>::max(), "V must be in [1, 2^31 - 1), got ", V);
}

// logits [S, V] float32, rows contiguous -> [S] int64.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_logits(logits);
  const int64_t S = logits.size(0), V = logits.size(1);
  auto out = torch::empty({S}, logits.options().dtype(at::kLong));
#ifdef TOKENWIRE_SAMPLING_OPS
  const float* x = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  int64_t* o = out.data_ptr<int64_t>();
  // A few rows per thread at least: one row is ~5 us, about what waking the other thread costs.
  at::parallel_for(0, S, 4, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) o[s] = argmax_row(x + s * row_stride, V);
  });
#endif
  return out;
}


#ifdef TOKENWIRE_SAMPLING_OPS
// counter_random._uniform_bits then uniforms, 16 columns at a time: a two-round multiply-xorshift
// of key ^ column (int32 products wrap as torch's do), its top 24 bits, (bits + 0.5) / 2^24,
// clamped below 1.
inline __m512 uniforms16(__m512i key, __m512i columns) {
  __m512i x = _mm512_xor_si512(key, columns);
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(0x846CA68Bu)));
  const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 8)), _mm512_set1_ps(0.5f)),
                                 _mm512_set1_ps(1.0f / (1 << 24)));
  return _mm512_min_ps(u, _mm512_set1_ps(1.0f - 1.0f / (1 << 24)));
}

inline __m512 gumbel16(__m512 u) {
  return _mm512_sub_ps(_mm512_setzero_ps(), tokenwire::log_ps(_mm512_sub_ps(_mm512_setzero_ps(), tokenwire::log_ps(u))));
}

// The row's largest value (NaN ignored); nan_seen: whether it holds a NaN.
float row_max(const float* x, int64_t V, bool& nan_seen) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = minus_inf;
  __mmask16 nan = 0;
  for (int64_t k = 0; k < V; k += 16) {
    const __m512 v = _mm512_mask_loadu_ps(minus_inf, tokenwire::lanes(V - k), x + k);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(v, top);
  }
  nan_seen = nan != 0;
  return _mm512_reduce_max_ps(top);
}

// The largest noise there is (u = 1 - 2^-24, ~16.6), as this file computes it.
float gumbel_max() {
  return _mm512_cvtss_f32(gumbel16(_mm512_set1_ps(1.0f - 1.0f / (1 << 24))));
}

int64_t gumbel_argmax_row(const float* x, int64_t V, int32_t key, const int32_t* columns, float g_max) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // First pass: the largest logit (and NaN, which wins as in torch).
  bool nan_seen = false;
  const float largest = row_max(x, V, nan_seen);
  if (nan_seen) {
    for (int64_t k = 0; k < V; ++k)
      if (std::isnan(x[k])) return k;
  }
  const __m512i key16 = _mm512_set1_epi32(key);
  // Any token below `floor` scores less than some token already scored, so it cannot win. It
  // starts at the largest logit's least score (u's smallest value) and rises with the best score
  // seen; the margin covers the sums' rounding.
  const float g_min = _mm512_cvtss_f32(gumbel16(_mm512_set1_ps(0.5f / (1 << 24))));
  auto floor_below = [&](float score) {
    return std::isfinite(score) ? score - g_max - (1e-2f + 1e-4f * std::fabs(score)) : score;
  };
  float floor = floor_below(largest + g_min);
  __m512 best = minus_inf;
  __m512i best_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i index = best_index;
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t k = 0; k < V; k += 16, index = _mm512_add_epi32(index, step)) {
    const __mmask16 live = tokenwire::lanes(V - k);
    const __m512 v = _mm512_mask_loadu_ps(minus_inf, live, x + k);
    // >= keeps every lane of a row of -inf (floor is -inf there), whose answer is index 0.
    const __mmask16 contender = _mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(floor), _CMP_GE_OQ);
    if (!contender) continue;
    const __m512i cols = _mm512_maskz_loadu_epi32(contender, columns + k);
    const __m512 score = _mm512_mask_add_ps(minus_inf, contender, v, gumbel16(uniforms16(key16, cols)));
    // Strictly greater: each lane keeps the first index of its own maximum.
    const __mmask16 greater = _mm512_cmp_ps_mask(score, best, _CMP_GT_OQ);
    if (!greater) continue;
    best = _mm512_mask_mov_ps(best, greater, score);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
    floor = std::max(floor, floor_below(_mm512_reduce_max_ps(best)));
  }
  const float winner = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(winner), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_top, best_index);
}
#endif

// logits [S, V] float32 with contiguous rows, keys [S] int32, columns [V] int32 -> [S] int64:
// argmax(logits + gumbel_noise(keys, columns), dim=-1) as counter_random.py computes it.
torch::Tensor gumbel_argmax_rows(const torch::Tensor& logits, const torch::Tensor& keys, const torch::Tensor& columns) {
  check_logits(logits);
  const int64_t S = logits.size(0), V = logits.size(1);
  TORCH_CHECK(keys.device().is_cpu() && keys.scalar_type() == at::kInt && keys.dim() == 1 && keys.size(0) == S &&
                  keys.is_contiguous(),
              "keys must be a contiguous int32 CPU tensor [S]");
  TORCH_CHECK(columns.device().is_cpu() && columns.scalar_type() == at::kInt && columns.dim() == 1 &&
                  columns.size(0) == V && columns.is_contiguous(),
              "columns must be a contiguous int32 CPU tensor [V]");
  auto out = torch::empty({S}, logits.options().dtype(at::kLong));
#ifdef TOKENWIRE_SAMPLING_OPS
  const float* x = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  const int32_t* k = keys.data_ptr<int32_t>();
  const int32_t* c = columns.data_ptr<int32_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const float g_max = gumbel_max();
  at::parallel_for(0, S, 2, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) o[s] = gumbel_argmax_row(x + s * row_stride, V, k[s], c, g_max);
  });
#endif
  return out;
}

#ifdef TOKENWIRE_SAMPLING_OPS
constexpr int kTopPBins = 2048;      // as processors.TOP_P_NUM_BINS
constexpr float kTopPBinsPerLogit = 32.0f;  // 1 / processors.TOP_P_BIN_WIDTH

inline __m512i top_p_bins16(__m512 top, __m512 v) {
  // (top - v) * 32, capped at the last bin (-inf lands there: min_ps(inf, last) is last).
  const __m512 d = _mm512_min_ps(_mm512_mul_ps(_mm512_sub_ps(top, v), _mm512_set1_ps(kTopPBinsPerLogit)),
                                 _mm512_set1_ps(static_cast<float>(kTopPBins - 1)));
  return _mm512_cvttps_epi32(d);
}

struct BandToken {
  float value;
  int32_t id;
  float mass;
};

// Fills remove[0, V) and returns true, or returns false (remove untouched) where the row is not settled.
bool top_p_row(const float* x, int64_t V, double p, bool* remove, std::vector<float>& mass,
               std::vector<double>& hist, std::vector<int32_t>& count, std::vector<BandToken>& band) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  bool nan_seen = false;
  const float top = row_max(x, V, nan_seen);
  if (nan_seen || !std::isfinite(top)) return false;
  const __m512 top_v = _mm512_set1_ps(top);
  std::fill(hist.begin(), hist.end(), 0.0);
  std::fill(count.begin(), count.end(), 0);
  double total = 0.0;
  alignas(64) float e16[16];
  alignas(64) int32_t b16[16];
  for (int64_t k = 0; k < V; k += 16) {
    const __mmask16 live = tokenwire::lanes(V - k);
    const __m512 v = _mm512_mask_loadu_ps(minus_inf, live, x + k);
    const __m512 e = _mm512_maskz_mov_ps(live, tokenwire::exp_ps(_mm512_sub_ps(v, top_v)));
    _mm512_mask_storeu_ps(mass.data() + k, live, e);
    _mm512_store_ps(e16, e);
    _mm512_store_si512(b16, top_p_bins16(top_v, v));
    const int n = static_cast<int>(std::min<int64_t>(16, V - k));
    for (int j = 0; j < n; ++j) {
      hist[b16[j]] += e16[j];
      count[b16[j]] += 1;
      total += e16[j];
    }
  }
  // The first bin where the mass reaches p; the band is it and its two neighbours.
  const double target = p * total;
  int cut = 0;
  double reached = 0.0;
  while (cut < kTopPBins && (reached += hist[cut]) < target) ++cut;
  if (cut == kTopPBins) return false;
  const int first = std::max(cut - 1, 0), last = std::min(cut + 1, kTopPBins - 1);
  double above = 0.0;
  for (int b = 0; b < first; ++b) above += hist[b];
  int64_t width = 0;
  for (int b = first; b <= last; ++b) width += count[b];
  if (width > V / 8) return false;  // a flat row: the full sort costs no more
  band.clear();
  for (int64_t k = 0; k < V; k += 16) {
    const __mmask16 live = tokenwire::lanes(V - k);
    const __m512 v = _mm512_mask_loadu_ps(minus_inf, live, x + k);
    const __m512i b = top_p_bins16(top_v, v);
    __mmask16 in = _mm512_mask_cmp_epi32_mask(live, b, _mm512_set1_epi32(first), _MM_CMPINT_NLT);
    in = _mm512_mask_cmp_epi32_mask(in, b, _mm512_set1_epi32(last), _MM_CMPINT_LE);
    while (in) {
      const int j = __builtin_ctz(in);
      in &= in - 1;
      band.push_back({x[k + j], static_cast<int32_t>(k + j), mass[k + j]});
    }
  }
  // Descending value, ties by ascending id: the order a stable descending sort of the row gives.
  std::sort(band.begin(), band.end(), [](const BandToken& a, const BandToken& b) {
    return a.value > b.value || (a.value == b.value && a.id < b.id);
  });
  // A token's cumulative mass in ascending order is the total less what lies above it, rounded to
  // float32 as transformers' cumsum rounds it; dropped where it is <= 1 - p.
  const float drop_at = static_cast<float>(1.0 - p);
  auto dropped = [&](double mass_above) { return static_cast<float>((total - mass_above) / total) <= drop_at; };
  const bool top_in_band = first == 0;
  if (!top_in_band && dropped(above)) return false;  // the cut lies above the band
  double band_mass = 0.0;
  for (const BandToken& t : band) band_mass += t.mass;
  if (!dropped(above + band_mass)) return false;  // the cut lies below the band
  for (int64_t k = 0; k < V; k += 16) {
    const __mmask16 live = tokenwire::lanes(V - k);
    const __m512 v = _mm512_mask_loadu_ps(minus_inf, live, x + k);
    const __mmask16 below = _mm512_mask_cmp_epi32_mask(live, top_p_bins16(top_v, v), _mm512_set1_epi32(last),
                                                       _MM_CMPINT_NLE);
    const int n = static_cast<int>(std::min<int64_t>(16, V - k));
    for (int j = 0; j < n; ++j) remove[k + j] = (below >> j) & 1;
  }
  for (size_t j = 0; j < band.size(); ++j) {
    remove[band[j].id] = !(j == 0 && top_in_band) && dropped(above);
    above += band[j].mass;
  }
  return true;
}
#endif

// logits [S, V] float32 with contiguous rows, p [S] float64 in (0, 1) -> (remove [S, V] bool,
// settled [S] bool): top_p's mask where settled; unsettled rows are left to the caller.
std::tuple<torch::Tensor, torch::Tensor> top_p_rows(const torch::Tensor& logits, const torch::Tensor& p) {
  check_logits(logits);
  const int64_t S = logits.size(0), V = logits.size(1);
  TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kDouble && p.dim() == 1 && p.size(0) == S &&
                  p.is_contiguous(),
              "p must be a contiguous float64 CPU tensor [S]");
  auto remove = torch::ones({S, V}, logits.options().dtype(at::kBool));
  auto settled = torch::zeros({S}, logits.options().dtype(at::kBool));
#ifdef TOKENWIRE_SAMPLING_OPS
  const float* x = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  const double* pp = p.data_ptr<double>();
  bool* r = remove.data_ptr<bool>();
  bool* ok = settled.data_ptr<bool>();
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> mass(V);
    std::vector<double> hist(kTopPBins);
    std::vector<int32_t> count(kTopPBins);
    std::vector<BandToken> band;
    for (int64_t s = s0; s < s1; ++s)
      ok[s] = top_p_row(x + s * row_stride, V, pp[s], r + s * V, mass, hist, count, band);
  });
#endif
  return {remove, settled};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "whether this build has the AVX-512 kernel");
  // Without the GIL, as torch's own ops run.
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, dim=-1) for float32 [S, V] on CPU",
        pybind11::arg("logits"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gumbel_argmax_rows", &gumbel_argmax_rows,
        "argmax(logits + counter_random.gumbel_noise(keys, columns), dim=-1) for float32 [S, V] on CPU",
        pybind11::arg("logits"), pybind11::arg("keys"), pybind11::arg("columns"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("top_p_rows", &top_p_rows,
        "top_p's remove mask for float32 [S, V] on CPU where settled, and which rows are (p: float64 [S])",
        pybind11::arg("logits"), pybind11::arg("p"), pybind11::call_guard<pybind11::gil_scoped_release>());
}
