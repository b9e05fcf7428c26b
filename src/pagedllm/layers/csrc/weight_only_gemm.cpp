// Weight-only int8 / int4 products: y[M, N] = x[M, K] . W[N, K]^T
//
// The weight stays quantized in memory, in groups of G input features (G a multiple of 32)
// with one fp32 scale (and, for int4, one fp32 offset) per output row and group:
//   int8: W[n, k] = scale[n, k / G] * q[n, k],                       q int8
//   int4: W[n, k] = scale[n, k / G] * q[n, k] + offset[n, k / G],     q in [0, 15]
// int4 codes are two per byte in blocks of 32 features: byte j of a block holds feature j in
// its low nibble and feature j + 16 in its high nibble (the order of GGUF's Q4_0 / Q4_1
// blocks, so those repack by copying bytes).
//
// A few rows (decode, up to kKernelMaxRows) take the integer path: each row of x is rounded
// per block of 32 features to int16 (x_bits 16: step = the block's absolute maximum / 32767,
// finer than bf16) or int8 codes (x_bits 8: / 127, llama.cpp's Q8 activations), and each
// block's product with a weight block is an exact integer dot product (vpdpwssd / vpdpbusd
// with VNNI, vpmaddwd / vpmaddubsw on AVX2) scaled once by scale * step. The int4 offset adds
// offset * step * (sum of the block's codes of x), summed per group. So the result is the
// exact product of the block-rounded x with W, up to fp32 rounding, and the weight is read
// once per call as bytes: no dequantized copy is written. More rows take the slab path: a
// slab of output rows is dequantized into a scratch tile and multiplied with ATen's GEMM in
// x's dtype.
//
// The instruction set (AVX-512 with VNNI, AVX2, portable C++) is picked at run time, each
// compiled with its own target attribute, so one build serves any x86 CPU.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGEDLLM_X86 1
#else
#define PAGEDLLM_X86 0
#endif

namespace {

constexpr int kBlock = 32;              // features per block of x and of the codes
constexpr int kTileM = 4;               // rows of x per pass over a few weight rows
constexpr int64_t kKernelMaxRows = 16;  // beyond this the slab path (GEMM) is faster
constexpr int64_t kSlabElements = 1 << 22;  // weights dequantized per slab (16 MiB fp32)

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

bool cpu_runs(Isa i) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  __builtin_cpu_init();
  switch (i) {
    case Isa::kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default: return true;
  }
#else
  return i == Isa::kScalar;
#endif
}

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

Isa best_isa() {
  static const Isa value = [] {
    for (Isa i : {Isa::kAvx512Vnni, Isa::kAvx2})
      if (cpu_runs(i)) return i;
    return Isa::kScalar;
  }();
  return value;
}

Isa isa_from_name(const std::string& name) {
  for (Isa i : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512Vnni})
    if (name == isa_name(i)) return i;
  TORCH_CHECK(false, "unknown instruction set ", name);
}

// The weight of one call, as raw pointers.
struct Weight {
  const uint8_t* q;      // int8: [N, K] bytes; int4: [N, K / 2] bytes
  const float* scale;    // [N, K / G]
  const float* offset;   // [N, K / G] (int4) or nullptr
  int64_t n, k, group;
  bool int4;
  int64_t groups = k / group;
  std::vector<int32_t> group_of = groups_of_blocks(k, group);  // block -> its group

  static std::vector<int32_t> groups_of_blocks(int64_t k, int64_t group) {
    std::vector<int32_t> g(k / kBlock);  // no division in the loops below
    for (int64_t b = 0; b < k / kBlock; ++b) g[b] = int32_t(b * kBlock / group);
    return g;
  }
  int64_t row_bytes() const { return int4 ? k / 2 : k; }
  const uint8_t* block(int64_t row, int64_t b) const {
    return q + row * row_bytes() + b * (int4 ? kBlock / 2 : kBlock);
  }
  float block_scale(int64_t row, int64_t b) const { return scale[row * groups + group_of[b]]; }
};

