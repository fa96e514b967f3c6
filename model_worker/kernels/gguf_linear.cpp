// Weight-only matmuls on GGUF's block formats, for steps of 1-8 tokens on CPU (--int4-small-batch):
//   y [M, N] (bf16) = x [M, K] (bf16) @ dequant(w) [N, K]^T (+ bias [N]), per group g = k / 32 of a row:
//   q4_1_linear: dequant(w)[n, k] = d[n, g] * q[n, k] + m[n, g], q in 0..15 (the decoder layers' matmuls);
//   q8_0_linear: dequant(w)[n, k] = d[n, g] * q[n, k], q in -127..127 (the lm_head).
// A GGUF model stored in these formats (SmolLM2's file: Q4_1 layers, a Q8_0 token_embd, which is
// its tied lm_head) comes back here as the file's own weights: quantize_q4_1 and quantize_q8_0 in
// model_worker/models/linear.py find the same q, d and m in the float32 weights transformers
// dequantized, not a further rounding of them.
//
// Such steps read every weight once and do little math: the bytes decide. Q4_1 is 5 bits a weight
// (0.31x bf16's bytes), Q8_0 8.5 (0.53x).
// - x is quantized per group of 32 columns to int8 (one float scale a group, llama.cpp's Q8_1
//   activations); for Q4_1 each group's exact float sum is kept for the m term:
//   sum_k x[k] w[k] = d * sum_k x[k] q[k] + m * sum_k x[k].
// - A block of 4 output rows is one contiguous stream, group after group ([ceil(N/4), K/32, bytes]).
//   Q4_1, 80 bytes a group: 64 bytes of nibbles (row r's 16 bytes at 16r; byte j holds q[j] low and
//   q[j+16] high, Q4_1's order), then the 4 rows' d and the 4 rows' m as fp16. Q8_0, 144 bytes: the
//   4 rows' 32 int8 each, their d as fp16, and each row's sum of q as int16 (below).
// - VPDPBUSD (AVX512-VNNI) multiplies u8 by s8, 4 products per int32 lane. Q4_1: the 64 nibble
//   bytes split into two registers of 0..15 bytes, and two VPDPBUSD against x's group broadcast to
//   every 128-bit lane do the 4 rows' 128 multiply-adds (lanes 4r..4r+3: row r). Q8_0: x is the
//   unsigned side, offset by 128, against rows 0-1 and rows 2-3 (8 lanes a row); the offset adds
//   128 * sum(q) to a row's sum, subtracted exactly (an integer below 2^24, in float) from the row's
//   first lane, so no rounding of x is multiplied by 128.
// The partial sums go to float at once (the scales change every group), scaled by d and x's scale.
//
// pack_q4_1_blocks and pack_q8_0_blocks (linear.py) make the packed layouts; vectorized() is false
// where the compiler was not given AVX512-BW/VNNI (then the model keeps its bf16 path).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TOKENWIRE_GGUF_LINEAR 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;         // output rows per packed block
constexpr int64_t kCols = 32;        // columns per group (one d and m per row)
constexpr int64_t kQ4GroupBytes = 80;   // 64 nibble bytes + 4 fp16 d + 4 fp16 m
constexpr int64_t kQ8GroupBytes = 144;  // 128 int8 + 4 fp16 d + 4 int16 sums of q
constexpr int64_t kMaxTokens = 8;       // rows of x (GGUF_KERNEL_MAX_TOKENS in linear.py)
// Bytes ahead in the packed stream, as bf16_linear.cpp's 4 KiB (a SmolLM2 block of 576 columns
// is 1.4 KiB here, so this runs ~3 blocks ahead).
constexpr int64_t kPrefetch = 4096;

bool vectorized() {
#ifdef TOKENWIRE_GGUF_LINEAR
  return true;
#else
  return false;
#endif
}

// x's rows per group of 32: int8 values, a scale (amax / 127) and the group's float sum. A row
// holding a NaN or an infinity gets NaN scales and sums, so all its outputs are NaN.
void quantize_groups(const c10::BFloat16* x, int64_t M, int64_t K, int8_t* qx, float* scales, float* sums) {
  const int64_t G = K / kCols;
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* row = x + m * K;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) finite = finite && std::isfinite(static_cast<float>(row[k]));
    for (int64_t g = 0; g < G; ++g) {
      const c10::BFloat16* group = row + g * kCols;
      int8_t* out = qx + m * K + g * kCols;
      float amax = 0.f, sum = 0.f;
      for (int64_t k = 0; k < kCols; ++k) {
        const float v = static_cast<float>(group[k]);
        amax = std::max(amax, std::fabs(v));
        sum += v;
      }
      if (!finite) {
        std::fill(out, out + kCols, int8_t{0});
        scales[m * G + g] = sums[m * G + g] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      // A group of zeros (or of values so small that amax / 127 is 0 in float) has scale 0 and
      // q = 0. Divided, not multiplied by an inverse: a subnormal scale's inverse is inf.
      const float scale = amax / 127.f;
      for (int64_t k = 0; k < kCols; ++k)
        out[k] = scale > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(group[k]) / scale),
                                                              -127.f, 127.f))
                             : int8_t{0};
      scales[m * G + g] = scale;
      sums[m * G + g] = sum;
    }
  }
}

