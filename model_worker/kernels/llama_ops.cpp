// The Llama forward's small per-layer ops on bf16 CPU rows, each one call instead of several torch
// ops. A decode step of one or a few tokens spends much of its time outside the matmuls in per-op
// overhead, so these matter there; llama.py uses them on bf16 CPUs (kernels/__init__.py builds
// them), the torch ops elsewhere.
//
// RMSNorm, alone or fused with the residual add before it. torch's float32 RMSNorm on a bf16 row
// is ~8 dispatched ops (upcast, the fused norm's pieces, downcast, the weight's multiply), 12 us at
// SmolLM2's 576 columns, twice per layer, plus the residual add. Same roundings as llama.py:
//   x_sum = bf16(x + delta)                                (the residual add, when fused)
//   h     = bf16(weight * bf16(x_sum * rsqrt(mean(x_sum^2) + eps)))   (float32 inside)
// Only the float32 sum of squares is taken in a different order than torch's, so h may differ
// from the torch path by one bf16 rounding step on rare elements.
//
// Rotary embedding of q and k plus the KV cache write (rope_and_cache): ~10 torch ops a layer
// (the rotation's multiplies, negation, concatenation and sum, two index_copy_ calls). Same
// roundings as llama.py's `qk * cos + rotate_half(qk) * sin` in bf16: each product rounded, then
// the sum; so the outputs are bitwise the torch path's.
//
// The MLP's activation (silu_and_mul): gate_up [T, 2I] -> bf16(bf16(silu(gate)) * up), the chunk,
// silu and multiply of llama.py's `F.silu(gate) * up` in one pass (~4 ops, 13-20 us a layer at one
// token). silu in float32 as torch computes it, x / (1 + exp(-x)), with an exp within a float32
// ulp or two of torch's (Sleef's), so an element may differ by one bf16 step on rare elements.
//
// vectorized() is false where the compiler was not given AVX512-BF16 (the model then keeps the
// torch ops).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TOKENWIRE_LLAMA_OPS 1
#include <immintrin.h>

#include "vec_math.h"
#endif

namespace {

bool vectorized() {
#ifdef TOKENWIRE_LLAMA_OPS
  return true;
#else
  return false;
#endif
}

#ifdef TOKENWIRE_LLAMA_OPS
// bf16 bits (16 lanes) -> float32: the bf16 bits are a float32's top half.
inline __m512 from_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load_bf16(const c10::BFloat16* p) {
  return from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Masked-off lanes read as 0.0.
inline __m512 load_bf16_masked(const c10::BFloat16* p, __mmask16 mask) {
  return from_bf16(_mm256_maskz_loadu_epi16(mask, p));
}

// float32 -> bf16 as torch's casts do (c10::BFloat16): round to nearest even on the bits, NaN to
// 0x7FC0. In integer instructions because VCVTNEPS2BF16 flushes subnormals to zero, which torch
// does not.
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// a * b rounded to bf16, as a torch multiply of bf16 tensors leaves it (back in float32).
inline __m512 bf16_product(__m512 a, __m512 b) { return from_bf16(to_bf16(_mm512_mul_ps(a, b))); }

// -v with the sign bit flipped, as torch's neg (0.0 becomes -0.0, which 0 - v would not give).
inline __m512 negated(__m512 v) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}

// One row: writes x_sum (when delta is given) and h.
void norm_row(const c10::BFloat16* x, const c10::BFloat16* delta, c10::BFloat16* x_sum, const c10::BFloat16* weight,
              c10::BFloat16* h, int64_t H, float eps) {
  // Pass 1: the residual sum (rounded to bf16, as the torch add would leave it) and its squares.
  __m512 squares = _mm512_setzero_ps();
  for (int64_t k = 0; k < H; k += 16) {
    const __mmask16 mask = tokenwire::lanes(H - k);
    __m512 v = load_bf16_masked(x + k, mask);
    if (delta != nullptr) {
      const __m256i rounded = to_bf16(_mm512_add_ps(v, load_bf16_masked(delta + k, mask)));
      _mm256_mask_storeu_epi16(x_sum + k, mask, rounded);
      v = from_bf16(rounded);
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const c10::BFloat16* source = delta != nullptr ? x_sum : x;
  const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(H) + eps));
  // Pass 2: normalise, round to bf16, multiply by the weight, round again.
  for (int64_t k = 0; k < H; k += 16) {
    const __mmask16 mask = tokenwire::lanes(H - k);
    const __m512 normed = bf16_product(load_bf16_masked(source + k, mask), rstd);
    _mm256_mask_storeu_epi16(h + k, mask, to_bf16(_mm512_mul_ps(normed, load_bf16_masked(weight + k, mask))));
  }
}

// One head of D values: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) =
// (-x[D/2:], x[:D/2]); 16 columns of each half at a time (D a multiple of 32).
inline void rotate_head(const c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin,
                        c10::BFloat16* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; j += 16) {
    const __m512 a = load_bf16(x + j), b = load_bf16(x + half + j);
    const __m512 first = _mm512_add_ps(bf16_product(a, load_bf16(cos + j)),
                                       bf16_product(negated(b), load_bf16(sin + j)));
    const __m512 second = _mm512_add_ps(bf16_product(b, load_bf16(cos + half + j)),
                                        bf16_product(a, load_bf16(sin + half + j)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), to_bf16(first));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + half + j), to_bf16(second));
  }
}