// x rounded per block to int8 (T int8_t) or int16 codes [M, K], steps [M, K / 32], and for the
// int4 offset the sum of step * codes over each group [M, K / G]. For int4 the SIMD paths read the codes in pairs of
// blocks as [b 0-15, b+1 0-15, b 16-31, b+1 16-31] (64 bytes; a last odd block pads with 0),
// the order a pair's nibbles unpack in, so a 32-byte load of codes meets a 32-byte load of x.
template <typename T>
struct Rounded {
  static constexpr float kLevels = sizeof(T) == 1 ? 127.f : 32767.f;
  std::vector<T> q;
  std::vector<int8_t> pairs;
  std::vector<float> step, group_sum, step_pairs;  // step_pairs: [M, pairs, 8], lanes as pairs
  int64_t m = 0, k = 0, groups = 0, blocks = 0, pair_stride = 0;

  Rounded(const float* x, int64_t rows, int64_t cols, int64_t group, bool paired)
      : q(rows * cols), step(rows * (cols / kBlock)), group_sum(rows * (cols / group), 0.f),
        m(rows), k(cols), groups(cols / group), blocks(cols / kBlock),
        pair_stride((cols / kBlock + 1) / 2 * 2 * kBlock) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* src = x + r * cols + b * kBlock;
        float amax = 0.f;
        for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(src[j]));
        const float d = amax / kLevels, inv = amax > 0.f ? kLevels / amax : 0.f;
        T* dst = q.data() + r * cols + b * kBlock;
        int sum = 0;
        for (int j = 0; j < kBlock; ++j) {
          dst[j] = T(std::nearbyint(std::min(kLevels, std::max(-kLevels, src[j] * inv))));
          sum += dst[j];
        }
        step[r * blocks + b] = d;
        group_sum[r * groups + b * kBlock / group] += d * float(sum);
      }
    if (!paired || sizeof(T) != 1) return;
    pairs.assign(rows * pair_stride, 0);
    step_pairs.assign(rows * pair_stride / 8, 0.f);  // 8 lanes per 64 bytes of a pair
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        int8_t* dst = pairs.data() + r * pair_stride + (b / 2) * 2 * kBlock + (b % 2) * 16;
        std::memcpy(dst, q.data() + r * cols + b * kBlock, 16);
        std::memcpy(dst + kBlock, q.data() + r * cols + b * kBlock + 16, 16);
        float* lanes = step_pairs.data() + (r * pair_stride + (b / 2) * 2 * kBlock) / 8;
        for (int j = 0; j < 4; ++j) lanes[(b % 2) * 4 + j] = block_step(r, b);
      }
  }
  const float* step_pair(int64_t r, int64_t b) const {  // b even: 8 lanes of blocks b, b + 1
    return step_pairs.data() + (r * pair_stride + b * kBlock) / 8;
  }
  const T* block(int64_t r, int64_t b) const { return q.data() + r * k + b * kBlock; }
  const int8_t* pair(int64_t r, int64_t b) const {  // b even
    return pairs.data() + r * pair_stride + b * kBlock;
  }
  float block_step(int64_t r, int64_t b) const { return step[r * blocks + b]; }
};

using RoundedX = Rounded<int8_t>;
using RoundedX16 = Rounded<int16_t>;

// The int4 offsets' share of y[r, n]: sum over groups of offset * (step * codes of x).
template <typename X>
float offset_term(const Weight& w, const X& x, int64_t n, int64_t r) {
  if (!w.int4) return 0.f;
  const float* off = w.offset + n * w.groups;
  const float* sum = x.group_sum.data() + r * x.groups;
  float s = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) s += off[g] * sum[g];
  return s;
}

// ---- scalar (the reference every path matches up to fp32 rounding) --------------------------
template <typename X>
int block_dot_scalar(const Weight& w, const X& x, int64_t n, int64_t r, int64_t b) {
  const auto* xq = x.block(r, b);
  const uint8_t* src = w.block(n, b);
  int dot = 0;
  if (w.int4) {
    for (int j = 0; j < kBlock / 2; ++j)
      dot += int(src[j] & 0xF) * xq[j] + int(src[j] >> 4) * xq[j + kBlock / 2];
  } else {
    for (int j = 0; j < kBlock; ++j) dot += int(int8_t(src[j])) * xq[j];
  }
  return dot;
}

template <typename X>
void rows_scalar(const Weight& w, const X& x, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < x.m; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < x.blocks; ++b)
        acc += w.block_scale(n, b) * x.block_step(r, b) * float(block_dot_scalar(w, x, n, r, b));
      y[r * w.n + n] = acc + offset_term(w, x, n, r);
    }
}

