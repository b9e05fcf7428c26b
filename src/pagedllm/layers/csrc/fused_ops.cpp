// Fused ops of the decoder layers for CPU. Residual add + RMSNorm (plain or offset), RMSNorm
// alone, the rotary embedding of q and k, and SiLU-and-mul / GELU(tanh)-and-mul: each one
// pass and one parallel region in place of the five to fifteen small ATen ops (each its own
// pass over memory and its own thread-pool round trip) of the torch path. The arithmetic
// follows the torch path step by step, rounding to the tensor dtype where it does (built with
// -ffp-contract=off, so no FMA changes a rounding); only the order of the RMS sum differs from
// ATen's reduction. Then a GEMV for one-row float products, and decoder_layers: every layer of
// a step in one call (see there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "balanced_for.h"
#include "bf16_round.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

// AVX-512 forms of some bf16 loops where the build targets it (-march=native on such a CPU).
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BF16_VECTORS 1
#else
#define BF16_VECTORS 0
#endif
#if defined(__F16C__)  // an fp16 KV cache's conversions (convert8)
#include <immintrin.h>
#endif
// AVX2 forms of some fp32 loops where the build targets it (8 lanes).
#if defined(__AVX2__)
#include <immintrin.h>
#define F32_VECTORS 1
#else
#define F32_VECTORS 0
#endif

namespace {

// Rows per parallel chunk: about 32K elements, so a decode step's few rows run on the
// calling thread without a thread-pool round trip.
int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems));
}

#if F32_VECTORS
// The sum of a vector's 8 lanes: halves, then pairs, then the last two.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if F32_VECTORS && !BF16_VECTORS
// 8 bf16 values widened to fp32, and fp32 rounded to bf16 as c10::BFloat16 rounds (nearest
// even, NaN -> 0x7FC0): bf16x16_load / bf16x16_round on 8 lanes, the same bits.
inline __m256 bf16x8_load(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 bf16x8_rounded(__m256 v) {  // v rounded to bf16, as fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(pagedllm_cpu::bf16_round_bits8(v), 16));
}

inline void bf16x8_store(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pagedllm_cpu::bf16_round8(v));
}

#endif

#if BF16_VECTORS
// 16 bf16 values widened to fp32, and fp32 rounded to bf16 as c10::BFloat16 rounds (nearest
// even, NaN -> 0x7FC0): the vector form of the scalar loops' conversions, the same bits.
inline __m512 bf16x16_widen(__m256i h) {  // each bf16 the high half of its fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 bf16x16_load(const c10::BFloat16* p) {
  return bf16x16_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m256i bf16x16_round(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  // one vcvtneps2bf16 (nearest even), its NaNs (sign and payload kept) made 0x7FC0; it reads
  // denormals as zero, so a vector holding one (fpclass 0x20) takes the integer steps
  if (!_mm512_fpclass_ps_mask(v, 0x20))
    return _mm256_mask_mov_epi16(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)),
                                 _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                 _mm256_set1_epi16(0x7fc0));
#endif
  return pagedllm_cpu::bf16_round16(v);  // the integer steps (bf16_round.h)
}

inline __m512 bf16x16_rounded(__m512 v) { return bf16x16_widen(bf16x16_round(v)); }  // as fp32

#endif

// bf16 rows a vector at a time: 16 features on AVX-512, 8 on AVX2 (the norms, the residual
// add and rotary; the scalar conversions cost SmolLM2's bf16 decode 4.7 us a layer on a Zen 3
// and AVX-512 builds ran the norms' scalar loops until they had 16 lanes).
#if BF16_VECTORS
struct Bf16Lanes {
  static constexpr int kWidth = 16;
  static __m512 splat(float v) { return _mm512_set1_ps(v); }
  static __m512 load(const c10::BFloat16* p) { return bf16x16_load(p); }
  static __m512 rounded(__m512 v) { return bf16x16_rounded(v); }
  static void store(c10::BFloat16* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16_round(v));
  }
};
#elif F32_VECTORS
struct Bf16Lanes {
  static constexpr int kWidth = 8;
  static __m256 splat(float v) { return _mm256_set1_ps(v); }
  static __m256 load(const c10::BFloat16* p) { return bf16x8_load(p); }
  static __m256 rounded(__m256 v) { return bf16x8_rounded(v); }
  static void store(c10::BFloat16* p, __m256 v) { bf16x8_store(p, v); }
};
#endif
#define BF16_LANES (BF16_VECTORS || F32_VECTORS)

// Calls fn with a value of the element type of dtype (float or BFloat16, the two these ops
// take); another dtype is an error naming op.
template <typename F>
void with_float_type(at::ScalarType dtype, const char* op, F&& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else if (dtype == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16");
  }
}

// One row's scaled output from the row r (float sums of its squares in `sum`): Llama's
// weight * T(r * inv), or with offset (Gemma) T(r * inv * (1 + weight)) all in float.
template <typename T>
inline void scale_row(const T* r, T* out, const T* wp, int64_t dim, float sum, double eps,
                      bool offset) {
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
  int64_t i = 0;
#if BF16_LANES
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the loops below, a vector at a time
    using L = Bf16Lanes;
    const auto scale = L::splat(inv), one = L::splat(1.f);
    for (; i + L::kWidth <= dim; i += L::kWidth) {
      const auto normed = L::load(r + i) * scale;
      const auto w = L::load(wp + i);
      L::store(out + i, offset ? normed * (one + w) : w * L::rounded(normed));
    }
  }
#endif
  if (offset) {
    for (; i < dim; ++i) {
      const float normed = static_cast<float>(r[i]) * inv;
      out[i] = static_cast<T>(normed * (1.f + static_cast<float>(wp[i])));
    }
    return;
  }
  for (; i < dim; ++i) {
    T normed = static_cast<T>(static_cast<float>(r[i]) * inv);
    out[i] = static_cast<T>(static_cast<float>(wp[i]) * static_cast<float>(normed));
  }
}

template <typename T>
float sum_of_squares(const T* r, int64_t dim) {
  float lanes[16] = {0.f};  // 16 partial sums: a reduction the compiler vectorizes
  int64_t i = 0;
#if BF16_LANES
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the same sums, a vector at a time
    using L = Bf16Lanes;
    constexpr int kParts = 16 / L::kWidth;
    decltype(L::splat(0.f)) sums[kParts];
    for (auto& v : sums) v = L::splat(0.f);
    for (; i + 16 <= dim; i += 16)
      for (int v = 0; v < kParts; ++v) {
        const auto a = L::load(r + i + v * L::kWidth);
        sums[v] = sums[v] + a * a;
      }
    std::memcpy(lanes, sums, sizeof(lanes));
  }
#endif
  for (; i + 16 <= dim; i += 16) {
    for (int j = 0; j < 16; ++j) {
      const float f = static_cast<float>(r[i + j]);
      lanes[j] += f * f;
    }
  }
  for (; i < dim; ++i) {
    const float f = static_cast<float>(r[i]);
    lanes[0] += f * f;
  }
  float sum = 0.f;
  for (int j = 0; j < 16; ++j) sum += lanes[j];
  return sum;
}

// rr = T(x + rr) in place: the residual stream's add, rounded as the torch path rounds it.
template <typename T>
inline void add_into(const T* xr, T* rr, int64_t dim) {
  int64_t i = 0;
#if BF16_LANES
  if constexpr (std::is_same_v<T, c10::BFloat16>)  // the same bits, a vector at a time
    for (; i + Bf16Lanes::kWidth <= dim; i += Bf16Lanes::kWidth)
      Bf16Lanes::store(rr + i, Bf16Lanes::load(xr + i) + Bf16Lanes::load(rr + i));
#endif
  for (; i < dim; ++i)
    rr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
}

// residual += x, then x = the norm of the new residual: the add and the sums of squares in two
// passes over a row that stays in L1, so the sums are sum_of_squares' own.
template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                       double eps, bool offset) {
  const int64_t rows = x.size(0), dim = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * xs;
      T* rr = rp + r * rs;
      add_into(xr, rr, dim);
      scale_row(rr, xr, wp, dim, sum_of_squares(rr, dim), eps, offset);
    }
  });
}

// out = norm(x) row by row, x [R, D] with contiguous rows (any row stride), out contiguous.
template <typename T>
void rms_norm_impl(const at::Tensor& x, at::Tensor& out, const at::Tensor& weight, double eps,
                   bool offset) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain_rows(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      scale_row(xr, op + r * dim, wp, dim, sum_of_squares(xr, dim), eps, offset);
    }
  });
}

// residual += x; x = rms_norm(residual) scaled by weight (offset: by 1 + weight). x [T, D]
// and residual [T, D], row-major.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight,
                        double eps, bool offset) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual: [T, D]");
  TORCH_CHECK(x.stride(1) == 1 && residual.stride(1) == 1 && weight.is_contiguous(),
              "rows must be contiguous");
  with_float_type(x.scalar_type(), "fused_add_rms_norm", [&](auto t) {
    add_rms_norm_impl<decltype(t)>(x, residual, weight, eps, offset);
  });
}