// One row: out[j] = bf16(bf16(silu(gate[j])) * up[j]) for j < I.
void silu_and_mul_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t k = 0; k < I; k += 16) {
    const __mmask16 mask = tokenwire::lanes(I - k);
    const __m512 g = load_bf16_masked(gate + k, mask);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, tokenwire::exp_ps(negated(g))));
    const __m512 silu_rounded = from_bf16(to_bf16(silu));  // F.silu's bf16 output
    _mm256_mask_storeu_epi16(out + k, mask, to_bf16(_mm512_mul_ps(silu_rounded, load_bf16_masked(up + k, mask))));
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

void norm_rows(const torch::Tensor& x, const c10::BFloat16* delta, c10::BFloat16* x_sum, const torch::Tensor& weight,
               const torch::Tensor& h, double eps) {
#ifdef TOKENWIRE_LLAMA_OPS
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
  norm_rows(x, nullptr, nullptr, weight, h, eps);
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
  norm_rows(x, delta.data_ptr<c10::BFloat16>(), x_sum.data_ptr<c10::BFloat16>(), weight, h, eps);
  return {x_sum, h};
}


// qkv [T, (H + 2 Hkv) * D] -> q and k rotated, [T, H + Hkv, D]; k (rotated) and v (as is) written
// to the cache slots slot_mapping [T] of key_cache / value_cache [num_blocks, block_size, Hkv, D].
torch::Tensor rope_and_cache(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                             const torch::Tensor& sin, const torch::Tensor& key_cache,
                             const torch::Tensor& value_cache, const torch::Tensor& slot_mapping, int64_t num_heads,
                             int64_t num_kv_heads) {
  TORCH_CHECK(vectorized(), "built without AVX512-BF16");
  for (const auto* t : {&qkv, &cos, &sin, &key_cache, &value_cache})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->is_contiguous(),
                "qkv, cos, sin and the caches must be contiguous bfloat16 CPU tensors");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() && positions.device().is_cpu() &&
                  slot_mapping.device().is_cpu(),
              "positions and slot_mapping must be contiguous int64 CPU tensors");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.size(2) == num_kv_heads,
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim]");
  const int64_t D = key_cache.size(3), T = qkv.size(0), heads = num_heads + num_kv_heads;
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1), max_positions = cos.size(0);
  TORCH_CHECK(D % 32 == 0, "head_dim must be a multiple of 32, got ", D);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + num_kv_heads) * D, "qkv must be [T, (H + 2 Hkv) * D]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(), "cos and sin must be [positions, D]");
  TORCH_CHECK(positions.numel() == T && slot_mapping.numel() == T, "one position and one slot per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "position ", pos[t], " outside the rotary table's ",
                max_positions);
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the cache's ", num_slots);
  }
  auto qk = torch::empty({T, heads, D}, qkv.options());
#ifdef TOKENWIRE_LLAMA_OPS
  const c10::BFloat16* in = qkv.data_ptr<c10::BFloat16>();
  const c10::BFloat16* cp = cos.data_ptr<c10::BFloat16>();
  const c10::BFloat16* sp = sin.data_ptr<c10::BFloat16>();
  c10::BFloat16* out = qk.data_ptr<c10::BFloat16>();
  c10::BFloat16* keys = key_cache.data_ptr<c10::BFloat16>();
  c10::BFloat16* values = value_cache.data_ptr<c10::BFloat16>();
  const int64_t kv_row = num_kv_heads * D;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const c10::BFloat16* row = in + t * (heads + num_kv_heads) * D;
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(row + h * D, cp + pos[t] * D, sp + pos[t] * D, out + (t * heads + h) * D, D);
      std::copy(out + (t * heads + num_heads) * D, out + (t + 1) * heads * D, keys + slots[t] * kv_row);
      std::copy(row + heads * D, row + (heads + num_kv_heads) * D, values + slots[t] * kv_row);
    }
  });
#endif
  return qk;
}

// gate_up [T, 2I] (gate then up, as llama.py's fused gate_up projection leaves them) -> [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(vectorized(), "built without AVX512-BF16");
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() &&
                  gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous bfloat16 CPU tensor [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
#ifdef TOKENWIRE_LLAMA_OPS
  const c10::BFloat16* in = gate_up.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) silu_and_mul_row(in + t * 2 * I, in + t * 2 * I + I, op + t * I, I);
  });
#endif
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized, "whether this build has the AVX512-BF16 kernel");
  m.def("rms_norm", &rms_norm, "bf16(weight * bf16(rms_norm_f32(x))) for x [T, H] bf16", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta)) for bf16 [T, H]", pybind11::arg("x"),
        pybind11::arg("delta"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("rope_and_cache", &rope_and_cache,
        "q and k rotated [T, H + Hkv, D] from qkv [T, (H + 2 Hkv) D]; k and v written to the cache slots",
        pybind11::arg("qkv"), pybind11::arg("positions"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("key_cache"), pybind11::arg("value_cache"), pybind11::arg("slot_mapping"),
        pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"));
  m.def("silu_and_mul", &silu_and_mul, "bf16(bf16(silu(gate)) * up) [T, I] from gate_up [T, 2I] bf16",
        pybind11::arg("gate_up"));
}
