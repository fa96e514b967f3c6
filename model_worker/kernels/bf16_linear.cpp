// bf16 matmul for steps of a few tokens on CPU (--bf16-small-batch):
//   y [M, N] (bf16) = x [M, K] (bf16) @ w [N, K]^T (+ bias [N]), summed in float32.
//
// Such steps read every weight once and do little math, so the kernel is about streaming the
// weights at memory bandwidth. oneDNN's packed bf16 matmul (the model's path for larger steps)
// streamed SmolLM2's layer weights at 24-29 GB/s from DRAM at 1-4 rows, where a copy runs at
// ~40 (scratch timing, 2026-11-23; whole decode steps: bench/bench_bf16_linear.py). Here, as in
// int8_linear.cpp:
// - the weights are packed so a block of 4 output rows is one contiguous stream
//   ([ceil(N/4), Kp/32, 4, 32], Kp = K rounded up to 32, zero-padded; pack_row_blocks in
//   model_worker/models/linear.py), which the hardware prefetcher follows, and a software
//   prefetch runs a fixed distance ahead of the reads;
// - one VDPBF16PS (AVX512-BF16) does 32 multiply-adds of x's row against a weight row, into
//   16 float lanes; a block's 4 rows x (up to 4) rows of x are 16 accumulators, reduced at the
//   block's end by one transposed sum per row of x.
// The products of two bf16 values are exact in float32 and the bias is added in float32 before
// the one bf16 rounding, as oneDNN does, so this differs from oneDNN's bf16 matmul only in the
// order of the float32 sums. (VDPBF16PS flushes bf16 denormals to zero; oneDNN's packed path
// does too.)
//
// vectorized() is false where the compiler was not given AVX512-BF16 (then the model keeps
// oneDNN's path for every step).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#define TOKENWIRE_BF16_LINEAR 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;        // output rows per packed block
constexpr int64_t kCols = 32;       // columns per VDPBF16PS
constexpr int64_t kMaxTokens = 16;  // rows of x (BF16_KERNEL_MAX_TOKENS bounds what linear.py sends)
constexpr int kGroup = 4;           // rows of x per pass over a block (4 x 4 accumulators)
// Bytes ahead in the packed stream (a block of SmolLM2's 576 columns is 4.5 KiB). Over a decode
// step's weights from DRAM (scratch, 2026-11-23), 4 and 8 KiB streamed at 45-47 GB/s at 1-4 rows,
// none or 1-2 KiB at 33-44.
constexpr int64_t kPrefetch = 4096;

bool vectorized() {
#ifdef TOKENWIRE_BF16_LINEAR
  return true;
#else
  return false;
#endif
}

#ifdef TOKENWIRE_BF16_LINEAR
// The sums of 4 accumulators' 16 lanes each, as the 4 lanes of one __m128 (lane r: acc[r]).
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m256 s0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
  const __m256 s1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
  const __m256 s2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
  const __m256 s3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
  // hadd pairs neighbours within each 128-bit half: after two rounds, half h of t holds
  // [s0, s1, s2, s3]'s partial sums over their half h.
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// One packed block (output rows n0 .. n0+3) against M <= 4 rows of x (row stride K); bias:
// [N] or null.
template <int M>
void block(const c10::BFloat16* x, int64_t K, int64_t Kp, const c10::BFloat16* wb, int64_t n0, int64_t N,
           const c10::BFloat16* bias, c10::BFloat16* y) {
  __m512 acc[kRows][M];
  for (int r = 0; r < kRows; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t full = K / kCols * kCols;
  const char* stream = reinterpret_cast<const char*>(wb);
  for (int64_t k = 0; k < Kp; k += kCols) {
    const c10::BFloat16* wk = wb + k * kRows;  // 4 rows x 32 columns, contiguous
    const char* ahead = stream + k * kRows * 2 + kPrefetch;
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    _mm_prefetch(ahead + 192, _MM_HINT_T0);
    // x's columns past K (the packed weight's zero padding) load as zeros.
    const __mmask32 columns = k < full ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(columns, x + m * K + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wk + r * kCols);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv[m], wv);
    }
  }
  const int valid = static_cast<int>(std::min<int64_t>(kRows, N - n0));
  float added[kRows] = {};
  if (bias != nullptr)
    for (int r = 0; r < valid; ++r) added[r] = static_cast<float>(bias[n0 + r]);
  for (int m = 0; m < M; ++m) {
    alignas(16) float sums[kRows];
    _mm_store_ps(sums, sum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
    for (int r = 0; r < valid; ++r) y[m * N + n0 + r] = c10::BFloat16(sums[r] + added[r]);
  }
}