#if PAGEDLLM_X86 && defined(__GNUC__)
// ---- AVX-512 VNNI on 256-bit vectors ---------------------------------------------------------
// (Zen 4 runs 512-bit integer ops as two halves: 256-bit vectors do the same work in fewer
// cycles, and AVX-512VL gives them vpdpbusd and mask registers.)
#define PAGEDLLM_VNNI \
  __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"), always_inline)) inline

__attribute__((target("avx2,fma"), always_inline)) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Two per-block factors over a pair's lanes: lanes 0-3 block b, lanes 4-7 block b + 1.
#define PAGEDLLM_SPREAD(a, b) _mm256_blend_ps(_mm256_set1_ps(a), _mm256_set1_ps(b), 0xF0)

// int4, R weight rows x M rows of x over blocks b and b + 1 (kPair) or the last block b.
// Scales of blocks b and b + 1 of row n over a pair's lanes; kGroup32: they are adjacent.
template <bool kPair, bool kGroup32>
PAGEDLLM_VNNI __m256 pair_scale_vnni(const Weight& w, int64_t n, int64_t b) {
  if (kPair && kGroup32) {
    const __m128d two = _mm_load_sd(reinterpret_cast<const double*>(w.scale + n * w.groups + b));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(two)),
                                    _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
  }
  return PAGEDLLM_SPREAD(w.block_scale(n, b), kPair ? w.block_scale(n, b + 1) : 0.f);
}

template <int M, int R, bool kPair, bool kGroup32>
PAGEDLLM_VNNI void int4_step_vnni(const Weight& w, const RoundedX& x, int64_t n0, int64_t r0,
                                  int64_t b, __m256 (&acc)[R][M]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256i low[R], high[R];
  __m256 scale[R];
  for (int t = 0; t < R; ++t) {
    const uint8_t* src = w.block(n0 + t, b);
    const __m256i bytes = kPair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                                : _mm256_zextsi128_si256(
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    low[t] = _mm256_and_si256(bytes, mask);
    high[t] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    scale[t] = pair_scale_vnni<kPair, kGroup32>(w, n0 + t, b);
  }
  for (int r = 0; r < M; ++r) {
    const int8_t* xp = x.pair(r0 + r, b);
    const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
    const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + kBlock));
    const __m256 step = _mm256_loadu_ps(x.step_pair(r0 + r, b));
    for (int t = 0; t < R; ++t) {
      const __m256i dot = _mm256_dpbusd_epi32(
          _mm256_dpbusd_epi32(_mm256_setzero_si256(), low[t], xl), high[t], xh);
      acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale[t], step),
                                  acc[t][r]);
    }
  }
}

// int8, R weight rows x M rows of x over block b: vpdpbusd multiplies u8 by s8, so |w| meets x
// with w's sign.
template <int M, int R>
PAGEDLLM_VNNI void int8_step_vnni(const Weight& w, const RoundedX& x, int64_t n0, int64_t r0,
                                  int64_t b, __m256 (&acc)[R][M]) {
  __m256i magnitude[R];
  __mmask32 negative[R];
  float scale[R];
  for (int t = 0; t < R; ++t) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.block(n0 + t, b)));
    magnitude[t] = _mm256_abs_epi8(codes);
    negative[t] = _mm256_movepi8_mask(codes);
    scale[t] = w.block_scale(n0 + t, b);
  }
  const __m256i zero = _mm256_setzero_si256();
  for (int r = 0; r < M; ++r) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.block(r0 + r, b)));
    const float step = x.block_step(r0 + r, b);
    for (int t = 0; t < R; ++t) {
      const __m256i dot =
          _mm256_dpbusd_epi32(zero, magnitude[t], _mm256_mask_sub_epi8(xv, negative[t], zero, xv));
      acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[t] * step),
                                  acc[t][r]);
    }
  }
}

template <int M, int R>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"))) void tile_vnni(
    const Weight& w, const RoundedX& x, int64_t n0, int64_t r0, float* y) {
  __m256 acc[R][M];
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r) acc[t][r] = _mm256_setzero_ps();
  int64_t b = 0;
  if (w.int4 && w.group == kBlock) {
    for (; b + 2 <= x.blocks; b += 2) int4_step_vnni<M, R, true, true>(w, x, n0, r0, b, acc);
    if (b < x.blocks) int4_step_vnni<M, R, false, true>(w, x, n0, r0, b, acc);
  } else if (w.int4) {
    for (; b + 2 <= x.blocks; b += 2) int4_step_vnni<M, R, true, false>(w, x, n0, r0, b, acc);
    if (b < x.blocks) int4_step_vnni<M, R, false, false>(w, x, n0, r0, b, acc);
  } else {
    for (; b < x.blocks; ++b) int8_step_vnni<M, R>(w, x, n0, r0, b, acc);
  }
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r)
      y[(r0 + r) * w.n + n0 + t] = hsum256(acc[t][r]) + offset_term(w, x, n0 + t, r0 + r);
}