#ifdef TOKENWIRE_GGUF_LINEAR
// One Q4_1 block (rows n0 .. n0+3) against all M rows of x.
template <int M>
void q4_1_block(const int8_t* qx, const float* x_scales, const float* x_sums, int64_t G, const uint8_t* wb, int64_t n0,
           int64_t N, const float* bias, c10::BFloat16* y) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  // Lane l of a row-scale vector holds row l / 4's.
  const __m512i row_of_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[M];
  for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = wb + g * kQ4GroupBytes;
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + 64), _MM_HINT_T0);
    const __m512i packed = _mm512_loadu_si512(p);
    const __m512i q_low = _mm512_and_si512(packed, low_nibbles);                         // columns 0..15
    const __m512i q_high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);  // columns 16..31
    const __m512 d = _mm512_permutexvar_ps(
        row_of_lane, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 64)))));
    const __m512 m = _mm512_permutexvar_ps(
        row_of_lane, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 72)))));
    for (int t = 0; t < M; ++t) {
      const int8_t* xg = qx + (t * G + g) * kCols;
      const __m512i x_low = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xg)));
      const __m512i x_high = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xg + 16)));
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q_low, x_low), q_high, x_high);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x_scales[t * G + g])), acc[t]);
      acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(0.25f * x_sums[t * G + g]), acc[t]);
    }
  }
  for (int t = 0; t < M; ++t) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[t]);
    for (int r = 0; r < kRows && n0 + r < N; ++r) {
      float sum = (lanes[4 * r] + lanes[4 * r + 1]) + (lanes[4 * r + 2] + lanes[4 * r + 3]);
      if (bias != nullptr) sum += bias[n0 + r];
      y[t * N + n0 + r] = c10::BFloat16(sum);
    }
  }
}

// One Q8_0 block (rows n0 .. n0+3) against all M rows of x: per group, rows 0-1 and rows 2-3 are
// one 64-byte load each (a row's 32 int8 at 32r); x's int8 group, offset by 128 to u8 (VPDPBUSD's
// unsigned operand), is broadcast to both 256-bit halves. The offset adds 128 * sum(q) to a row's
// dot product: subtracted exactly, in float (integers below 2^24), from the row's first lane.
template <int M>
void q8_0_block(const int8_t* qx, const float* x_scales, int64_t G, const uint8_t* wb, int64_t n0, int64_t N,
                const float* bias, c10::BFloat16* y) {
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  // Lane l of a pair-scale vector holds row l / 8's (of the pair).
  const __m512i rows_01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i rows_23 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  const __mmask16 first_lanes = 0x0101;
  __m512 acc01[M], acc23[M];
  for (int t = 0; t < M; ++t) acc01[t] = acc23[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = wb + g * kQ8GroupBytes;
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + 128), _MM_HINT_T0);
    const __m512i w01 = _mm512_loadu_si512(p);
    const __m512i w23 = _mm512_loadu_si512(p + 64);
    const __m512 d4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 128))));
    const __m512 d01 = _mm512_permutexvar_ps(rows_01, d4), d23 = _mm512_permutexvar_ps(rows_23, d4);
    const __m512 sums4 = _mm512_castps128_ps512(_mm_mul_ps(
        _mm_cvtepi32_ps(_mm_cvtepi16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 136)))),
        _mm_set1_ps(128.f)));
    const __m512 corr01 = _mm512_maskz_permutexvar_ps(first_lanes, rows_01, sums4);
    const __m512 corr23 = _mm512_maskz_permutexvar_ps(first_lanes, rows_23, sums4);
    for (int t = 0; t < M; ++t) {
      const __m512i xg = _mm512_xor_si512(
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + (t * G + g) * kCols))), offset);
      const __m512 scale = _mm512_set1_ps(x_scales[t * G + g]);
      const __m512 dot01 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xg, w01)), corr01);
      const __m512 dot23 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xg, w23)), corr23);
      acc01[t] = _mm512_fmadd_ps(dot01, _mm512_mul_ps(d01, scale), acc01[t]);
      acc23[t] = _mm512_fmadd_ps(dot23, _mm512_mul_ps(d23, scale), acc23[t]);
    }
  }
  for (int t = 0; t < M; ++t) {
    alignas(64) float lanes[32];
    _mm512_store_ps(lanes, acc01[t]);
    _mm512_store_ps(lanes + 16, acc23[t]);
    for (int r = 0; r < kRows && n0 + r < N; ++r) {
      const float* l = lanes + 8 * r;
      float sum = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
      if (bias != nullptr) sum += bias[n0 + r];
      y[t * N + n0 + r] = c10::BFloat16(sum);
    }
  }
}

