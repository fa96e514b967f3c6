// Weight-only int8 matmul for steps of 1-8 tokens on CPU (--int8-small-batch):
//   y [M, N] (bf16) = x [M, K] (bf16) @ dequant(w) [N, K]^T,  dequant(w)[n, k] = w[n, k] * scale[n].
//
// Such steps read every weight once and do little math, so the kernel is about streaming the
// weights at memory bandwidth. torch's _weight_int8pack_mm widens each int8 to float and runs
// float FMAs (4 instructions per 16 weights), and reads rows strided by K; at SmolLM2's
// sizes it streamed 23-25 GB/s where a copy runs at ~43. Here:
// - x's rows are quantized to int16 (symmetric, one scale per row: a step of 2^-15 of the row's
//   largest value, finer than bf16's own rounding for elements above 1/128 of it, and far below
//   the int8 weights' error for the rest) and the int8 weights widened to int16, so one
//   VPDPWSSD (AVX512-VNNI) does 32 multiply-adds;
// - the weights are packed so a block of 4 output rows is one contiguous stream
//   ([ceil(N/4), Kp/32, 4, 32], Kp = K rounded up to 32, zero-padded), which the hardware
//   prefetcher follows; a software prefetch 2 KiB ahead covers block starts.
// A VPDPWSSD lane adds 2 products of at most 32767 * 127 each, so an int32 lane holds 258
// instructions' worth: lanes go to float every 8192 columns (256 instructions), and the 16
// lanes are summed as floats (their int32 sum could overflow).
//
// pack_row_blocks (Python, model_worker/models/linear.py) makes the packed layout;
// vectorized() is false where the compiler was not given AVX512-BW/VNNI (then the model keeps
// torch's op).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TOKENWIRE_INT8_LINEAR 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;          // output rows per packed block
constexpr int64_t kCols = 32;         // columns per VPDPWSSD
constexpr int64_t kMaxTokens = 8;     // rows of x (INT8_KERNEL_MAX_TOKENS in linear.py)
constexpr int kGroup = 4;             // rows of x per pass over a block (4 x 4 accumulators)
constexpr int64_t kChunk = 8192;      // columns summed in int32 before going to float
constexpr int64_t kPrefetch = 2048;   // bytes ahead in the packed stream

bool vectorized() {
#ifdef TOKENWIRE_INT8_LINEAR
  return true;
#else
  return false;
#endif
}

#ifdef TOKENWIRE_INT8_LINEAR
// One packed block (rows n0 .. n0+3) against all M rows of x.
template <int M>
void block(const int16_t* qx, int64_t Kp, const int8_t* wb, int64_t n0, int64_t N, const double* x_scales,
           const c10::BFloat16* w_scales, c10::BFloat16* y) {
  float total[kRows][M] = {};
  for (int64_t c0 = 0; c0 < Kp; c0 += kChunk) {
    const int64_t c1 = std::min(Kp, c0 + kChunk);
    __m512i acc[kRows][M];
    for (int r = 0; r < kRows; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_si512();
    for (int64_t k = c0; k < c1; k += kCols) {
      const int8_t* wk = wb + k * kRows;  // 4 rows x 32 columns, contiguous
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch + 64), _MM_HINT_T0);
      __m512i xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(qx + m * Kp + k);
      for (int r = 0; r < kRows; ++r) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + r * kCols)));
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpwssd_epi32(acc[r][m], xv[m], wv);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int m = 0; m < M; ++m) total[r][m] += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc[r][m]));
  }
  for (int r = 0; r < kRows && n0 + r < N; ++r) {
    // In double: x's scale may be tiny or huge, and total * x_scale alone could under- or
    // overflow a float that the weight's scale would bring back into range.
    const double w_scale = static_cast<float>(w_scales[n0 + r]);
    for (int m = 0; m < M; ++m)
      y[m * N + n0 + r] = c10::BFloat16(static_cast<float>(static_cast<double>(total[r][m]) * x_scales[m] * w_scale));
  }
}

// Rows of x in passes of at most 4 (more accumulators than registers otherwise); a block's
// second pass reads its 4 x Kp weight bytes again from L1 or L2 (48 KiB of L1 here holds them up
// to Kp = 12288), so memory is still read once.
template <int M>
void block_rows(const int16_t* qx, int64_t Kp, const int8_t* wb, int64_t n0, int64_t N, const double* x_scales,
                const c10::BFloat16* w_scales, c10::BFloat16* y) {
  if constexpr (M <= kGroup) {
    block<M>(qx, Kp, wb, n0, N, x_scales, w_scales, y);
  } else {
    block<kGroup>(qx, Kp, wb, n0, N, x_scales, w_scales, y);
    block<M - kGroup>(qx + kGroup * Kp, Kp, wb, n0, N, x_scales + kGroup, w_scales, y + kGroup * N);
  }
}