// ---- AVX2: vpmaddubsw + vpmaddwd for the u8 x s8 dot products --------------------------------
#define PAGEDLLM_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline

PAGEDLLM_AVX2 __m256i dot_avx2(__m256i u, __m256i s) {  // sums of 4 u8 x s8 products
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

template <int M, int R, bool kPair>
PAGEDLLM_AVX2 void int4_step_avx2(const Weight& w, const RoundedX& x, int64_t n0, int64_t r0,
                                  int64_t b, __m256 (&acc)[R][M]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256i low[R], high[R];
  __m256 scale[R];
  for (int t = 0; t < R; ++t) {
    const uint8_t* src = w.block(n0 + t, b);
    const __m256i bytes =
        kPair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
              : _mm256_set_m128i(_mm_setzero_si128(),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    low[t] = _mm256_and_si256(bytes, mask);
    high[t] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    scale[t] = PAGEDLLM_SPREAD(w.block_scale(n0 + t, b), kPair ? w.block_scale(n0 + t, b + 1) : 0.f);
  }
  for (int r = 0; r < M; ++r) {
    const int8_t* xp = x.pair(r0 + r, b);
    const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
    const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + kBlock));
    const __m256 step = _mm256_loadu_ps(x.step_pair(r0 + r, b));
    for (int t = 0; t < R; ++t) {
      const __m256i dot = _mm256_add_epi32(dot_avx2(low[t], xl), dot_avx2(high[t], xh));
      acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale[t], step),
                                  acc[t][r]);
    }
  }
}

template <int M, int R>
PAGEDLLM_AVX2 void int8_step_avx2(const Weight& w, const RoundedX& x, int64_t n0, int64_t r0,
                                  int64_t b, __m256 (&acc)[R][M]) {
  __m256i codes[R], magnitude[R];
  float scale[R];
  for (int t = 0; t < R; ++t) {
    codes[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.block(n0 + t, b)));
    magnitude[t] = _mm256_sign_epi8(codes[t], codes[t]);  // |w| (-128 stays 0x80 = 128)
    scale[t] = w.block_scale(n0 + t, b);
  }
  for (int r = 0; r < M; ++r) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.block(r0 + r, b)));
    const float step = x.block_step(r0 + r, b);
    for (int t = 0; t < R; ++t) {
      const __m256i dot = dot_avx2(magnitude[t], _mm256_sign_epi8(xv, codes[t]));
      acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[t] * step),
                                  acc[t][r]);
    }
  }
}

template <int M, int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const Weight& w, const RoundedX& x,
                                                   int64_t n0, int64_t r0, float* y) {
  __m256 acc[R][M];
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r) acc[t][r] = _mm256_setzero_ps();
  int64_t b = 0;
  if (w.int4) {
    for (; b + 2 <= x.blocks; b += 2) int4_step_avx2<M, R, true>(w, x, n0, r0, b, acc);
    if (b < x.blocks) int4_step_avx2<M, R, false>(w, x, n0, r0, b, acc);
  } else {
    for (; b < x.blocks; ++b) int8_step_avx2<M, R>(w, x, n0, r0, b, acc);
  }
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r)
      y[(r0 + r) * w.n + n0 + t] = hsum256(acc[t][r]) + offset_term(w, x, n0 + t, r0 + r);
}