// rms_norm(x) scaled by weight (offset: by 1 + weight) into a new [R, D] tensor; x [R, D]
// with contiguous rows. Norms without a residual: after attention or the MLP (Gemma), and
// per head on q and k (Qwen3, Gemma 3) through a [T * H, D] view.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "rms_norm: x [R, D] with contiguous rows, weight [D]");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  with_float_type(x.scalar_type(), "rms_norm", [&](auto t) {
    rms_norm_impl<decltype(t)>(x, out, weight, eps, offset);
  });
  return out;
}

#if BF16_LANES
// rotate_rows for bf16, L::kWidth features at a time, each product rounded as the scalar loop
// rounds it (the scalar conversions cost a 48-row decode step of SmolLM2 2.6% of its time).
template <typename L>
void rotate_rows_bf16(const c10::BFloat16* in, c10::BFloat16* out, const c10::BFloat16* cos,
                      const c10::BFloat16* sin, int64_t heads, int64_t in_hs, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const c10::BFloat16* x = in + h * in_hs;
    c10::BFloat16* y = out + h * dim;
    for (int64_t i = 0; i < half; i += L::kWidth) {
      const auto x1 = L::load(x + i), x2 = L::load(x + i + half);
      const auto a = L::rounded(x1 * L::load(cos + i)), b = L::rounded(-x2 * L::load(sin + i));
      const auto c = L::rounded(x2 * L::load(cos + i + half));
      const auto d = L::rounded(x1 * L::load(sin + i + half));
      L::store(y + i, a + b);
      L::store(y + i + half, c + d);
    }
  }
}
#endif

template <typename T>
void rotate_rows(const T* in, T* out, const T* cos, const T* sin, int64_t heads, int64_t in_hs,
                 int64_t dim) {
  const int64_t half = dim / 2;
#if BF16_LANES
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (half % Bf16Lanes::kWidth == 0)
      return rotate_rows_bf16<Bf16Lanes>(in, out, cos, sin, heads, in_hs, dim);
  }
#endif
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = in + h * in_hs;
    T* y = out + h * dim;
    for (int64_t i = 0; i < half; ++i) {
      // x * cos + rotate_half(x) * sin, each product rounded to T as in the torch path
      T a = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
      T b = static_cast<T>(-static_cast<float>(x[i + half]) * static_cast<float>(sin[i]));
      y[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
      T c = static_cast<T>(static_cast<float>(x[i + half]) * static_cast<float>(cos[i + half]));
      T d = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(sin[i + half]));
      y[i + half] = static_cast<T>(static_cast<float>(c) + static_cast<float>(d));
    }
  }
}

template <typename T>
void rotary_impl(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                 at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& cos,
                 const at::Tensor& sin) {
  const int64_t tokens = q.size(0), hq = q.size(1), hk = k.size(1), dim = q.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  T *qo = q_out.data_ptr<T>(), *ko = k_out.data_ptr<T>();
  const int64_t max_pos = cos.size(0);
  at::parallel_for(0, tokens, grain_rows((hq + hk) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = pos[t];
      TORCH_CHECK(p >= 0 && p < max_pos, "position out of the rotary table");
      const T* c = cp + p * dim;
      const T* s = sp + p * dim;
      rotate_rows(qp + t * q.stride(0), qo + t * hq * dim, c, s, hq, q.stride(1), dim);
      rotate_rows(kp + t * k.stride(0), ko + t * hk * dim, c, s, hk, k.stride(1), dim);
    }
  });
}

// rotary_neox into q_out / k_out (contiguous, of q's and k's shapes).
void rotary_into(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q_out,
                 at::Tensor& k_out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(2) == k.size(2), "q, k: [T, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "head rows must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == q.size(2),
              "cos / sin: [P, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions");
  with_float_type(q.scalar_type(), "rotary_neox", [&](auto t) {
    rotary_impl<decltype(t)>(positions, q, k, q_out, k_out, cos, sin);
  });
}

// Neox-layout rotary embedding of q [T, Hq, D] and k [T, Hk, D] (rows may be strided views
// of a fused qkv projection) into new contiguous tensors, with cos / sin tables [P, D].
std::tuple<at::Tensor, at::Tensor> rotary_neox(const at::Tensor& positions, const at::Tensor& q,
                                               const at::Tensor& k, const at::Tensor& cos,
                                               const at::Tensor& sin) {
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  rotary_into(positions, q, k, cos, sin, q_out, k_out);
  return {q_out, k_out};
}

// exp(x) for float: range reduction x = n ln2 + r, a degree-6 polynomial for exp(r), 2^n
// through the exponent bits. Branch- and call-free, so the loop below vectorizes; about
// 2 ulp from std::exp over the range silu needs (inputs are clamped to [-87, 88]).
inline float fast_exp(float x) {
  x = std::min(88.f, std::max(-87.f, x));
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if BF16_VECTORS
// fast_exp on 16 lanes: the same operations in the same order (no FMA), so the same bits.
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// silu(gate) * up for 16 bf16 features from i on, rounded where the scalar loop rounds.
inline void silu_mul16_bf16(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* y) {
  const __m512 g = bf16x16_load(gate);
  const __m512 e = fast_exp16(  // -g, as a sign flip
      _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN))));
  const __m512 act = bf16x16_rounded(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                      bf16x16_round(_mm512_mul_ps(act, bf16x16_load(up))));
}
#endif

#if F32_VECTORS
// fast_exp on 8 lanes: the same operations in the same order (no FMA), so the same bits.
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// silu(gate) * up for 8 fp32 features from i on (a decode row's 1,536 in about a seventh of
// the scalar loop's time on a Zen 3).
inline void silu_mul8_f32(const float* gate, const float* up, float* y) {
  const __m256 g = _mm256_loadu_ps(gate);
  const __m256 e = fast_exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.f)));  // -g, as a sign flip
  const __m256 act = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  _mm256_storeu_ps(y, _mm256_mul_ps(act, _mm256_loadu_ps(up)));
}

#if !BF16_VECTORS
// silu(gate) * up for 8 bf16 features, rounded where the scalar loop rounds (the scalar
// conversions made SmolLM2's bf16 decode spend 13 us a layer here on a Zen 3).
inline void silu_mul8_bf16(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* y) {
  const __m256 g = bf16x8_load(gate);
  const __m256 e = fast_exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.f)));  // -g, as a sign flip
  const __m256 act = bf16x8_rounded(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
  bf16x8_store(y, _mm256_mul_ps(act, bf16x8_load(up)));
}
#endif
#endif

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = out.size(0), dim = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * xs;
      const T* up = gate + dim;
      T* y = op + r * dim;
      int64_t i = 0;
#if BF16_VECTORS
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        for (; i + 16 <= dim; i += 16) silu_mul16_bf16(gate + i, up + i, y + i);
#endif
#if F32_VECTORS
      if constexpr (std::is_same_v<T, float>)
        for (; i + 8 <= dim; i += 8) silu_mul8_f32(gate + i, up + i, y + i);
