// bf16 matmuls on CPU on weights packed in 4-row blocks:
//   y [M, N] (bf16) = x [M, K] (bf16) @ w [N, K]^T (+ bias [N]), summed in float32.
// bf16_linear does it in VDPBF16PS dot products (--bf16-small-batch for steps of a few tokens;
// --cpu-bf16-matmul kernels for every step); bf16_linear_fma, further down, in float32 FMAs, for
// the larger steps on CPUs where VDPBF16PS is slow.
//
// Steps of a few tokens read every weight once and do little math, so there the kernel is about
// streaming the weights at memory bandwidth. oneDNN's packed bf16 matmul streamed SmolLM2's layer
// weights at 24-29 GB/s from DRAM at 1-4 rows, where a copy runs at ~40 (scratch timing,
// 2026-11-23; whole decode steps: bench/bench_bf16_linear.py). Here, as in int8_linear.cpp:
// - the weights are packed so a block of 4 output rows is one contiguous stream
//   ([ceil(N/4), Kp/32, 4, 32], Kp = K rounded up to 32, zero-padded; pack_row_blocks in
//   model_worker/models/linear.py), which the hardware prefetcher follows, and a software
//   prefetch runs a fixed distance ahead of the reads;
// - one VDPBF16PS (AVX512-BF16) does 32 multiply-adds of x's row against a weight row, into
//   16 float lanes; a block's 4 rows x 4 rows of x are 16 accumulators, reduced at the end of the
//   block by one transposed sum. Larger steps pass over each block (then in L1) 4 rows of x at a
//   time, so the weights are still read from memory once.
// A row of y is summed in the same order whatever the step's size and the row's place in it, so
// it does not depend on the other rows; the FMA matmul gives the same bits (below).
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
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#define TOKENWIRE_BF16_LINEAR 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;        // output rows per packed block
constexpr int64_t kCols = 32;       // columns per VDPBF16PS
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
// The sums of 16 accumulators' 16 lanes each, as one vector: lane 4m + r holds a[m][r]'s. Pairs
// are added after each shuffle: 45 single-uop instructions in all, against about 80 uops for
// four 4-accumulator sums by hadd.
inline __m512 sum16(const __m512 (&a)[4][4]) {
  __m512 pairs[4][2];  // level 1: pairs[m][h] = a[m][2h], a[m][2h+1] interleaved, half summed
  for (int m = 0; m < 4; ++m)
    for (int h = 0; h < 2; ++h)
      pairs[m][h] = _mm512_add_ps(_mm512_unpacklo_ps(a[m][2 * h], a[m][2 * h + 1]),
                                  _mm512_unpackhi_ps(a[m][2 * h], a[m][2 * h + 1]));
  __m512 quads[4];  // level 2: in each 128-bit lane of quads[m], a[m][0..3]'s partial sums
  for (int m = 0; m < 4; ++m)
    quads[m] = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(pairs[m][0]), _mm512_castps_pd(pairs[m][1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(pairs[m][0]), _mm512_castps_pd(pairs[m][1]))));
  // levels 3 and 4: the four 128-bit lanes of each quad summed, quad m into lane m.
  const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88), _mm512_shuffle_f32x4(q01, q23, 0xDD));
}

// A block's 4 x M accumulators -> y's rows 0..M-1, columns n0 .. n0+3 (those below N): each
// summed, plus the bias in float32, then rounded to bf16 once (VCVTNEPS2BF16: to nearest even,
// as c10::BFloat16 rounds; it flushes float32 denormals to zero). Converted and stored one value
// at a time, this epilogue cost about as much as a 576-column block's 288 VDPBF16PS.
// Every M goes through sum16 (missing rows as zeros), so a row's sums are added in the same order
// whichever group of x it is in: a row's output does not depend on the rest of the step (bench/
// soak.py replays each request in other batches and expects the same tokens).
template <int M>
inline void store_block(const __m512 (&acc)[kRows][M], int64_t n0, int64_t N, const c10::BFloat16* bias,
                        c10::BFloat16* y) {
  const __mmask8 valid = static_cast<__mmask8>((1u << std::min<int64_t>(kRows, N - n0)) - 1);
  __m128 added = _mm_setzero_ps();
  if (bias != nullptr)  // bf16 -> float32: the bits move to the top half of each lane
    added = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_maskz_loadu_epi16(valid, bias + n0)), 16));
  __m512 by_row[4][4];
  for (int m = 0; m < 4; ++m)
    for (int r = 0; r < kRows; ++r) by_row[m][r] = m < M ? acc[r][m] : _mm512_setzero_ps();
  const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum16(by_row), _mm512_broadcast_f32x4(added)));
  const __m128i rows01 = _mm256_castsi256_si128(rounded), rows23 = _mm256_extracti128_si256(rounded, 1);
  _mm_mask_storeu_epi16(y + n0, valid, rows01);
  if constexpr (M > 1) _mm_mask_storeu_epi16(y + N + n0, valid, _mm_srli_si128(rows01, 8));
  if constexpr (M > 2) _mm_mask_storeu_epi16(y + 2 * N + n0, valid, rows23);
  if constexpr (M > 3) _mm_mask_storeu_epi16(y + 3 * N + n0, valid, _mm_srli_si128(rows23, 8));
}