enum class Format { kQ4_1, kQ8_0 };

template <Format F, int M>
void run(const int8_t* qx, const float* x_scales, const float* x_sums, int64_t G, const uint8_t* w,
         int64_t num_blocks, int64_t N, const float* bias, c10::BFloat16* y) {
  const int64_t block_bytes = G * (F == Format::kQ4_1 ? kQ4GroupBytes : kQ8GroupBytes);
  // Grain 8 blocks (32 rows), as int8_linear.cpp: a 576-row matrix still splits over two threads.
  at::parallel_for(0, num_blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if constexpr (F == Format::kQ4_1)
        q4_1_block<M>(qx, x_scales, x_sums, G, w + b * block_bytes, b * kRows, N, bias, y);
      else
        q8_0_block<M>(qx, x_scales, G, w + b * block_bytes, b * kRows, N, bias, y);
    }
  });
}
#endif

template <Format F>
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor packed, int64_t N, std::optional<torch::Tensor> bias) {
  constexpr int64_t group_bytes = F == Format::kQ4_1 ? kQ4GroupBytes : kQ8GroupBytes;
  TORCH_CHECK(vectorized(), "built without AVX512-BW/VNNI");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == group_bytes &&
                  packed.is_contiguous(),
              "packed must be contiguous uint8 [ceil(N/4), K/32, ", group_bytes, "]");
  const int64_t M = x.size(0), K = x.size(1), num_blocks = packed.size(0), G = packed.size(1);
  TORCH_CHECK(M <= kMaxTokens, "at most ", kMaxTokens, " rows, got ", M);
  TORCH_CHECK(K == G * kCols, "x has ", K, " columns, the packed weight ", G * kCols);
  TORCH_CHECK(N > 0 && num_blocks == (N + kRows - 1) / kRows, "N = ", N, " rows, the packed weight ",
              num_blocks * kRows);
  torch::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu(), "bias must be [N] on the CPU");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto xc = x.contiguous();
  std::vector<int8_t> qx(M * K);
  std::vector<float> x_scales(M * G), x_sums(M * G);
  quantize_groups(xc.data_ptr<c10::BFloat16>(), M, K, qx.data(), x_scales.data(), x_sums.data());
#ifdef TOKENWIRE_GGUF_LINEAR
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* b = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  c10::BFloat16* out = y.data_ptr<c10::BFloat16>();
  const int8_t* q = qx.data();
  const float* s = x_scales.data();
  const float* sums = x_sums.data();
  switch (M) {
    case 1: run<F, 1>(q, s, sums, G, w, num_blocks, N, b, out); break;
    case 2: run<F, 2>(q, s, sums, G, w, num_blocks, N, b, out); break;
    case 3: run<F, 3>(q, s, sums, G, w, num_blocks, N, b, out); break;
    case 4: run<F, 4>(q, s, sums, G, w, num_blocks, N, b, out); break;
    case 5: run<F, 5>(q, s, sums, G, w, num_blocks, N, b, out); break;
    case 6: run<F, 6>(q, s, sums, G, w, num_blocks, N, b, out); break;
    case 7: run<F, 7>(q, s, sums, G, w, num_blocks, N, b, out); break;
    default: run<F, 8>(q, s, sums, G, w, num_blocks, N, b, out); break;
  }
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "whether this build has the AVX512-BW/VNNI kernel");
  // Without the GIL, as oneDNN's matmul runs: the model worker's event loop keeps working meanwhile.
  m.def("q4_1_linear", &gguf_linear<Format::kQ4_1>,
        "y [M, N] bf16 = x [M, K] bf16 @ (Q4_1 weight [N, K], packed)^T (+ bias), M <= 8", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("N"), pybind11::arg("bias") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q8_0_linear", &gguf_linear<Format::kQ8_0>,
        "y [M, N] bf16 = x [M, K] bf16 @ (Q8_0 weight [N, K], packed)^T (+ bias), M <= 8", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("N"), pybind11::arg("bias") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