#if !BF16_VECTORS
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        for (; i + 8 <= dim; i += 8) silu_mul8_bf16(gate + i, up + i, y + i);
#endif
#endif
      for (; i < dim; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T act = static_cast<T>(g / (1.f + fast_exp(-g)));  // rounded as F.silu's output
        y[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

template <typename T>
void gelu_tanh_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = out.size(0), dim = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  at::parallel_for(0, rows, grain_rows(2 * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * xs;
      const T* up = gate + dim;
      T* y = op + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float inner = kBeta * (g + kKappa * g * g * g);
        // rounded as F.gelu(approximate="tanh")'s output, then times up
        const T act = static_cast<T>(0.5f * g * (1.f + std::tanh(inner)));
        y[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

// silu(gate) * up or gelu_tanh(gate) * up of x [T, 2 * d] into out [T, d]; op names the
// caller in a dtype error.
void gated_into(const at::Tensor& x, bool gelu, at::Tensor& out, const char* op) {
  with_float_type(x.scalar_type(), op, [&](auto t) {
    if (gelu)
      gelu_tanh_and_mul_impl<decltype(t)>(x, out);
    else
      silu_and_mul_impl<decltype(t)>(x, out);
  });
}

at::Tensor gated(const at::Tensor& x, bool gelu, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1, "x: [T, 2 * d]");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  gated_into(x, gelu, out, op);
  return out;
}

// silu(gate) * up of a merged [T, 2 * d] projection -> [T, d].
at::Tensor silu_and_mul(const at::Tensor& x) { return gated(x, false, "silu_and_mul"); }

// gelu_tanh(gate) * up of a merged [T, 2 * d] projection -> [T, d] (GeGLU, Gemma).
at::Tensor gelu_tanh_and_mul(const at::Tensor& x) { return gated(x, true, "gelu_tanh_and_mul"); }

// ---- matrix-vector products for a few rows (decode) ----------------------------------------
// y[M, N] = x[M, K] W[N, K]^T (+ bias) for M <= kGemvMaxRows, float32 or bfloat16 with float32
// sums. At one row a linear layer only streams its weight, and does so at a fraction of the
// memory bandwidth through F.linear (about half, benchmarks/gemv.py): here
// each thread walks whole weight rows from start to end. From two rows on this loop is
// compute-bound and slower than the BLAS call, so the layers use it for one row only.
constexpr int64_t kGemvMaxRows = 4;
constexpr int64_t kGemvUseRows = 1;  // rows at which the layers take it
constexpr int kLanes = 16;  // partial sums per row of x: a reduction the compiler vectorizes

// Rows [n0, n1) of y for M rows of x (xf: x in float32, [M][k]).
template <typename T, int M>
void gemv_rows(const float* xf, const T* w, int64_t k, int64_t n0, int64_t n1, const T* bias,
               T* y, int64_t ys) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* row = w + n * k;
    float lanes[M][kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= k; c += kLanes) {
      float wf[kLanes];
      for (int j = 0; j < kLanes; ++j) wf[j] = static_cast<float>(row[c + j]);
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < kLanes; ++j) lanes[m][j] += xf[m * k + c + j] * wf[j];
    }
    for (; c < k; ++c) {
      const float wf = static_cast<float>(row[c]);
      for (int m = 0; m < M; ++m) lanes[m][0] += xf[m * k + c] * wf;
    }
    for (int m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int j = 0; j < kLanes; ++j) sum += lanes[m][j];
      if (bias != nullptr) sum += static_cast<float>(bias[n]);
      y[m * ys + n] = static_cast<T>(sum);
    }
  }
}

#if F32_VECTORS && !BF16_VECTORS
// M rows of x (up to 4) against weight rows [n0, n1) of fp32 or bf16 with AVX2, a weight row at
// a time (the rows are contiguous, so each thread reads one stream; four weight rows at once
// read slower from memory). A bf16 is the high half of its fp32, so 16 of them widen in two
// unpacks with zeros; the unpacks take features 0-3 and 8-11 into one vector and 4-7 and 12-15
// into the other, and xs holds each row of x in that order (x_order). One row of x keeps two
// sets of sums (alternate 16s) so that four FMA chains hide the latency, and a row's sums meet
// in a tree (gemv_rows, the compiler's loop of the other builds, adds its 16 one by one).
//
// bf16 weights are prefetched 1 KB ahead, a cache line at a time: the hardware prefetcher
// alone left the loads waiting. fp32 ones read twice the bytes per FMA and are not (1 KB ahead
// was slower than none, 256-512 B level with none). SmolLM2's one-row products in a decode
// step's order on the two cores of a Zen 3, this kernel / the one before (gemv_rows for fp32;
// for bf16 this one without the prefetch and with x widened through two tensors a call),
// alternating in one process (benchmarks/gemv.py --against), five runs: bf16 1.10-1.18x (to
// 28.5-32 GB/s), fp32 1.01-1.07x (30-34 GB/s); SmolLM2's bf16 decode 1.03-1.22x (batch1.py).
template <typename T>
constexpr int64_t kGemvAheadBytes = sizeof(T) == 2 ? 1024 : 0;

inline void widen16(const c10::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}

inline void widen16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

template <typename T, int M>
void gemv_avx2_rows(const float* xs, const T* w, int64_t k, int64_t n0, int64_t n1,
                    const T* bias, T* y, int64_t ys) {
  constexpr int S = M == 1 ? 2 : 1;
  constexpr int64_t kLine = 64 / sizeof(T);  // weights a cache line
  const int64_t whole = k / 16 * 16;
  constexpr int64_t ahead = kGemvAheadBytes<T>;
  for (int64_t n = n0; n < n1; ++n) {
    const T* row = w + n * k;
    __m256 acc[S][M][2];
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < M; ++m) acc[s][m][0] = acc[s][m][1] = _mm256_setzero_ps();
    auto step = [&](int64_t c, __m256(&a)[M][2]) __attribute__((always_inline)) {
      if (ahead > 0 && c % kLine == 0)
        _mm_prefetch(reinterpret_cast<const char*>(row + c) + ahead, _MM_HINT_T0);
      __m256 lo, hi;
      widen16(row + c, lo, hi);
      for (int m = 0; m < M; ++m) {
        a[m][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xs + m * k + c), a[m][0]);
        a[m][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs + m * k + c + 8), a[m][1]);
      }
    };
    int64_t c = 0;
    for (; c + 16 * S <= whole; c += 16 * S)
      for (int s = 0; s < S; ++s) step(c + 16 * s, acc[s]);
    if (c < whole) step(c, acc[0]), c += 16;
    for (int m = 0; m < M; ++m) {
      __m256 v = _mm256_add_ps(acc[0][m][0], acc[0][m][1]);
      if constexpr (S == 2) v = _mm256_add_ps(v, _mm256_add_ps(acc[1][m][0], acc[1][m][1]));
      float sum = hsum8(v);
      for (int64_t r = c; r < k; ++r) sum += xs[m * k + r] * static_cast<float>(row[r]);
      if (bias != nullptr) sum += static_cast<float>(bias[n]);
      y[m * ys + n] = static_cast<T>(sum);
    }
  }
}

// A row x [k] in fp32 as gemv_avx2_rows reads it against weights of x's dtype: for bf16, per
// 16 features, 0-3 8-11 4-7 12-15 (the rest, past the last 16, as it is); for fp32, as it is.
template <typename T>
void x_order(const T* x, int64_t k, float* xs) {
  const int64_t whole = std::is_same_v<T, c10::BFloat16> ? k / 16 * 16 : 0;
  for (int64_t c = 0; c < whole; c += 16)
    for (int i = 0; i < 4; ++i) {
      xs[c + i] = x[c + i], xs[c + 4 + i] = x[c + 8 + i];
      xs[c + 8 + i] = x[c + 4 + i], xs[c + 12 + i] = x[c + 12 + i];
    }
  for (int64_t c = whole; c < k; ++c) xs[c] = x[c];
}
#endif

// Rows [n0, n1) of y = x W^T + b: the AVX2 kernel where the build has it, else the compiler's.
template <typename T, int M>
void gemv_kernel(const float* xs, const T* w, int64_t k, int64_t n0, int64_t n1, const T* bias,
                 T* y, int64_t ys) {
#if F32_VECTORS && !BF16_VECTORS
  gemv_avx2_rows<T, M>(xs, w, k, n0, n1, bias, y, ys);
#else
  gemv_rows<T, M>(xs, w, k, n0, n1, bias, y, ys);
#endif
}

// y = x W^T + b, kGemvMaxRows rows of x a pass over the weight (the layers' bf16 products past
// one row, float_linear, take several passes).
template <typename T>
void gemv_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias, at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
#if F32_VECTORS && !BF16_VECTORS
  // x in fp32 and gemv_avx2_rows' order, in a buffer the calls of this thread reuse (a
  // widening copy and a reordered one as tensors cost more than a small layer's slice of a
  // product); the workers' own thread_local buffers are not this one
  thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < m * k) buffer.resize(m * k);
  const T* xp = x.data_ptr<T>();
  for (int64_t r = 0; r < m; ++r)
    x_order(xp + r * x.stride(0), k, buffer.data() + r * k);
  const float* xs = buffer.data();
#else
  // x in float32, [m][k] contiguous (a copy unless x is float32 and contiguous already)
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xs = xf.data_ptr<float>();
#endif
  const T* wp = w.data_ptr<T>();
  const T* bp = bias != nullptr ? bias->data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  const int64_t ys = y.stride(0);
  // Enough rows per task that a task streams at least ~64 KiB of weight.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, k * sizeof(T)));
  for (int64_t r = 0; r < m; r += kGemvMaxRows) {
    const float* xr = xs + r * k;
    T* yr = yp + r * ys;
    pagedllm_cpu::balanced_for(n, grain, [&](int64_t n0, int64_t n1) {
      switch (std::min(kGemvMaxRows, m - r)) {
        case 1: return gemv_kernel<T, 1>(xr, wp, k, n0, n1, bp, yr, ys);
        case 2: return gemv_kernel<T, 2>(xr, wp, k, n0, n1, bp, yr, ys);
        case 3: return gemv_kernel<T, 3>(xr, wp, k, n0, n1, bp, yr, ys);
        default: return gemv_kernel<T, 4>(xr, wp, k, n0, n1, bp, yr, ys);
      }
    });
  }
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.size(0) <= kGemvMaxRows, "gemv: at most ", kGemvMaxRows, " rows");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous() && x.scalar_type() == w.scalar_type(),
              "gemv: contiguous rows of one dtype");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == w.size(0) &&
                                    bias->scalar_type() == w.scalar_type()),
              "gemv: bias [N] of the weight's dtype");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0) return y;
  const at::Tensor* b = bias.has_value() ? &*bias : nullptr;
  with_float_type(x.scalar_type(), "gemv", [&](auto t) { gemv_impl<decltype(t)>(x, w, b, y); });
  return y;
}