// acc[r][m] += the dot product of x's row m (row stride K) with the block's row r, over one
// 32-column chunk (wk: its 4 rows x 32 columns, contiguous). Masked: the last, partial chunk,
// whose columns past K (the packed weight's zero padding) load as zeros.
template <int M, bool Masked>
inline void dp_chunk(__m512 (&acc)[kRows][M], const c10::BFloat16* x, int64_t K, int64_t k, const c10::BFloat16* wk,
                     __mmask32 columns) {
  __m512bh xv[M];
  for (int m = 0; m < M; ++m)
    xv[m] = (__m512bh)(Masked ? _mm512_maskz_loadu_epi16(columns, x + m * K + k) : _mm512_loadu_si512(x + m * K + k));
  for (int r = 0; r < kRows; ++r) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(wk + r * kCols);
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv[m], wv);
  }
}

// One packed block (output rows n0 .. n0+3) against M <= 4 rows of x (row stride K); bias:
// [N] or null. Stream: the block comes from memory in this pass (prefetch the stream ahead).
template <int M, bool Stream = true>
void block(const c10::BFloat16* x, int64_t K, int64_t Kp, const c10::BFloat16* wb, int64_t n0, int64_t N,
           const c10::BFloat16* bias, c10::BFloat16* y) {
  __m512 acc[kRows][M];
  for (int r = 0; r < kRows; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  // The partial chunk is taken after the loop, not by a mask chosen inside it: with that choice
  // in the loop, GCC 12 at -O3 kept the accumulators in registers but also stored all 16 to the
  // stack on every iteration (16 stores per 16 VDPBF16PS).
  const int64_t full = K / kCols * kCols;
  const char* stream = reinterpret_cast<const char*>(wb);
  for (int64_t k = 0; k < full; k += kCols) {
    if constexpr (Stream) {
      const char* ahead = stream + k * kRows * 2 + kPrefetch;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      _mm_prefetch(ahead + 128, _MM_HINT_T0);
      _mm_prefetch(ahead + 192, _MM_HINT_T0);
    }
    dp_chunk<M, false>(acc, x, K, k, wb + k * kRows, 0);
  }
  if (full < Kp) dp_chunk<M, true>(acc, x, K, full, wb + full * kRows, (__mmask32)((uint64_t{1} << (K - full)) - 1));
  store_block<M>(acc, n0, N, bias, y);
}

// Both matmuls' outer loops. x goes in chunks of kRowChunk rows, so that what passes over a block
// read of it stays in L2. The output columns go in tiles of kTileBlocks blocks: a thread's
// [rows, 32] tile of y, copied out a row at a time once done (stored straight into y, a 32-row
// step over the lm_head, whose 49152 columns put y's rows 96 KiB apart, in one L1 set, ran at
// 0.75x oneDNN). per_thread() makes a thread's tile_rows(x_row0, rows, b0, b1, cols, tile_bias,
// tile), which fills the tile's rows with blocks b0 .. b1-1 (cols: the tile's width).
constexpr int64_t kRowChunk = 128;
constexpr int64_t kTileBlocks = 8;

template <typename PerThread>
void run_tiled(int64_t M, int64_t num_blocks, int64_t N, const c10::BFloat16* bias, c10::BFloat16* y,
               const PerThread& per_thread) {
  constexpr int64_t tile_width = kTileBlocks * kRows;
  at::parallel_for(0, (num_blocks + kTileBlocks - 1) / kTileBlocks, 1, [&](int64_t t0, int64_t t1) {
    auto tile_rows = per_thread();
    std::vector<c10::BFloat16> tile(static_cast<size_t>(std::min(kRowChunk, M) * tile_width));
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, M - m0);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t c0 = t * tile_width, cols = std::min(tile_width, N - c0);
        tile_rows(m0, rows, t * kTileBlocks, std::min(num_blocks, (t + 1) * kTileBlocks), cols,
                  bias == nullptr ? nullptr : bias + c0, tile.data());
        for (int64_t m = 0; m < rows; ++m) std::copy_n(tile.data() + m * cols, cols, y + (m0 + m) * N + c0);
      }
    }
  });
}