// ---- 16-bit x: s16 x s16 pairs (vpmaddwd; vpdpwssd with VNNI), codes widened to 16 bits ------
// 16 codes of block b of row n widened to int16: the first (j = 0) or second (j = 1) half of
// the block's features.
PAGEDLLM_AVX2 void wide_codes_avx2(const Weight& w, int64_t n, int64_t b, __m256i out[2]) {
  const uint8_t* src = w.block(n, b);
  if (w.int4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i mask = _mm_set1_epi8(0x0F);
    out[0] = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
    out[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
  } else {
    out[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    out[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
  }
}

template <int M, int R>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"))) void tile16_vnni(
    const Weight& w, const RoundedX16& x, int64_t n0, int64_t r0, float* y) {
  __m256 acc[R][M];
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m256i codes[R][2];
    float scale[R];
    for (int t = 0; t < R; ++t) {
      wide_codes_avx2(w, n0 + t, b, codes[t]);
      scale[t] = w.block_scale(n0 + t, b);
    }
    for (int r = 0; r < M; ++r) {
      const int16_t* xq = x.block(r0 + r, b);
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
      const float step = x.block_step(r0 + r, b);
      for (int t = 0; t < R; ++t) {
        const __m256i dot = _mm256_dpwssd_epi32(
            _mm256_dpwssd_epi32(_mm256_setzero_si256(), codes[t][0], x0), codes[t][1], x1);
        acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[t] * step),
                                    acc[t][r]);
      }
    }
  }
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r)
      y[(r0 + r) * w.n + n0 + t] = hsum256(acc[t][r]) + offset_term(w, x, n0 + t, r0 + r);
}

template <int M, int R>
__attribute__((target("avx2,fma"))) void tile16_avx2(const Weight& w, const RoundedX16& x,
                                                     int64_t n0, int64_t r0, float* y) {
  __m256 acc[R][M];
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m256i codes[R][2];
    float scale[R];
    for (int t = 0; t < R; ++t) {
      wide_codes_avx2(w, n0 + t, b, codes[t]);
      scale[t] = w.block_scale(n0 + t, b);
    }
    for (int r = 0; r < M; ++r) {
      const int16_t* xq = x.block(r0 + r, b);
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
      const float step = x.block_step(r0 + r, b);
      for (int t = 0; t < R; ++t) {
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(codes[t][0], x0),
                                             _mm256_madd_epi16(codes[t][1], x1));
        acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[t] * step),
                                    acc[t][r]);
      }
    }
  }
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r)
      y[(r0 + r) * w.n + n0 + t] = hsum256(acc[t][r]) + offset_term(w, x, n0 + t, r0 + r);
}

#define PAGEDLLM_TILE_M(fn, R, m, ...)     \
  switch (m) {                              \
    case 1: fn<1, R>(__VA_ARGS__); break;   \
    case 2: fn<2, R>(__VA_ARGS__); break;   \
    case 3: fn<3, R>(__VA_ARGS__); break;   \
    default: fn<4, R>(__VA_ARGS__); break;  \
  }

// The tile for R weight rows at n and rows [r0, r0 + mr) of x.
template <int R>
void tiles(Isa i, const Weight& w, const RoundedX& x, int64_t n, int64_t r0, int mr, float* y) {
  if (i == Isa::kAvx512Vnni) {
    PAGEDLLM_TILE_M(tile_vnni, R, mr, w, x, n, r0, y)
  } else {
    PAGEDLLM_TILE_M(tile_avx2, R, mr, w, x, n, r0, y)
  }
}

template <int R>
void tiles(Isa i, const Weight& w, const RoundedX16& x, int64_t n, int64_t r0, int mr,
           float* y) {
  if (i == Isa::kAvx512Vnni) {
    PAGEDLLM_TILE_M(tile16_vnni, R, mr, w, x, n, r0, y)
  } else {
    PAGEDLLM_TILE_M(tile16_avx2, R, mr, w, x, n, r0, y)
  }
}

// Weight rows [n0, n1) for every row of x: 4 weight rows per pass for up to two rows of x,
// 2 for more (their accumulators fill the registers).
template <typename X>
void rows_simd(Isa i, const Weight& w, const X& x, int64_t n0, int64_t n1, float* y) {
  for (int64_t r0 = 0; r0 < x.m; r0 += kTileM) {
    const int mr = int(std::min<int64_t>(kTileM, x.m - r0));
    int64_t n = n0;
    if (mr <= 2)
      for (; n + 4 <= n1; n += 4) tiles<4>(i, w, x, n, r0, mr, y);
    for (; n + 2 <= n1; n += 2) tiles<2>(i, w, x, n, r0, mr, y);
    for (; n < n1; ++n) tiles<1>(i, w, x, n, r0, mr, y);
  }
}
#endif