// x W^T + b for a float weight in rows, as the layers compute it past the GEMV's one row: ATen's
// product, except bf16 on a build without AVX-512. There the CPU has no bf16 instructions and
// ATen's bf16 GEMM widens value by value in its inner loop (SmolLM2's 256-token prefill took 7x
// fp32's time), so up to kBf16GemvRows rows run the bf16 GEMV four rows a pass, each pass
// streaming the weight again (on SmolLM2's gate_up and down, 2 threads of a Zen 3: 3.2-6.4x
// ATen's at 2-96 rows, ahead of the widening below up to about 100), and more widen the weight
// to fp32 a slab at a time for ATen's fp32 GEMM, rounding the result once (4.8-6.3x at 129-256).
constexpr int64_t kBf16GemvRows = 64;
constexpr int64_t kWidenSlabBytes = 4 << 20;  // fp32 weight rows widened at a time

at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = at::empty({m, n}, xf.options());
  const int64_t slab = std::max<int64_t>(16, kWidenSlabBytes / (4 * std::max<int64_t>(1, k)));
  at::Tensor wf = at::empty({std::min(slab, n), k}, xf.options());
  for (int64_t n0 = 0; n0 < n; n0 += slab) {
    const int64_t rows = std::min(slab, n - n0);
    at::Tensor part = wf.narrow(0, 0, rows);
    part.copy_(w.narrow(0, n0, rows));
    y.narrow(1, n0, rows).copy_(at::mm(xf, part.t()));
  }
  if (bias != nullptr) y.add_(bias->to(at::kFloat));
  return y.to(x.scalar_type());
}

at::Tensor float_linear(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias) {
#if F32_VECTORS && !BF16_VECTORS
  const bool bf16 = x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                    (!bias.has_value() || bias->scalar_type() == at::kBFloat16);
  if (bf16 && x.dim() == 2 && w.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() &&
      x.size(1) == w.size(1) && x.size(0) > 0 &&
      (!bias.has_value() || (bias->is_contiguous() && bias->numel() == w.size(0)))) {
    const at::Tensor* b = bias.has_value() ? &*bias : nullptr;
    if (x.size(0) > kBf16GemvRows) return widened_linear(x, w, b);
    at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
    gemv_impl<c10::BFloat16>(x, w, b, y);
    return y;
  }
#endif
  return at::linear(x, w, bias);
}

// ---- the decoder layers of a model in one call ---------------------------------------------
// At decode a layer's own work is a few small products; the Python around them (a dozen
// module calls, views and checks per layer) then costs as much as the products. This op runs
// the layers' sequence of kernels from C++: the same kernels, in the same order, on the same
// tensors as the layers' modules (models/llama.py, their forward_cpu), so its results are
// identical to theirs.
//
// Each layer is described by its declaration (layers/decoder_spec.py, packed by
// worker/cpu_decoder.py). Per layer, `tensors` holds kTensorsPerLayer entries: the norm
// weights (input, after attention, before the MLP, after the MLP, q per head, k per head; an
// absent norm is undefined), the rotary tables, the layer's key and value cache, then four
// linear layers (qkv, o, gate_up, down) as (weight, rowsum, scale, bias): rowsum undefined is
// a float weight (at::linear; a 3-D one is in panels, pagedllm_panel::panel_linear), else the
// packed int8 weight of pagedllm_int8::int8_linear; a negative activation level -b is a
// weight-only b-bit weight of pagedllm_wo::weight_only_linear, (codes, offset or undefined,
// group scales, bias), or of pagedllm_panel::quant_panel_linear where the codes are 3-D.
// `ints` holds kIntsPerLayer entries (heads, KV heads, head size, window, attention tiles
// block_m and block_n, the four linears' activation levels, the activation: 0 SiLU, 1 GELU
// tanh, and the norm kind: 0 weight * x, 1 (1 + weight) * x) and `floats` kFloatsPerLayer
// (the norms' eps, the attention scale).
constexpr int64_t kTensorsPerLayer = 26, kIntsPerLayer = 12, kFloatsPerLayer = 2;

using Int8LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, int64_t, const c10::optional<at::Tensor>&,
                                const c10::optional<std::string>&);
using WeightOnlyLinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const c10::optional<at::Tensor>&, int64_t,
                                      const c10::optional<at::Tensor>&,
                                      const c10::optional<std::string>&);
using PanelLinearFn = at::Tensor(const at::Tensor&, const at::Tensor&,
                                 const c10::optional<at::Tensor>&,
                                 const c10::optional<std::string>&,
                                 const c10::optional<at::ScalarType>&);
using AttentionFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                         const c10::optional<at::Tensor>&, double, int64_t, int64_t, int64_t,
                         int64_t);

// The int8, weight-only and panel GEMMs and the attention kernel live in their own libraries
// (loaded before this op is called); they are reached through the dispatcher, looked up once
// (each accessor keeps its handle in a function-local static).
template <typename Fn>
c10::TypedOperatorHandle<Fn> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

const c10::TypedOperatorHandle<Int8LinearFn>& int8_linear_op() {
  static const auto op = typed_op<Int8LinearFn>("pagedllm_int8::int8_linear");
  return op;
}

const c10::TypedOperatorHandle<WeightOnlyLinearFn>& weight_only_linear_op() {
  static const auto op = typed_op<WeightOnlyLinearFn>("pagedllm_wo::weight_only_linear");
  return op;
}

const c10::TypedOperatorHandle<PanelLinearFn>& panel_linear_op() {
  static const auto op = typed_op<PanelLinearFn>("pagedllm_panel::panel_linear");
  return op;
}

// Weight-only levels: -(form * kXForms + bits), form 0 for x in float, 1 for x rounded to int8
// per block, 2 for x as two int8 parts (layers/quantization.py's x_form).
constexpr int64_t kXForms = 64;

const c10::TypedOperatorHandle<WeightOnlyLinearFn>& quant_panel_linear_op() {
  static const auto op = typed_op<WeightOnlyLinearFn>("pagedllm_panel::quant_panel_linear");
  return op;
}

const c10::TypedOperatorHandle<AttentionFn>& attention_op() {
  static const auto op = typed_op<AttentionFn>("pagedllm_attention::varlen_attention");
  return op;
}

// A model's decoder-layer operands, handed to C++ once when the fused decoder is built: a step
// then passes one handle, where the list of SmolLM2's 30 layers (780 optional tensors) was
// converted from Python at every step. The tensors are read by reference: copying each out of
// the list (a reference count up and down, 42 a layer) took about 1% of a one-row step.
struct DecoderPlan : torch::CustomClassHolder {
  std::vector<c10::optional<at::Tensor>> tensors;
  std::vector<int64_t> ints;
  std::vector<double> floats;

  DecoderPlan(const c10::List<c10::optional<at::Tensor>>& t, std::vector<int64_t> i,
              std::vector<double> f)
      : ints(std::move(i)), floats(std::move(f)) {
    tensors.reserve(t.size());
    for (size_t k = 0; k < t.size(); ++k) tensors.push_back(t.get(k));
    const int64_t layers = int64_t(tensors.size()) / kTensorsPerLayer;
    TORCH_CHECK(int64_t(tensors.size()) == layers * kTensorsPerLayer &&
                    int64_t(ints.size()) == layers * kIntsPerLayer &&
                    int64_t(floats.size()) == layers * kFloatsPerLayer,
                "DecoderPlan: operand lists of different layer counts");
  }

  // Operand i: the tensor, undefined where the layer has none.
  const at::Tensor& operand(int64_t i) const { return operand_of(tensors, i); }

  static const at::Tensor& operand_of(const std::vector<c10::optional<at::Tensor>>& t,
                                      int64_t i) {
    static const at::Tensor none;
    return t[i].has_value() ? *t[i] : none;
  }
};

// A whole model's ends around its decoder layers (worker/cpu_decoder.py's ModelEnds): the
// token embedding before them; after them the final norm, then the LM head on the rows that
// need logits. `tensors`: the norm's weight; the head as a layer's linear (weight, rowsum,
// scale, bias); the embedding's table (a, b, c below). `ints`: the head's activation level,
// the norm kind, the vocabulary size (the head's rows past it are padding), the embedding's
// kind and its bits. `floats`: the norm's eps, the embeddings' scale (0: none).
// Embedding kinds: 0 rows of a float table a; 1 rows of float panels a; 2 rows of
// group-quantized codes in panels (a codes, b the int4 offsets or undefined, c the group
// scales, dequantized in float32); 3 rows of int8 a times their scale c (float32); -1 none
// here (the caller looks the tokens up). Kinds 2 and 3 end in the model's dtype, as the
// quantized embeddings' lookup does.
constexpr int64_t kEndsTensors = 8, kEndsInts = 5, kEndsFloats = 2;