// Blocks b0 .. b1-1 of the tile against `rows` rows of x, 4 rows of x at a time (more
// accumulators than registers otherwise). Up to kStreamRows rows, block by block: each block's
// first pass streams it from memory and its later ones read it from L1. More rows go in panels
// of up to kPanelBytes of blocks: each group of 4 rows passes over the whole panel before the
// next group, so that both stay in L1 (x's rows are read from L2 once per panel, not once per
// block), while the next panel is prefetched into L2 a slice per group (its first pass would
// otherwise wait on memory block by block). Over SmolLM2's shapes at 32-256 rows, 1.2-1.5x the
// block-by-block order (scratch timing, AMD host).
constexpr int64_t kPanelBytes = 24 * 1024;
// Below this the step is bound by reading the weights, which block by block streams best (at 8
// rows in panels: 0.6-0.9x).
constexpr int64_t kStreamRows = 16;

// Rows of x in groups of 4 (the last one smaller): calls pass(std::integral_constant<int, G>,
// g) for group g of G rows.
template <typename Pass>
inline void for_each_group(int64_t rows, const Pass& pass) {
  int64_t g = 0;
  for (; (g + 1) * kGroup <= rows; ++g) pass(std::integral_constant<int, kGroup>{}, g);
  switch (rows - g * kGroup) {
    case 3: pass(std::integral_constant<int, 3>{}, g); break;
    case 2: pass(std::integral_constant<int, 2>{}, g); break;
    case 1: pass(std::integral_constant<int, 1>{}, g); break;
    default: break;
  }
}

void dp_tile(const c10::BFloat16* x, int64_t rows, int64_t K, int64_t Kp, const c10::BFloat16* w, int64_t num_blocks,
             int64_t b0, int64_t b1, int64_t cols, const c10::BFloat16* bias, c10::BFloat16* tile) {
  const int64_t block_elems = kRows * Kp;
  if (rows <= kStreamRows) {
    for (int64_t b = b0; b < b1; ++b)
      for_each_group(rows, [&](auto group, int64_t g) {
        block<decltype(group)::value>(x + g * kGroup * K, K, Kp, w + b * block_elems, (b - b0) * kRows, cols, bias,
                                      tile + g * kGroup * cols);
      });
    return;
  }
  const int64_t panel = std::max<int64_t>(1, kPanelBytes / (block_elems * 2));
  const int64_t groups = (rows + kGroup - 1) / kGroup;
  for (int64_t p0 = b0; p0 < b1; p0 += panel) {
    const int64_t p1 = std::min(b1, p0 + panel);
    const char* next = reinterpret_cast<const char*>(w + p1 * block_elems);
    const int64_t next_bytes = (std::min(num_blocks, p1 + panel) - p1) * block_elems * 2;
    const int64_t slice = (next_bytes / groups + 63) / 64 * 64;
    for_each_group(rows, [&](auto group, int64_t g) {
      for (int64_t i = g * slice; i < std::min(next_bytes, (g + 1) * slice); i += 64) _mm_prefetch(next + i, _MM_HINT_T1);
      const int64_t m = g * kGroup;
      for (int64_t b = p0; b < p1; ++b)
        block<decltype(group)::value, false>(x + m * K, K, Kp, w + b * block_elems, (b - b0) * kRows, cols, bias,
                                             tile + m * cols);
    });
  }
}

void run_dp(const c10::BFloat16* x, int64_t M, int64_t K, int64_t Kp, const c10::BFloat16* w, int64_t num_blocks,
            int64_t N, const c10::BFloat16* bias, c10::BFloat16* y) {
  run_tiled(M, num_blocks, N, bias, y, [&] {
    return [&](int64_t m0, int64_t rows, int64_t b0, int64_t b1, int64_t cols, const c10::BFloat16* tile_bias,
               c10::BFloat16* tile) { dp_tile(x + m0 * K, rows, K, Kp, w, num_blocks, b0, b1, cols, tile_bias, tile); };
  });
}