template <typename X>
void rows(Isa i, const Weight& w, const X& x, int64_t n0, int64_t n1, float* y) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  if (i != Isa::kScalar) return rows_simd(i, w, x, n0, n1, y);
#endif
  rows_scalar(w, x, n0, n1, y);
}

// y [M, N] from x rounded to X's codes, split over the threads by groups of 4 weight rows,
// each task streaming at least ~32 KiB of weight.
template <typename X>
void integer_product(Isa i, const Weight& w, const float* xf, int64_t m, float* y) {
  const X x(xf, m, w.k, w.group, w.int4 && i != Isa::kScalar);
  const int64_t quads = (w.n + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (4 * w.row_bytes()));
  at::parallel_for(0, quads, grain, [&](int64_t p0, int64_t p1) {
    rows(i, w, x, p0 * 4, std::min(w.n, p1 * 4), y);
  });
}

// ---- many rows: dequantized slabs and ATen's GEMM -----------------------------------------------
#if PAGEDLLM_X86 && defined(__GNUC__)
// Rows [n0, n1) as fp32, 8 lanes at a time (the slab path's cost beside its GEMM).
__attribute__((target("avx2,fma"))) void dequantize_rows_avx2(const Weight& w, int64_t n0,
                                                              int64_t n1, float* out) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < w.k / kBlock; ++b) {
      const uint8_t* src = w.block(n, b);
      const int64_t g = n * w.groups + w.group_of[b];
      const __m256 s = _mm256_set1_ps(w.scale[g]);
      float* dst = out + (n - n0) * w.k + b * kBlock;
      if (w.int4) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        const __m128i low = _mm_and_si128(bytes, mask);
        const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        const __m256 off = _mm256_set1_ps(w.offset[g]);
        const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_ps(dst + 8 * i, _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), s, off));
      } else {
        for (int i = 0; i < 4; ++i) {
          const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i));
          _mm256_storeu_ps(dst + 8 * i,
                           _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s));
        }
      }
    }
}

// The same rows straight into bf16 (AVX-512 BF16's rounding to nearest even, as ATen's
// conversion does), for a bf16 x: no fp32 tile to convert.
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bf16"))) void dequantize_rows_bf16(
    const Weight& w, int64_t n0, int64_t n1, at::BFloat16* out) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < w.k / kBlock; ++b) {
      const uint8_t* src = w.block(n, b);
      const int64_t g = n * w.groups + w.group_of[b];
      const __m256 s = _mm256_set1_ps(w.scale[g]);
      __m256 v[4];
      if (w.int4) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        const __m128i low = _mm_and_si128(bytes, mask);
        const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        const __m256 off = _mm256_set1_ps(w.offset[g]);
        const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
        for (int i = 0; i < 4; ++i)
          v[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), s, off);
      } else {
        for (int i = 0; i < 4; ++i) {
          const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i));
          v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s);
        }
      }
      at::BFloat16* dst = out + (n - n0) * w.k + b * kBlock;
      for (int i = 0; i < 4; ++i)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8 * i),
                         reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(v[i])));
    }
}

bool cpu_has_bf16() {
  __builtin_cpu_init();
  return cpu_runs(Isa::kAvx2) && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("avx512vl");
}
#endif

void dequantize_rows(const Weight& w, int64_t n0, int64_t n1, float* out) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  if (cpu_runs(Isa::kAvx2)) return dequantize_rows_avx2(w, n0, n1, out);
#endif
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < w.k / kBlock; ++b) {
      const uint8_t* src = w.block(n, b);
      const int64_t g = n * w.groups + w.group_of[b];
      const float s = w.scale[g];
      float* dst = out + (n - n0) * w.k + b * kBlock;
      if (w.int4) {
        const float off = w.offset[g];
        for (int j = 0; j < kBlock / 2; ++j) {
          dst[j] = float(src[j] & 0xF) * s + off;
          dst[j + kBlock / 2] = float(src[j] >> 4) * s + off;
        }
      } else {
        for (int j = 0; j < kBlock; ++j) dst[j] = float(int8_t(src[j])) * s;
      }
    }
}

