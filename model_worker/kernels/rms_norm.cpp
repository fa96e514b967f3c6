// RMSNorm for bf16 rows on CPU, alone or fused with the residual add before it, as one call.
//
// A decode step of one or a few tokens spends much of its time outside the matmuls in per-op
// overhead: torch's float32 RMSNorm on a bf16 row is ~8 dispatched ops (upcast, the fused
// norm's pieces, downcast, the weight's multiply), 12 us at SmolLM2's 576 columns, twice per
// layer, plus the residual add. This computes what llama.py's torch path computes, in the same
// roundings:
//   x_sum = bf16(x + delta)                                (the residual add, when fused)
//   h     = bf16(weight * bf16(x_sum * rsqrt(mean(x_sum^2) + eps)))   (float32 inside)
// Only the float32 sum of squares is taken in a different order than torch's, so h may differ
// from the torch path by one bf16 rounding step on rare elements.
//
// vectorized() is false where the compiler was not given AVX512-BF16 (the model then keeps the
// torch ops).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TOKENWIRE_RMS_NORM 1
#include <immintrin.h>
#endif

namespace {

bool vectorized() {
#ifdef TOKENWIRE_RMS_NORM
  return true;
#else
  return false;
#endif
}

#ifdef TOKENWIRE_RMS_NORM
inline __m512 load_bf16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 load_bf16_masked(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 -> bf16, round to nearest even (NaN stays NaN), as torch's casts do.
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// One row: writes x_sum (when delta is given) and h.
void norm_row(const c10::BFloat16* x, const c10::BFloat16* delta, c10::BFloat16* x_sum, const c10::BFloat16* weight,
              c10::BFloat16* h, int64_t H, float eps) {
  // Pass 1: the residual sum (rounded to bf16, as the torch add would leave it) and its squares.
  __m512 squares = _mm512_setzero_ps();
  const c10::BFloat16* source = x;
  int64_t k = 0;
  for (; k + 16 <= H; k += 16) {
    __m512 v = load_bf16(x + k);
    if (delta != nullptr) {
      const __m256i rounded = to_bf16(_mm512_add_ps(v, load_bf16(delta + k)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x_sum + k), rounded);
      v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  if (k < H) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (H - k)) - 1);
    __m512 v = load_bf16_masked(x + k, mask);
    if (delta != nullptr) {
      const __m256i rounded = to_bf16(_mm512_add_ps(v, load_bf16_masked(delta + k, mask)));
      _mm256_mask_storeu_epi16(x_sum + k, mask, rounded);
      v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  if (delta != nullptr) source = x_sum;
  const float rstd = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(H) + eps);
  const __m512 scale = _mm512_set1_ps(rstd);
  // Pass 2: normalise, round to bf16, multiply by the weight, round again.
  for (k = 0; k + 16 <= H; k += 16) {
    const __m512 normed = load_bf16(source + k);
    const __m256i once = to_bf16(_mm512_mul_ps(normed, scale));
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(once), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + k), to_bf16(_mm512_mul_ps(back, load_bf16(weight + k))));
  }
  if (k < H) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (H - k)) - 1);
    const __m256i once = to_bf16(_mm512_mul_ps(load_bf16_masked(source + k, mask), scale));
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(once), 16));
    _mm256_mask_storeu_epi16(h + k, mask, to_bf16(_mm512_mul_ps(back, load_bf16_masked(weight + k, mask))));
  }
}
#endif

void check(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(vectorized(), "built without AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, H]");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "weight must be contiguous [H] with H = ", x.size(1));
}

void run(const torch::Tensor& x, const c10::BFloat16* delta, c10::BFloat16* x_sum, const torch::Tensor& weight,
         const torch::Tensor& h, double eps) {
#ifdef TOKENWIRE_RMS_NORM
  const int64_t T = x.size(0), H = x.size(1);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  c10::BFloat16* hp = h.data_ptr<c10::BFloat16>();
  // Rows in parallel only when there are enough of them to pay for waking the other threads.
  at::parallel_for(0, T, 32, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      norm_row(xp + t * H, delta ? delta + t * H : nullptr, x_sum ? x_sum + t * H : nullptr, wp, hp + t * H, H,
               static_cast<float>(eps));
  });
#endif
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check(x, weight);
  auto h = torch::empty_like(x);
  run(x, nullptr, nullptr, weight, h, eps);
  return h;
}

// (x + delta, rms_norm(x + delta)) in one pass over the rows.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                      const torch::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(delta.scalar_type() == at::kBFloat16 && delta.sizes() == x.sizes() && delta.is_contiguous() &&
                  delta.device().is_cpu(),
              "delta must be a contiguous bfloat16 CPU tensor shaped like x");
  auto x_sum = torch::empty_like(x);
  auto h = torch::empty_like(x);
  run(x, delta.data_ptr<c10::BFloat16>(), x_sum.data_ptr<c10::BFloat16>(), weight, h, eps);
  return {x_sum, h};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "whether this build has the AVX512-BF16 kernel");
  m.def("rms_norm", &rms_norm, "bf16(weight * bf16(rms_norm_f32(x))) for x [T, H] bf16", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta)) for bf16 [T, H]", pybind11::arg("x"),
        pybind11::arg("delta"), pybind11::arg("weight"), pybind11::arg("eps"));
}