// ---- Larger steps: float32 FMAs on the same packed bf16 weights -------------------------------
//
// Where VDPBF16PS is slow, a step of many rows is bound by the multiply-adds, and float32 FMAs
// do them faster: on this project's Intel host (Xeon, family 6 model 207) one core issued 0.5
// VDPBF16PS a cycle (16 multiply-adds) against 2 float32 FMAs (32; scratch loop), and
// oneDNN's bf16 matmul reached 148 GFLOPS on 2 cores against its float32 matmul's 272. A bf16
// value is the top half of a float32, so a 32-bit lane holding two of them (k even, k odd)
// gives both as float32 with one shift and one mask: each 32-column chunk becomes an "even"
// and an "odd" vector of 16 floats. x is converted once per call the same way, so lane i of
// both operands pairs the same k.
//
// Each lane adds its odd column's product, then its even one's, each in one FMA: the order in
// which VDPBF16PS adds them (Intel's SDM: two FMAs, odd first), and the products of two bf16
// values are exact. With the same accumulators, chunk order and epilogue, the two matmuls give
// bitwise the same outputs (measured on the AMD host; VDPBF16PS also flushes denormal inputs and
// outputs, which FMAs do not), so --cpu-bf16-matmul kernels hands steps from one to the other at
// 8 tokens without a row's output depending on the step's size. Even columns first, 59 of 3.1M
// outputs of a 64-row lm_head product differed by one bf16 step.
//
// Each block (4 output rows) is converted once into a float32 buffer that stays in L1, then x
// passes over it 4 rows at a time with 4 x 4 float32 accumulators, so the conversion is shared
// by every row of x. x goes in chunks of kRowChunk rows so its float32 copy stays in L2.

// 32 bf16 values -> their float32 values at the even and at the odd columns.
inline void split_bf16(__m512i v, __m512& even, __m512& odd) {
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// x [M, K] bf16 -> xf [M, Kp/32, 2, 16] float32 (even, odd columns of each chunk; padding 0).
void split_rows(const c10::BFloat16* x, int64_t M, int64_t K, int64_t Kp, float* xf) {
  const int64_t full = K / kCols * kCols;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t k = 0; k < Kp; k += kCols) {
        // Kp - K < 32: only the last chunk is partial, and it holds at least one column.
        const __mmask32 columns = k < full ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
        __m512 even, odd;
        split_bf16(_mm512_maskz_loadu_epi16(columns, x + m * K + k), even, odd);
        _mm512_storeu_ps(xf + m * Kp + k, even);
        _mm512_storeu_ps(xf + m * Kp + k + 16, odd);
      }
    }
  });
}

// One block's 4 rows x Kp columns (packed [Kp/32, 4, 32] bf16) -> wf [Kp/32, 4, 2, 16] float32.
inline void split_block(const c10::BFloat16* wb, int64_t Kp, float* wf) {
  const char* stream = reinterpret_cast<const char*>(wb);
  for (int64_t i = 0; i < Kp * kRows; i += kCols) {
    _mm_prefetch(stream + i * 2 + kPrefetch, _MM_HINT_T0);
    __m512 even, odd;
    split_bf16(_mm512_loadu_si512(wb + i), even, odd);
    _mm512_storeu_ps(wf + i, even);
    _mm512_storeu_ps(wf + i + 16, odd);
  }
}

// Output rows n0 .. n0+3 for M <= 4 rows of split x (row stride Kp) against a split block. Not
// inlined: inlined into run_fma's loops, GCC 12 kept one accumulator on the stack and reloaded x
// for every FMA (FMA products 0.75-0.8x).
template <int M>
__attribute__((noinline)) void fma_block(const float* xf, int64_t Kp, const float* wf, int64_t n0, int64_t N, const c10::BFloat16* bias,
               c10::BFloat16* y) {
  __m512 acc[kRows][M];
  for (int r = 0; r < kRows; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += kCols) {
    const float* wk = wf + k * kRows;  // [4 rows][even, odd][16]
    for (int half = 1; half >= 0; --half) {  // odd columns first, as VDPBF16PS adds them (above)
      __m512 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(xf + m * Kp + k + half * 16);
      for (int r = 0; r < kRows; ++r) {
        const __m512 wv = _mm512_loadu_ps(wk + r * kCols + half * 16);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(xv[m], wv, acc[r][m]);
      }
    }
  }
  store_block<M>(acc, n0, N, bias, y);
}