at::Tensor slab_linear(const at::Tensor& x, const Weight& w) {
  at::Tensor y = at::empty({x.size(0), w.n}, x.options());
  const int64_t step = std::max<int64_t>(16, kSlabElements / w.k);
#if PAGEDLLM_X86 && defined(__GNUC__)
  static const bool bf16_tiles = cpu_has_bf16();
#else
  constexpr bool bf16_tiles = false;
#endif
  const bool direct = bf16_tiles && x.scalar_type() == at::kBFloat16;
  at::Tensor tile = at::empty({std::min(step, w.n), w.k},
                              x.options().dtype(direct ? at::kBFloat16 : at::kFloat));
  for (int64_t start = 0; start < w.n; start += step) {
    const int64_t stop = std::min(w.n, start + step);
    at::parallel_for(start, stop, 16, [&](int64_t a, int64_t b) {
#if PAGEDLLM_X86 && defined(__GNUC__)
      if (direct)
        return dequantize_rows_bf16(w, a, b, tile.data_ptr<at::BFloat16>() + (a - start) * w.k);
#endif
      dequantize_rows(w, a, b, tile.data_ptr<float>() + (a - start) * w.k);
    });
    at::Tensor slab = tile.narrow(0, 0, stop - start);
    if (!direct) slab = slab.to(x.scalar_type());
    if (stop - start == w.n) return at::mm(x, slab.t());  // the whole weight in one slab
    y.narrow(1, start, stop - start).copy_(at::mm(x, slab.t()));
  }
  return y;
}

// ---- the op ------------------------------------------------------------------------------------
at::Tensor weight_only_linear(const at::Tensor& x, const at::Tensor& qweight,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                              int64_t bits, const c10::optional<at::Tensor>& bias,
                              const c10::optional<std::string>& force_isa, int64_t x_bits) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16");
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(x_bits == 8 || x_bits == 16, "x_bits must be 8 or 16");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be contiguous 2-D");
  TORCH_CHECK(bits == 8 ? qweight.scalar_type() == at::kChar : qweight.scalar_type() == at::kByte,
              "qweight must be int8 (bits 8) or uint8 (bits 4)");
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "scale must be contiguous float32 [N, groups]");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * (bits == 4 ? 2 : 1) == k, "qweight does not match K = ", k);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(scale.size(0) == n && scale.size(1) > 0 && k % scale.size(1) == 0,
              "scale must be [N, K / group]");
  const int64_t group = k / scale.size(1);
  TORCH_CHECK(group % kBlock == 0, "group size must be a multiple of 32, got ", group);
  TORCH_CHECK(bits == 8 || offset.has_value(), "int4 needs an offset tensor");
  if (offset.has_value())
    TORCH_CHECK(offset->sizes() == scale.sizes() && offset->scalar_type() == at::kFloat &&
                    offset->is_contiguous(),
                "offset must be float32 like scale");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == n && bias->is_contiguous()),
              "bias must be contiguous [N]");
  const Isa i = force_isa.has_value() ? isa_from_name(*force_isa) : best_isa();
  TORCH_CHECK(cpu_runs(i), "this CPU does not run ", isa_name(i));

  const Weight w{reinterpret_cast<const uint8_t*>(qweight.data_ptr()), scale.data_ptr<float>(),
                 bits == 4 ? offset->data_ptr<float>() : nullptr, n, k, group, bits == 4};
  at::Tensor y;
  if (m > kKernelMaxRows) {
    y = slab_linear(x.contiguous(), w);
  } else {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    y = at::empty({m, n}, xf.options());
    if (m > 0 && n > 0) {
      if (x_bits == 16)
        integer_product<RoundedX16>(i, w, xf.data_ptr<float>(), m, y.data_ptr<float>());
      else
        integer_product<RoundedX>(i, w, xf.data_ptr<float>(), m, y.data_ptr<float>());
    }
    if (bias.has_value()) y.add_(bias->to(at::kFloat));  // in fp32, before the cast
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  }
  if (bias.has_value()) y.add_(bias->to(y.scalar_type()));
  return y;
}

std::string isa() { return isa_name(best_isa()); }

bool runs(const std::string& name) { return cpu_runs(isa_from_name(name)); }

int64_t kernel_max_rows() { return kKernelMaxRows; }

}  // namespace

TORCH_LIBRARY(pagedllm_wo, m) {
  m.def(
      "weight_only_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? offset, int bits, "
      "Tensor? bias, str? isa=None, int x_bits=16) -> Tensor",
      &weight_only_linear);
  m.def("isa() -> str", &isa);
  m.def("runs(str isa) -> bool", &runs);
  m.def("kernel_max_rows() -> int", &kernel_max_rows);
}