struct EndsPlan : torch::CustomClassHolder {
  std::vector<c10::optional<at::Tensor>> tensors;
  std::vector<int64_t> ints;
  std::vector<double> floats;

  EndsPlan(const c10::List<c10::optional<at::Tensor>>& t, std::vector<int64_t> i,
           std::vector<double> f)
      : ints(std::move(i)), floats(std::move(f)) {
    for (size_t k = 0; k < t.size(); ++k) tensors.push_back(t.get(k));
    TORCH_CHECK(int64_t(tensors.size()) == kEndsTensors && int64_t(ints.size()) == kEndsInts &&
                    int64_t(floats.size()) == kEndsFloats,
                "EndsPlan: (norm, head weight, rowsum, scale, bias, embedding a, b, c), "
                "(level, norm kind, vocab, embedding kind, bits), (eps, embedding scale)");
  }

  const at::Tensor& operand(int64_t i) const { return DecoderPlan::operand_of(tensors, i); }
};

// x W^T + b as the layer classes compute it: F.linear for a float weight; for an int8 or
// weight-only one the kernel, cast back to x's dtype, then the bias (Int8Kernel.__call__).
// decode: every row of x is a sequence's next token (weight_only.linear's "int8_decode").
// The operands are tensors[first, first + 4). out_dtype float32: a product in panels writes
// its bfloat16 results widened (panel_linear's out_dtype); the others leave that to the caller.
at::Tensor linear(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& tensors,
                  int64_t first, int64_t levels, bool decode,
                  c10::optional<at::ScalarType> out_dtype = c10::nullopt) {
  const at::Tensor& w = DecoderPlan::operand_of(tensors, first);
  const at::Tensor& rowsum = DecoderPlan::operand_of(tensors, first + 1);
  const at::Tensor& scale = DecoderPlan::operand_of(tensors, first + 2);
  const at::Tensor& bias = DecoderPlan::operand_of(tensors, first + 3);
  const c10::optional<at::Tensor>& b = tensors[first + 3];
  if (levels < 0) {  // weight-only: rowsum's slot holds the int4 offsets
    const c10::optional<at::Tensor>& offset = tensors[first + 1];
    const int64_t bits = -levels % kXForms, form = -levels / kXForms;
    at::Tensor y;
    if (w.dim() == 3) {  // codes in panels
      const c10::optional<std::string> isa =
          form == 1   ? c10::optional<std::string>(decode ? "avx512_vnni_all" : "avx512_vnni")
          : form == 2 ? c10::optional<std::string>("avx512_vnni_residual")
                      : c10::nullopt;
      y = quant_panel_linear_op().call(x, w, scale, offset, bits, c10::nullopt, isa);
    } else {  // codes by rows: int8 x (group 32, AVX2) under the same forms
      const c10::optional<std::string> isa =
          form == 1   ? c10::optional<std::string>("int8")
          : form == 2 ? c10::optional<std::string>("int8_residual")
                      : c10::nullopt;
      y = weight_only_linear_op().call(x, w, scale, offset, bits, c10::nullopt, isa);
    }
    return bias.defined() ? y + bias : y;
  }
  if (!rowsum.defined()) {
    if (w.dim() == 3)  // in panels
      return panel_linear_op().call(x, w, b, c10::nullopt, out_dtype);
    if (x.size(0) <= kGemvUseRows && (x.scalar_type() == at::kFloat ||
                                      x.scalar_type() == at::kBFloat16))
      return gemv(x, w, b);  // what LinearBase.matmul runs at these rows
    return float_linear(x, w, b);
  }
  // float32 and bfloat16 x go in as they are (y in their dtype), others as float32
  const bool direct = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
  const at::Tensor xf = direct ? x : x.to(at::kFloat);
  at::Tensor y = int8_linear_op().call(xf, w, rowsum, scale, levels, c10::nullopt, c10::nullopt);
  if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
  return bias.defined() ? y + bias : y;
}

// This step's K/V rows [T, Hk, D] into their cache slots (the module path's index_copy_ on
// [slots, Hk, D] views): one memcpy per (token, kv head), where index_copy_ sets up a tensor
// iterator per call (about 20 us for a decode step's 48 rows, twice per layer).
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.scalar_type() == key.scalar_type() &&
                  value_cache.scalar_type() == value.scalar_type() &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens,
              "write_kv_cache: K/V [T, Hk, D] rows, contiguous caches of their dtype, int64 slots");
  const int64_t slots = key_cache.numel() / (heads * dim);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t bytes = dim * key.element_size();
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t elem = key.element_size();
  at::parallel_for(0, tokens, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "write_kv_cache: slot out of range");
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = (slot[t] * heads + h) * bytes;
        std::memcpy(kc + row, k + (t * key.stride(0) + h * key.stride(1)) * elem, bytes);
        std::memcpy(vc + row, v + (t * value.stride(0) + h * value.stride(1)) * elem, bytes);
      }
    }
  });
}

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                  bool offset) {
  with_float_type(x.scalar_type(), "decoder_layers", [&](auto t) {
    add_rms_norm_impl<decltype(t)>(x, residual, weight, eps, offset);
  });
}

// Per-head norm of q or k [T, H, D] (a strided view of the qkv projection): through a
// contiguous [T * H, D] copy, as the Python layer does it.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
  const at::Tensor rows = x.reshape({-1, x.size(2)});
  return rms_norm(rows, weight, eps, offset).view({x.size(0), x.size(1), x.size(2)});
}

// Calls fn with a value of a KV cache's element type: with_float_type's, or Half (an fp16
// cache, llama.cpp's default; attention's kernel converts it with F16C).
template <typename F>
void with_cache_type(at::ScalarType dtype, const char* op, F&& fn) {
  if (dtype == at::kHalf) return fn(c10::Half{});
  with_float_type(dtype, op, std::forward<F>(fn));
}

// Eight values from fp16 to fp32 and back, as vectors where the build has F16C (c10::Half's
// conversion is a scalar's bit manipulation).
inline bool convert8(const c10::Half* in, float* out) {
#if defined(__F16C__)
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in))));
  return true;
#else
  return false;
#endif
}

inline bool convert8(const float* in, c10::Half* out) {
#if defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm256_cvtps_ph(_mm256_loadu_ps(in), _MM_FROUND_TO_NEAREST_INT));
  return true;
#else
  return false;
#endif
}

template <typename S, typename D>
inline bool convert8(const S*, D*) {
  return false;
}

// src [T, H, D] (head rows of unit stride, as heads_of makes them) into dst, a contiguous
// [T, H, D] of the other float type (or fp16, a cache's), each value rounded as Tensor.to
// rounds it (to nearest even): where kv_cache_dtype differs from the model's, a decode step
// converts q, k, v and the attention's output of every layer, and four dispatched .to() calls
// a layer, each with its allocation, cost about what the smaller cache saved at short
// contexts.
void convert_rows(const at::Tensor& src, at::Tensor& dst) {
  const int64_t tokens = src.size(0), heads = src.size(1), dim = src.size(2);
  TORCH_CHECK(src.stride(2) == 1 && dst.is_contiguous() && dst.sizes() == src.sizes(),
              "convert_rows: [T, H, D] rows into a contiguous tensor of their shape");
  with_cache_type(src.scalar_type(), "convert_rows", [&](auto s) {
    using S = decltype(s);
    with_cache_type(dst.scalar_type(), "convert_rows", [&](auto d) {
      using D = decltype(d);
      const S* in = src.data_ptr<S>();
      D* out = dst.data_ptr<D>();
      at::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t h = 0; h < heads; ++h) {
            const S* row = in + t * src.stride(0) + h * src.stride(1);
            D* to = out + (t * heads + h) * dim;
            int64_t i = 0;
            while (i + 8 <= dim && convert8(row + i, to + i)) i += 8;
            for (; i < dim; ++i) to[i] = static_cast<D>(static_cast<float>(row[i]));
          }
      });
    });
  });
}

// A [T, H, D] view of columns [first, first + H * D) of the rows of x [T, N] (q, k or v in a
// fused qkv projection's output), made without the dispatcher: a decode step makes three a
// layer, and narrow + view cost about 1 us each.
at::Tensor heads_of(const at::Tensor& x, int64_t first, int64_t heads, int64_t dim) {
  char* base = static_cast<char*>(x.data_ptr()) + first * x.element_size();
  return at::from_blob(base, {x.size(0), heads, dim}, {x.stride(0), dim, 1}, x.options());
}