void fma_rows(const float* xf, int64_t rows, int64_t Kp, const float* wf, int64_t n0, int64_t N,
              const c10::BFloat16* bias, c10::BFloat16* y) {
  for_each_group(rows, [&](auto group, int64_t g) {
    fma_block<decltype(group)::value>(xf + g * kGroup * Kp, Kp, wf, n0, N, bias, y + g * kGroup * N);
  });
}

void run_fma(const float* xf, int64_t M, int64_t Kp, const c10::BFloat16* w, int64_t num_blocks, int64_t N,
             const c10::BFloat16* bias, c10::BFloat16* y) {
  run_tiled(M, num_blocks, N, bias, y, [&] {
    return [&, wf = std::vector<float>(static_cast<size_t>(kRows * Kp))](
               int64_t m0, int64_t rows, int64_t b0, int64_t b1, int64_t cols, const c10::BFloat16* tile_bias,
               c10::BFloat16* tile) mutable {
      // Each block is converted again for each chunk of kRowChunk rows: once for steps of up to 128.
      for (int64_t b = b0; b < b1; ++b) {
        split_block(w + b * kRows * Kp, Kp, wf.data());
        fma_rows(xf + m0 * Kp, rows, Kp, wf.data(), (b - b0) * kRows, cols, tile_bias, tile);
      }
    };
  });
}

#endif

// The checks both entry points share; returns Kp.
int64_t check_args(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, int64_t in_features,
                   const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(vectorized(), "built without AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kRows &&
                  packed.size(3) == kCols && packed.is_contiguous(),
              "packed must be contiguous bfloat16 [ceil(N/4), Kp/32, 4, 32]");
  const int64_t K = x.size(1), num_blocks = packed.size(0), Kp = packed.size(1) * kCols;
  TORCH_CHECK(K == in_features, "x has ", K, " columns, the weight ", in_features);
  TORCH_CHECK(Kp >= K && Kp - K < kCols, "in_features is ", K, ", the packed weight has ", Kp, " columns");
  TORCH_CHECK(N >= 0 && num_blocks == (N + kRows - 1) / kRows, "out_features is ", N, ", the packed weight has ",
              num_blocks * kRows, " rows");
  if (bias.has_value())
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 &&
                    bias->size(0) == N && bias->is_contiguous(),
                "bias must be contiguous bfloat16 [out_features]");
  return Kp;
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t in_features,
                          c10::optional<torch::Tensor> bias) {
  const int64_t Kp = check_args(x, packed, out_features, in_features, bias);
  const int64_t M = x.size(0), K = x.size(1), N = out_features, num_blocks = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xc = x.contiguous();
#ifdef TOKENWIRE_BF16_LINEAR
  run_dp(xc.data_ptr<c10::BFloat16>(), M, K, Kp, packed.data_ptr<c10::BFloat16>(), num_blocks, N,
         bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>());
#endif
  return y;
}

torch::Tensor bf16_linear_fma(torch::Tensor x, torch::Tensor packed, int64_t out_features, int64_t in_features,
                              c10::optional<torch::Tensor> bias) {
  const int64_t Kp = check_args(x, packed, out_features, in_features, bias);
  const int64_t M = x.size(0), K = x.size(1), N = out_features, num_blocks = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto xc = x.contiguous();
#ifdef TOKENWIRE_BF16_LINEAR
  auto xf = torch::empty({M, Kp}, x.options().dtype(at::kFloat));
  split_rows(xc.data_ptr<c10::BFloat16>(), M, K, Kp, xf.data_ptr<float>());
  run_fma(xf.data_ptr<float>(), M, Kp, packed.data_ptr<c10::BFloat16>(), num_blocks, N,
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
        "y [M, N] bf16 = x [M, K] bf16 @ w^T (+ bias), w packed as [ceil(N/4), Kp/32, 4, 32] bf16, in VDPBF16PS",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("in_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("bf16_linear_fma", &bf16_linear_fma,
        "the same product for any M, in float32 FMAs (for CPUs where VDPBF16PS is slower than FMAs)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("in_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
}
