// The sampler's greedy pick on CPU: the argmax of each row of float32 logits.
//
// Why a kernel: torch's CPU argmax over a 49152-wide vocabulary took 57 us a row at one row and
// 0.9 ms for 32 rows (2 threads, measured on this project's 2-core AVX-512 machine): about 3% of a
// 32-stream decode step, for a reduction that reads 6 MB already in cache. Here each row is one
// pass of 16-lane compares.
//
// Same answer as torch.argmax(dim=-1): the first index of the largest value; a row with a NaN gives
// the index of its first NaN (torch counts NaN as the largest); a row of all -inf gives 0.
//
// vectorized() is false where the compiler was not given AVX-512 (the sampler then keeps torch's).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>

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

// logits [S, V] float32, rows contiguous -> [S] int64.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(vectorized(), "built without AVX-512");
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "logits must be a float32 CPU tensor [S, V] with contiguous rows");
  const int64_t S = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1 && V < std::numeric_limits<int32_t>::max(), "V must be in [1, 2^31 - 1), got ", V);
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "whether this build has the AVX-512 kernel");
  // Without the GIL, as torch's own ops run.
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, dim=-1) for float32 [S, V] on CPU",
        pybind11::arg("logits"), pybind11::call_guard<pybind11::gil_scoped_release>());
}