template <int M>
void run(const int16_t* qx, int64_t Kp, const int8_t* w, int64_t num_blocks, int64_t N, const double* x_scales,
         const c10::BFloat16* w_scales, c10::BFloat16* y) {
  // Grain 8 blocks (32 rows): a 576-row matrix still splits over two threads.
  at::parallel_for(0, num_blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block_rows<M>(qx, Kp, w + b * kRows * Kp, b * kRows, N, x_scales, w_scales, y);
  });
}
#endif

// x's rows as int16 with one scale each, zero-padded to Kp columns. A row holding a NaN or an
// infinity gets a NaN scale, so all its outputs are NaN (a float matmul would give NaN for a NaN,
// and +-inf or NaN for an infinity; such a row has already gone wrong either way).
void quantize_rows(const c10::BFloat16* x, int64_t M, int64_t K, int64_t Kp, int16_t* qx, double* scales) {
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* row = x + m * K;
    float amax = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      const float v = static_cast<float>(row[k]);
      finite = finite && std::isfinite(v);
      amax = std::max(amax, std::fabs(v));
    }
    int16_t* out = qx + m * Kp;
    std::fill(out, out + Kp, int16_t{0});
    if (!finite) {
      scales[m] = std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    // In double: with amax below ~1e-34, amax / 32767 is subnormal in float and its inverse inf.
    const double scale = amax > 0.f ? static_cast<double>(amax) / 32767.0 : 1.0;
    const double inverse = amax > 0.f ? 32767.0 / static_cast<double>(amax) : 1.0;
    for (int64_t k = 0; k < K; ++k)
      out[k] = static_cast<int16_t>(std::clamp(std::nearbyint(static_cast<double>(row[k]) * inverse), -32767.0, 32767.0));
    scales[m] = scale;
  }
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales) {
  TORCH_CHECK(vectorized(), "built without AVX512-BW/VNNI");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scales.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kRows &&
                  packed.size(3) == kCols && packed.is_contiguous(),
              "packed must be contiguous int8 [ceil(N/4), Kp/32, 4, 32]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 1 && scales.is_contiguous(),
              "scales must be contiguous bfloat16 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(0);
  const int64_t num_blocks = packed.size(0), Kp = packed.size(1) * kCols;
  TORCH_CHECK(M <= kMaxTokens, "at most ", kMaxTokens, " rows, got ", M);
  TORCH_CHECK(Kp >= K && Kp - K < kCols, "x has ", K, " columns, the packed weight ", Kp);
  TORCH_CHECK(num_blocks == (N + kRows - 1) / kRows, "scales has ", N, " rows, the packed weight ", num_blocks * kRows);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xc = x.contiguous();
  std::vector<int16_t> qx(M * Kp);
  double x_scales[kMaxTokens];
  quantize_rows(xc.data_ptr<c10::BFloat16>(), M, K, Kp, qx.data(), x_scales);
#ifdef TOKENWIRE_INT8_LINEAR
  const int8_t* w = packed.data_ptr<int8_t>();
  const c10::BFloat16* w_scales = scales.data_ptr<c10::BFloat16>();
  c10::BFloat16* out = y.data_ptr<c10::BFloat16>();
  switch (M) {
    case 1: run<1>(qx.data(), Kp, w, num_blocks, N, x_scales, w_scales, out); break;
    case 2: run<2>(qx.data(), Kp, w, num_blocks, N, x_scales, w_scales, out); break;
    case 3: run<3>(qx.data(), Kp, w, num_blocks, N, x_scales, w_scales, out); break;
    case 4: run<4>(qx.data(), Kp, w, num_blocks, N, x_scales, w_scales, out); break;
    case 5: run<5>(qx.data(), Kp, w, num_blocks, N, x_scales, w_scales, out); break;
    case 6: run<6>(qx.data(), Kp, w, num_blocks, N, x_scales, w_scales, out); break;
    case 7: run<7>(qx.data(), Kp, w, num_blocks, N, x_scales, w_scales, out); break;
    default: run<8>(qx.data(), Kp, w, num_blocks, N, x_scales, w_scales, out); break;
  }
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "whether this build has the AVX512-BW/VNNI kernel");
  // Without the GIL, as oneDNN's matmul runs: the model worker's event loop keeps working meanwhile.
  m.def("int8_linear", &int8_linear,
        "y [M, N] bf16 = x [M, K] bf16 @ (packed int8 weight * scales [N])^T, M <= 8", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("scales"), pybind11::call_guard<pybind11::gil_scoped_release>());
}