// A buffer of the given shape: `buf` again where it has it, else a new one (the decoder's
// per-layer outputs that the next layer may overwrite, allocated once a step).
at::Tensor& reuse(at::Tensor& buf, at::IntArrayRef shape, const at::TensorOptions& options) {
  if (!buf.defined() || buf.sizes() != shape) buf = at::empty(shape, options);
  return buf;
}

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& hidden_in, const c10::optional<at::Tensor>& residual_in,
    const at::Tensor& positions, const c10::intrusive_ptr<DecoderPlan>& plan,
    const at::Tensor& slot_mapping, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k,
    const at::Tensor& block_table) {
  const std::vector<int64_t>& ints = plan->ints;
  const std::vector<double>& floats = plan->floats;
  const int64_t layers = int64_t(plan->tensors.size()) / kTensorsPerLayer;
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.stride(1) == 1, "hidden: [T, D]");
  TORCH_CHECK(hidden_in.scalar_type() == at::kFloat || hidden_in.scalar_type() == at::kBFloat16,
              "decoder_layers: float32 or bfloat16");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions");
  const int64_t tokens = hidden_in.size(0);
  const bool decode = tokens == cu_seqlens_q.size(0) - 1;  // one token a sequence
  at::Tensor hidden = hidden_in, residual;
  if (residual_in.has_value()) {
    residual = *residual_in;
  } else {  // the first norm starts the residual stream (RMSNorm.forward with residual None)
    residual = at::zeros_like(hidden);
    hidden = hidden.clone();
  }
  at::Tensor q_buf, k_buf, attn_buf, act_buf;  // each layer's, reused by the next
  at::Tensor q_cache_buf, k_cache_buf, v_cache_buf, attn_out_buf;  // kv_cache_dtype's copies
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t t0 = l * kTensorsPerLayer;
    const int64_t* in = ints.data() + l * kIntsPerLayer;
    const double* fl = floats.data() + l * kFloatsPerLayer;
    const int64_t heads = in[0], kv_heads = in[1], dim = in[2];
    const bool gelu = in[10] == 1, offset = in[11] == 1;
    const double eps = fl[0];
    const at::Tensor& in_w = plan->operand(t0);
    const at::Tensor& post_attn_w = plan->operand(t0 + 1);
    const at::Tensor& pre_mlp_w = plan->operand(t0 + 2);
    const at::Tensor& post_mlp_w = plan->operand(t0 + 3);
    const at::Tensor& q_w = plan->operand(t0 + 4);
    const at::Tensor& k_w = plan->operand(t0 + 5);
    const at::Tensor& cos = plan->operand(t0 + 6);
    const at::Tensor& sin = plan->operand(t0 + 7);
    const at::Tensor& key_cache = plan->operand(t0 + 8);
    const at::Tensor& value_cache = plan->operand(t0 + 9);
    // attention stage: norm, qkv, q/k norms, rotary, cache write, paged attention, o, norm
    add_rms_norm(hidden, residual, in_w, eps, offset);
    const at::Tensor qkv = linear(hidden, plan->tensors, t0 + 10, in[6], decode);
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
    at::Tensor q = heads_of(qkv, 0, heads, dim), k = heads_of(qkv, q_size, kv_heads, dim);
    const at::Tensor v = heads_of(qkv, q_size + kv_size, kv_heads, dim);
    if (q_w.defined()) {
      q = head_norm(q, q_w, eps, offset);
      k = head_norm(k, k_w, eps, offset);
    }
    at::Tensor& q_rot = reuse(q_buf, {tokens, heads, dim}, qkv.options());
    at::Tensor& k_rot = reuse(k_buf, {tokens, kv_heads, dim}, qkv.options());
    rotary_into(positions, q, k, cos, sin, q_rot, k_rot);
    // a cache of another dtype (kv_cache_dtype): attention runs in it, as layers/attention.py
    const at::TensorOptions cache_options = qkv.options().dtype(key_cache.scalar_type());
    const bool convert = key_cache.scalar_type() != qkv.scalar_type();
    at::Tensor q_att = q_rot, k_att = k_rot, v_att = v;
    if (convert) {
      convert_rows(q_rot, q_att = reuse(q_cache_buf, {tokens, heads, dim}, cache_options));
      convert_rows(k_rot, k_att = reuse(k_cache_buf, {tokens, kv_heads, dim}, cache_options));
      convert_rows(v, v_att = reuse(v_cache_buf, {tokens, kv_heads, dim}, cache_options));
    }
    write_kv_cache(k_att, v_att, key_cache, value_cache, slot_mapping);
    at::Tensor& attn = reuse(attn_buf, {tokens, heads, dim}, cache_options);
    attention_op().call(q_att, key_cache, value_cache, attn, cu_seqlens_q, seq_lens_k,
                        c10::nullopt, block_table, c10::nullopt, fl[1], in[3], 0, in[4], in[5]);
    at::Tensor attn_out = attn;
    if (convert)
      convert_rows(attn, attn_out = reuse(attn_out_buf, {tokens, heads, dim}, qkv.options()));
    hidden = linear(attn_out.view({tokens, q_size}), plan->tensors, t0 + 14, in[7], decode);
    if (post_attn_w.defined()) hidden = rms_norm(hidden, post_attn_w, eps, offset);
    // MLP stage: norm, gate_up, activation * up, down, norm
    add_rms_norm(hidden, residual, pre_mlp_w, eps, offset);
    const at::Tensor gate_up = linear(hidden, plan->tensors, t0 + 18, in[8], decode);
    at::Tensor& act = reuse(act_buf, {tokens, gate_up.size(1) / 2}, gate_up.options());
    gated_into(gate_up, gelu, act, "decoder_layers");
    hidden = linear(act, plan->tensors, t0 + 22, in[9], decode);
    if (post_mlp_w.defined()) hidden = rms_norm(hidden, post_mlp_w, eps, offset);
  }
  return {hidden, residual};
}

using RowsFn = at::Tensor(const at::Tensor&, const at::Tensor&);
using QuantRowsFn = at::Tensor(const at::Tensor&, const at::Tensor&,
                               const c10::optional<at::Tensor>&, int64_t, const at::Tensor&);

const c10::TypedOperatorHandle<RowsFn>& panel_rows_op() {
  static const auto op = typed_op<RowsFn>("pagedllm_panel::panel_rows");
  return op;
}

const c10::TypedOperatorHandle<QuantRowsFn>& quant_panel_rows_op() {
  static const auto op = typed_op<QuantRowsFn>("pagedllm_panel::quant_panel_rows");
  return op;
}

// The embeddings of token ids [T] as the model's embedding module gives them (its lookup,
// then the embeddings' scale, Gemma's), in the model's dtype.
at::Tensor embed(const at::Tensor& ids, const EndsPlan& ends) {
  const at::ScalarType dtype = ends.operand(0).scalar_type();
  const at::Tensor &a = ends.operand(5), &c = ends.operand(7);
  at::Tensor rows;
  switch (ends.ints[3]) {
    case 0: rows = a.index_select(0, ids); break;
    case 1: rows = panel_rows_op().call(a, ids); break;
    case 2:
      rows = quant_panel_rows_op().call(a, c, ends.tensors[6], ends.ints[4], ids).to(dtype);
      break;
    case 3:
      rows = (a.index_select(0, ids).to(at::kFloat) * c.index_select(0, ids).unsqueeze(1))
                 .to(dtype);
      break;
    default: TORCH_CHECK(false, "decoder_logits: these ends look no tokens up");
  }
  return ends.floats[1] != 0 ? rows * ends.floats[1] : rows;
}

// The layers between the model's ends: the embeddings of token ids `input` (int64 [T]; or
// the embeddings the caller looked up, or the hidden states and residual that earlier calls
// left after the first layers), the layers,
// the final norm (in place, as RMSNorm.forward_cpu with a residual), and the logits of
// `rows` of the normed hidden states (every row where absent) in float32: the values of the
// head's product in the model's dtype widened, as the model's compute_logits gives them.
// Returns (normed hidden states, logits). The embedding, the norm and the LM head ran from
// Python around the layers, each through its module's wrappers: in a one-user decode step,
// whose weights stream through every cache, that Python ran with its own code and data
// evicted from them and took about as long as a few layers.
std::tuple<at::Tensor, at::Tensor> decoder_logits(
    const at::Tensor& input, const c10::optional<at::Tensor>& residual_in,
    const at::Tensor& positions, const c10::intrusive_ptr<DecoderPlan>& plan,
    const c10::intrusive_ptr<EndsPlan>& ends, const at::Tensor& slot_mapping,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k, const at::Tensor& block_table,
    const c10::optional<at::Tensor>& rows) {
  const bool ids = input.scalar_type() == at::kLong;
  TORCH_CHECK(!ids || !residual_in.has_value(), "decoder_logits: token ids have no residual");
  auto [hidden, residual] =
      decoder_layers(ids ? embed(input, *ends) : input, residual_in, positions, plan,
                     slot_mapping, cu_seqlens_q, seq_lens_k, block_table);
  const bool decode = hidden.size(0) == cu_seqlens_q.size(0) - 1;
  add_rms_norm(hidden, residual, ends->operand(0), ends->floats[0], ends->ints[1] == 1);
  const at::Tensor x = rows.has_value() ? hidden.index_select(0, *rows) : hidden;
  at::Tensor logits = linear(x, ends->tensors, 1, ends->ints[0], decode, at::kFloat);
  if (logits.size(1) != ends->ints[2]) logits = logits.narrow(1, 0, ends->ints[2]);
  if (logits.scalar_type() != at::kFloat) logits = logits.to(at::kFloat);
  return {hidden, logits};
}