// Rows of x in passes of at most 4 (more accumulators than registers otherwise); a block's later
// passes read its 4 x Kp x 2 weight bytes again from L1 or L2, so memory is still read once.
template <int M>
void block_rows(const c10::BFloat16* x, int64_t K, int64_t Kp, const c10::BFloat16* wb, int64_t n0, int64_t N,
                const c10::BFloat16* bias, c10::BFloat16* y) {
  if constexpr (M <= kGroup) {
    block<M>(x, K, Kp, wb, n0, N, bias, y);
  } else {
    block<kGroup>(x, K, Kp, wb, n0, N, bias, y);
    block_rows<M - kGroup>(x + kGroup * K, K, Kp, wb, n0, N, bias, y + kGroup * N);
  }
}

template <int M>
void run(const c10::BFloat16* x, int64_t K, int64_t Kp, const c10::BFloat16* w, int64_t num_blocks, int64_t N,
         const c10::BFloat16* bias, c10::BFloat16* y) {
  // Grain 8 blocks (32 rows): a 576-row matrix still splits over two threads.
  at::parallel_for(0, num_blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block_rows<M>(x, K, Kp, w + b * kRows * Kp, b * kRows, N, bias, y);
  });
}

template <int M>
void dispatch(int64_t rows, const c10::BFloat16* x, int64_t K, int64_t Kp, const c10::BFloat16* w,
              int64_t num_blocks, int64_t N, const c10::BFloat16* bias, c10::BFloat16* y) {
  if constexpr (M > 1) {
    if (rows < M) return dispatch<M - 1>(rows, x, K, Kp, w, num_blocks, N, bias, y);
  }
  run<M>(x, K, Kp, w, num_blocks, N, bias, y);
}
#endif

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t in_features,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(vectorized(), "built without AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kRows &&
                  packed.size(3) == kCols && packed.is_contiguous(),
              "packed must be contiguous bfloat16 [ceil(N/4), Kp/32, 4, 32]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t num_blocks = packed.size(0), Kp = packed.size(1) * kCols;
  TORCH_CHECK(M <= kMaxTokens, "at most ", kMaxTokens, " rows, got ", M);
  TORCH_CHECK(K == in_features, "x has ", K, " columns, the weight ", in_features);
  TORCH_CHECK(Kp >= K && Kp - K < kCols, "in_features is ", K, ", the packed weight has ", Kp, " columns");
  TORCH_CHECK(N >= 0 && num_blocks == (N + kRows - 1) / kRows, "out_features is ", N, ", the packed weight has ",
              num_blocks * kRows, " rows");
  if (bias.has_value())
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 &&
                    bias->size(0) == N && bias->is_contiguous(),
                "bias must be contiguous bfloat16 [out_features]");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xc = x.contiguous();
#ifdef TOKENWIRE_BF16_LINEAR
  dispatch<kMaxTokens>(M, xc.data_ptr<c10::BFloat16>(), K, Kp, packed.data_ptr<c10::BFloat16>(), num_blocks, N,
                       bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>());
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "whether this build has the AVX512-BF16 kernel");
  // Without the GIL, like oneDNN's matmul it stands in for: the model worker's event loop keeps
  // framing and sending while a step runs.
  m.def("bf16_linear", &bf16_linear,
        "y [M, N] bf16 = x [M, K] bf16 @ w^T (+ bias), w packed as [ceil(N/4), Kp/32, 4, 32] bf16, M <= 16",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("in_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
}