// The index of each fp32 row's largest value, the first of equal ones (torch.argmax's
// answer; a row holding NaN gives its first NaN, as torch's does). One pass, 16 lanes of
// running maxima and their indices; torch's kernel took 1.8 ms for 48 x 49,152 logits, the
// lanes as scalars 0.41 ms, as AVX-512 vectors (where the build targets it) 0.16 ms; one row
// 19 -> 8 us. On an AVX2-only Zen 3, where the compiler left the scalar lanes as they are, the
// lanes as two AVX2 vectors: 0.91 -> 0.13 ms (torch 1.14), one row 40 -> 9 us.
int64_t argmax_row(const float* v, int64_t n) {
  float best[16];
  int64_t at_[16];
  for (int l = 0; l < 16; ++l) best[l] = -std::numeric_limits<float>::infinity(), at_[l] = -1;
  bool nan = false;
  int64_t i = 0;
#if BF16_VECTORS
  if (n < (int64_t(1) << 31)) {  // lanes as vectors: a compare, two masked moves per 16
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i where = _mm512_set1_epi32(-1), index = _mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 e = _mm512_loadu_ps(v + i);
      unordered |= _mm512_cmp_ps_mask(e, e, _CMP_UNORD_Q);
      const __mmask16 more = _mm512_cmp_ps_mask(e, top, _CMP_GT_OQ);  // strict: the first
      top = _mm512_mask_mov_ps(top, more, e);
      where = _mm512_mask_mov_epi32(where, more, index);
      index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
    }
    int32_t lanes[16];
    _mm512_storeu_ps(best, top);
    _mm512_storeu_si512(lanes, where);
    for (int l = 0; l < 16; ++l) at_[l] = lanes[l];
    nan = unordered != 0;
  }
#elif F32_VECTORS
  if (n < (int64_t(1) << 31)) {  // the same 16 lanes as two vectors of 8: a blend each
    __m256 top[2], unordered = _mm256_setzero_ps();
    __m256i where[2], index[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                  _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
    for (int h = 0; h < 2; ++h)
      top[h] = _mm256_set1_ps(-std::numeric_limits<float>::infinity()),
      where[h] = _mm256_set1_epi32(-1);
    for (; i + 16 <= n; i += 16)
      for (int h = 0; h < 2; ++h) {
        const __m256 e = _mm256_loadu_ps(v + i + 8 * h);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(e, e, _CMP_UNORD_Q));
        const __m256 more = _mm256_cmp_ps(e, top[h], _CMP_GT_OQ);  // strict: the first
        top[h] = _mm256_blendv_ps(top[h], e, more);
        where[h] = _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(where[h]), _mm256_castsi256_ps(index[h]), more));
        index[h] = _mm256_add_epi32(index[h], _mm256_set1_epi32(16));
      }
    int32_t lanes[16];
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_ps(best + 8 * h, top[h]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes + 8 * h), where[h]);
    }
    for (int l = 0; l < 16; ++l) at_[l] = lanes[l];
    nan = _mm256_movemask_ps(unordered) != 0;
  }
#endif
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) {
      const float e = v[i + l];
      nan |= e != e;
      if (e > best[l]) best[l] = e, at_[l] = i + l;  // strict: the first of equal ones
    }
  int64_t arg = -1;
  float m = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < 16; ++l)
    if (at_[l] >= 0 && (best[l] > m || (best[l] == m && at_[l] < arg)))
      m = best[l], arg = at_[l];
  for (; i < n; ++i) {
    nan |= v[i] != v[i];
    if (v[i] > m) m = v[i], arg = i;
  }
  if (nan) {  // rare: torch's NaN rule, scalar
    for (int64_t j = 0; j < n; ++j)
      if (v[j] != v[j]) { arg = j; break; }
  }
  return arg < 0 ? 0 : arg;  // every value -inf: index 0, as torch
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: fp32 [rows, n] with unit stride, n > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(x.data_ptr<float>() + r * x.stride(0), n);
  });
  return out;
}

// ---- sampling: a token from each row's filtered distribution, by its inverse CDF ----------
// Sampler's temperature, top-k, top-p and min-p rows in three passes over each row of logits
// (a few more where top-k or top-p rank its tokens), and one uniform number a row: torch's
// path (a softmax, and exponential noise for every entry to race) took 51 ms for the noise
// alone at 48 x 49,152 on a 2-core Zen 3, and its top-p sort 96 ms. The token is the first
// of the kept ones, in index order, whose running sum of probabilities passes u times their
// total.

// Features a block sum covers: the scan for u's token adds the block sums, then one block's.
constexpr int64_t kSampleBlock = 64;

// Fractions of the largest probability a top-k or top-p row ranks from: the first that keeps
// at least k tokens, or probability mass of at least top_p, in its tokens at or above it
// (those are the first in order, so they hold every kept one); every token where none does.
constexpr float kSampleLevels[] = {1e-2f, 1e-4f, 1e-6f, 1e-9f};

using Ranked = std::pair<float, int32_t>;  // a token's e and index

struct SampleScratch {
  std::vector<float> e;         // a row's exp(x - max x), x = logits / temperature
  std::vector<float> blocks;    // their sums by kSampleBlock
  std::vector<Ranked> ranked;   // a top-k or top-p row's tokens at or above its level
};

// e = v / t (as torch divides), returning its largest value; nan: whether any is NaN.
float scale_row(const float* v, int64_t n, float t, float* e, bool& nan) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  nan = false;
#if F32_VECTORS
  const __m256 tv = _mm256_set1_ps(t);
  __m256 top = _mm256_set1_ps(m), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(v + i), tv);
    _mm256_storeu_ps(e + i, x);
    top = _mm256_max_ps(top, x);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  for (const float l : lanes) m = std::max(m, l);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    e[i] = v[i] / t;
    nan |= e[i] != e[i];
    m = std::max(m, e[i]);
  }
  return m;
}

// e = exp(e - m) in place, 0 where e is -inf (a banned token) or, past floor (min-p's share of
// the largest, 1 here), below it; and their sums by kSampleBlock into blocks.
void exp_row(float* e, int64_t n, float m, float floor, float* blocks) {
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b * kSampleBlock < n; ++b) {
    const int64_t end = std::min(n, (b + 1) * kSampleBlock);
    int64_t i = b * kSampleBlock;
    float sum = 0.f;
#if F32_VECTORS
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= end; i += 8) {
      const __m256 x = _mm256_loadu_ps(e + i);
      __m256 p = _mm256_and_ps(fast_exp8(_mm256_sub_ps(x, _mm256_set1_ps(m))),
                               _mm256_cmp_ps(x, _mm256_set1_ps(-inf), _CMP_NEQ_OQ));
      p = _mm256_and_ps(p, _mm256_cmp_ps(p, _mm256_set1_ps(floor), _CMP_GE_OQ));
      _mm256_storeu_ps(e + i, p);
      acc = _mm256_add_ps(acc, p);
    }
    sum = hsum8(acc);
#endif
    for (; i < end; ++i) {
      float p = e[i] == -inf ? 0.f : fast_exp(e[i] - m);
      e[i] = p >= floor ? p : 0.f;
      sum += e[i];
    }
    blocks[b] = sum;
  }
}

// The first token whose running sum of e passes target (block sums first, then the block's
// own); the last token with e > 0 where rounding leaves target beyond them all.
int64_t scan_row(const float* e, int64_t n, const float* blocks, double target) {
  double acc = 0.0;
  for (int64_t b = 0; b * kSampleBlock < n; ++b) {
    if (acc + blocks[b] <= target) {
      acc += blocks[b];
      continue;
    }
    for (int64_t i = b * kSampleBlock; i < std::min(n, (b + 1) * kSampleBlock); ++i)
      if ((acc += e[i]) > target && e[i] > 0.f) return i;
  }
  for (int64_t i = n - 1; i > 0; --i)
    if (e[i] > 0.f) return i;
  return 0;
}

// The order of a top-k or top-p row's tokens: the largest e first, the first index of equal ones
// first (a strict order, so that each cut below is a prefix of the same sort).
inline bool ranks_before(const Ranked& a, const Ranked& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The last token a top-k or top-p row keeps, in ranks_before's order: the k-th, or the last
// whose probability mass before it is under top_p (of the top k where k cuts). Tokens at or
// above the first of kSampleLevels that holds it are ranked, then halved: where the first
// half's mass, with the mass before it, reaches top_p, the search goes on in that half, else
// that half is kept whole and the search goes on in the other; about twice their count in
// comparisons.
Ranked last_kept(const float* e, int64_t n, double total, int64_t top_k, float top_p,
                 SampleScratch& s) {
  const bool by_count = top_k > 0 && top_k < n;
  float level = std::numeric_limits<float>::min();  // every token with e > 0
  for (const float l : kSampleLevels) {
    int64_t count = 0, i = 0;
    float mass = 0.f;
#if F32_VECTORS
    __m256 sum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps(e + i);
      const __m256 in = _mm256_cmp_ps(x, _mm256_set1_ps(l), _CMP_GE_OQ);
      count += __builtin_popcount(_mm256_movemask_ps(in));
      sum = _mm256_add_ps(sum, _mm256_and_ps(x, in));
    }
    mass = hsum8(sum);
#endif
    for (; i < n; ++i)
      if (e[i] >= l) ++count, mass += e[i];
    // a margin for the fp32 sums: where they round up, the next level's tokens are ranked
    if (by_count ? count >= top_k : double(mass) >= double(top_p) * total * (1.0 + 1e-5)) {
      level = l;
      break;
    }
  }
  std::vector<Ranked>& ranked = s.ranked;
  ranked.clear();
  int64_t i = 0;
#if F32_VECTORS
  for (; i + 8 <= n; i += 8)
    for (int in = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + i), _mm256_set1_ps(level),
                                                   _CMP_GE_OQ));
         in != 0; in &= in - 1) {
      const int64_t at = i + __builtin_ctz(in);
      ranked.emplace_back(e[at], int32_t(at));
    }
#endif
  for (; i < n; ++i)
    if (e[i] >= level) ranked.emplace_back(e[i], int32_t(i));
  auto begin = ranked.begin(), end = ranked.end();
  if (by_count && end - begin > top_k) {
    std::nth_element(begin, begin + (top_k - 1), end, ranks_before);
    end = begin + top_k;
  }
  if (top_p >= 1.f) return *std::max_element(begin, end, ranks_before);  // the last of them
  double mass = 0.0;  // top-p's: of the top k where k cuts
  if (by_count)
    for (auto it = begin; it != end; ++it) mass += it->first;
  const double target = double(top_p) * (by_count ? mass : total);
  double before = 0.0;  // the mass ranked ahead of [begin, end)
  while (end - begin > 32) {
    const auto mid = begin + (end - begin) / 2;
    std::nth_element(begin, mid, end, ranks_before);
    double half = 0.0;
    for (auto it = begin; it != mid; ++it) half += it->first;
    if (before + half >= target) {
      end = mid;  // a token of the first half has the mass reach top_p
    } else {
      before += half;
      begin = mid;
    }
  }
  std::sort(begin, end, ranks_before);
  Ranked last = *begin;
  for (auto it = begin; it != end && before < target; ++it) {
    last = *it;
    before += it->first;
  }
  return last;
}

// e with the tokens ranked after `last`, or below min-p's floor, set to 0; their block sums
// into blocks.
void keep_through(float* e, int64_t n, const Ranked& last, float floor, float* blocks) {
  for (int64_t b = 0; b * kSampleBlock < n; ++b) {
    const int64_t end = std::min(n, (b + 1) * kSampleBlock);
    int64_t i = b * kSampleBlock;
    float sum = 0.f;
#if F32_VECTORS
    const __m256 top = _mm256_set1_ps(last.first), low = _mm256_set1_ps(floor);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= end; i += 8) {
      const __m256 x = _mm256_loadu_ps(e + i);
      const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(int32_t(i)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256 through = _mm256_castsi256_ps(  // index <= last's
          _mm256_cmpgt_epi32(_mm256_set1_epi32(last.second + 1), at));
      const __m256 kept = _mm256_or_ps(_mm256_cmp_ps(x, top, _CMP_GT_OQ),
                                       _mm256_and_ps(_mm256_cmp_ps(x, top, _CMP_EQ_OQ), through));
      const __m256 p = _mm256_and_ps(x, _mm256_and_ps(kept, _mm256_cmp_ps(x, low, _CMP_GE_OQ)));
      _mm256_storeu_ps(e + i, p);
      acc = _mm256_add_ps(acc, p);
    }
    sum = hsum8(acc);
#endif
    for (; i < end; ++i) {
      const bool kept = e[i] > last.first || (e[i] == last.first && i <= last.second);
      e[i] = kept && e[i] >= floor ? e[i] : 0.f;
      sum += e[i];
    }
    blocks[b] = sum;
  }
}

int64_t sample_row(const float* v, int64_t n, float t, int64_t top_k, float top_p, float min_p,
                   double u, SampleScratch& s) {
  if (t == 0.f) return argmax_row(v, n);
  s.e.resize(n);
  s.blocks.resize((n + kSampleBlock - 1) / kSampleBlock);
  float* e = s.e.data();
  bool nan;
  const float m = scale_row(v, n, t, e, nan);
  if (nan) return argmax_row(v, n);  // torch's probabilities are NaN: argmax's answer
  if (m == -std::numeric_limits<float>::infinity()) return 0;
  if (m == std::numeric_limits<float>::infinity())  // the first +inf takes every probability
    for (int64_t i = 0;; ++i)
      if (e[i] == m) return i;
  const bool ranked = (top_k > 0 && top_k < n) || top_p < 1.f;
  exp_row(e, n, m, ranked ? 0.f : min_p, s.blocks.data());
  const auto total = [&] { return std::accumulate(s.blocks.begin(), s.blocks.end(), 0.0); };
  if (ranked)
    keep_through(e, n, last_kept(e, n, total(), top_k, top_p, s), min_p, s.blocks.data());
  return scan_row(e, n, s.blocks.data(), u * total());
}

// A token from each row of fp32 logits [rows, n]: argmax where temperature is 0, else drawn
// with uniform[row] in [0, 1) from softmax(logits / temperature) as top_k (0: off), top_p
// and min_p (0: off) filter it, Sampler's rules.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                       const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
                  logits.size(1) > 0,
              "sample_rows: fp32 logits [rows, n] with unit stride, n > 0");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n < (int64_t(1) << 31) - 1, "sample_rows: at most 2^31 - 2 tokens a row");
  const auto check = [&](const at::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.scalar_type() == dtype &&
                    t.is_contiguous(),
                "sample_rows: ", name, " must be a contiguous ", dtype, " [rows]");
  };
  check(temperature, at::kFloat, "temperature");
  check(top_k, at::kLong, "top_k");
  check(top_p, at::kFloat, "top_p");
  check(min_p, at::kFloat, "min_p");
  check(uniform, at::kDouble, "uniform");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const float *t = temperature.data_ptr<float>(), *p = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const int64_t* k = top_k.data_ptr<int64_t>();
  const double* u = uniform.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    thread_local SampleScratch scratch;
    for (int64_t r = r0; r < r1; ++r)
      o[r] = sample_row(logits.data_ptr<float>() + r * logits.stride(0), n, t[r], k[r], p[r],
                        mp[r], u[r], scratch);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedllm_fused, m) {
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
        "bool offset) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool offset) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("rotary_neox(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> "
        "(Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("float_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor min_p, Tensor uniform) -> Tensor");
  m.class_<DecoderPlan>("DecoderPlan")
      .def(torch::init<c10::List<c10::optional<at::Tensor>>, std::vector<int64_t>,
                       std::vector<double>>());
  m.def("decoder_layers(Tensor hidden, Tensor? residual, Tensor positions, "
        "__torch__.torch.classes.pagedllm_fused.DecoderPlan plan, Tensor slot_mapping, "
        "Tensor cu_seqlens_q, Tensor seq_lens_k, Tensor block_table) -> (Tensor, Tensor)");
  m.class_<EndsPlan>("EndsPlan")
      .def(torch::init<c10::List<c10::optional<at::Tensor>>, std::vector<int64_t>,
                       std::vector<double>>());
  m.def("decoder_logits(Tensor input, Tensor? residual, Tensor positions, "
        "__torch__.torch.classes.pagedllm_fused.DecoderPlan plan, "
        "__torch__.torch.classes.pagedllm_fused.EndsPlan ends, Tensor slot_mapping, "
        "Tensor cu_seqlens_q, Tensor seq_lens_k, Tensor block_table, Tensor? rows) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm_fused, CPU, m) {
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_neox", &rotary_neox);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("decoder_layers", &decoder_layers);
  m.impl("decoder_logits", &decoder_logits);
  m.impl("gemv", &gemv);
  m.impl("float_linear", &float_linear);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("sample_rows", &sample_rows);
}
