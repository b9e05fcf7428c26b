// Weight-only int8 / int4 products: y[M, N] = x[M, K] . W[N, K]^T
//
// The weight stays quantized in memory, in groups of G input features (G a multiple of 32)
// with one scale (and, for int4, one offset) per output row and group, fp32, or fp16 as a GGUF
// file stores them (kept so: the weight's bytes are the file's, and at one row of x the
// product streams them from memory):
//   int8: W[n, k] = scale[n, k / G] * q[n, k],                       q int8
//   int4: W[n, k] = scale[n, k / G] * q[n, k] + offset[n, k / G],     q in [0, 15]
// int4 codes are two per byte in blocks of 32 features: byte j of a block holds feature j in
// its low nibble and feature j + 16 in its high nibble (the order of GGUF's Q4_0 / Q4_1
// blocks, so those repack by copying bytes).
//
// Up to kKernelMaxRows rows of x (decode; kSliceMinRows on AVX2): each 32-feature block is
// unpacked to fp32 in registers, scaled there, and multiplied into every row of x (up to kTileM
// rows per pass over the weight), so x stays exact and no dequantized copy of the weight is
// written. More rows (prefill, large decode batches): on AVX2 each thread dequantizes a slice of
// weight rows into an fp32 scratch that stays in L2 and runs every row of x against it with its
// own tile (a layer whose x is rounded to int8 for its few rows: the codes widened to int16
// against x rounded to int16, past those rows); elsewhere a slab of output rows at a time is
// dequantized into a scratch tile (straight into bf16 for a bf16 x where the CPU converts
// natively) and multiplied with ATen's GEMM in x's dtype.
//
// The instruction set (AVX-512, AVX2 + FMA + F16C, portable C++) is picked at run time, each
// compiled with its own target attribute, so one build serves any x86 CPU. Sums run in fp32
// in a fixed order per instruction set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "balanced_for.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGEDLLM_X86 1
#else
#define PAGEDLLM_X86 0
#endif

namespace {

constexpr int kBlock = 32;  // features per unpacked block
constexpr int kTileM = 4;   // rows of x per pass over a weight row pair
constexpr int64_t kKernelMaxRows = 16;      // beyond this the slab path (GEMM) is faster
constexpr int64_t kSliceMinRows = 8;        // AVX2: beyond this the slices are faster
constexpr int64_t kSlabElements = 1 << 22;  // weights dequantized per slab (16 MiB fp32)

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

bool cpu_runs(Isa i) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  __builtin_cpu_init();
  switch (i) {
    case Isa::kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    default: return true;
  }
#else
  return i == Isa::kScalar;
#endif
}

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

Isa best_isa() {
  static const Isa value = [] {
    for (Isa i : {Isa::kAvx512, Isa::kAvx2})
      if (cpu_runs(i)) return i;
    return Isa::kScalar;
  }();
  return value;
}

Isa isa_from_name(const std::string& name) {
  for (Isa i : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512})
    if (name == isa_name(i)) return i;
  TORCH_CHECK(false, "unknown instruction set ", name);
}

// A weight's scales or offsets [N, K / G]: fp32 or fp16.
struct Constants {
  const void* data = nullptr;
  bool half = false;

  const float* f32() const { return static_cast<const float*>(data); }
  const uint16_t* f16() const { return static_cast<const uint16_t*>(data); }
  int64_t bytes() const { return half ? 2 : 4; }
  const char* address(int64_t i) const { return static_cast<const char*>(data) + i * bytes(); }
  float at(int64_t i) const {  // portable C++
    return half ? float(c10::Half(f16()[i], c10::Half::from_bits())) : f32()[i];
  }
};

// The operands of one call, as raw pointers.
struct Operands {
  const float* x;        // [M, K]
  const uint8_t* q;      // int8: [N, K] bytes; int4: [N, K / 2] bytes
  Constants scale;       // [N, K / G]
  Constants offset;      // [N, K / G] (int4); data nullptr for int8
  int64_t m, n, k, group;
  bool int4;
  int64_t groups;            // K / G
  const int32_t* group_of;   // [K / 32]: each block's group (no division in the loops)

  const uint8_t* block(int64_t row, int64_t b) const {
    return q + row * (int4 ? k / 2 : k) + b * (int4 ? kBlock / 2 : kBlock);
  }
};

// ---- scalar ----------------------------------------------------------------------------------
// One block's 32 weights of row n as fp32 (the reference every path matches in value).
void unpack_scalar(const Operands& o, int64_t n, int64_t b, float* w) {
  const int64_t g = o.group_of[b], groups = o.groups;
  const float s = o.scale.at(n * groups + g);
  if (o.int4) {
    const uint8_t* src = o.block(n, b);
    const float off = o.offset.at(n * groups + g);
    for (int j = 0; j < kBlock / 2; ++j) {
      w[j] = float(src[j] & 0xF) * s + off;
      w[j + kBlock / 2] = float(src[j] >> 4) * s + off;
    }
  } else {
    const int8_t* src = reinterpret_cast<const int8_t*>(o.block(n, b));
    for (int j = 0; j < kBlock; ++j) w[j] = float(src[j]) * s;
  }
}

void rows_scalar(const Operands& o, int64_t n0, int64_t n1, float* y) {
  float w[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < o.m; ++r) y[r * o.n + n] = 0.f;
    for (int64_t b = 0; b < o.k / kBlock; ++b) {
      unpack_scalar(o, n, b, w);
      for (int64_t r = 0; r < o.m; ++r) {
        const float* xr = o.x + r * o.k + b * kBlock;
        float s = 0.f;
        for (int j = 0; j < kBlock; ++j) s += xr[j] * w[j];
        y[r * o.n + n] += s;
      }
    }
  }
}

#if PAGEDLLM_X86 && defined(__GNUC__)
// One constant with F16C's conversion (every AVX2 CPU has it).
__attribute__((target("f16c"))) inline float constant(const Constants& c, int64_t i) {
  return c.half ? _cvtsh_ss(c.f16()[i]) : c.f32()[i];
}

// ---- AVX-512: a block is two 16-lane vectors ----------------------------------------------
__attribute__((target("avx512f,avx512bw,f16c"))) inline void unpack_avx512(const Operands& o,
                                                                           int64_t n, int64_t b,
                                                                           __m512& lo, __m512& hi) {
  const int64_t groups = o.groups, g = o.group_of[b];
  const __m512 s = _mm512_set1_ps(constant(o.scale, n * groups + g));
  if (o.int4) {
    const __m128i bytes = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(o.block(n, b)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m512 off = _mm512_set1_ps(constant(o.offset, n * groups + g));
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), s, off);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), s, off);
  } else {
    const int8_t* src = reinterpret_cast<const int8_t*>(o.block(n, b));
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), s);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), s);
  }
}

// R weight rows x M rows of x; each unpacked block serves all M rows. The two halves of a
// block accumulate apart, so R x M x 2 independent FMA chains hide the FMA latency.
template <int M, int R>
__attribute__((target("avx512f,avx512bw,f16c"))) void tile_avx512(const Operands& o, int64_t n0,
                                                                  int64_t r0, float* y) {
  __m512 acc[R][M][2];
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r) acc[t][r][0] = acc[t][r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < o.k / kBlock; ++b) {
    for (int t = 0; t < R; ++t) {
      __m512 lo, hi;
      unpack_avx512(o, n0 + t, b, lo, hi);
      for (int r = 0; r < M; ++r) {
        const float* xr = o.x + (r0 + r) * o.k + b * kBlock;
        acc[t][r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), lo, acc[t][r][0]);
        acc[t][r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), hi, acc[t][r][1]);
      }
    }
  }
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r)
      y[(r0 + r) * o.n + n0 + t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][r][0], acc[t][r][1]));
}

// ---- AVX2: a block is four 8-lane vectors ---------------------------------------------------
__attribute__((target("avx2,fma,f16c"))) inline void unpack_avx2(const Operands& o, int64_t n,
                                                                 int64_t b, __m256 w[4]) {
  const int64_t groups = o.groups, g = o.group_of[b];
  const __m256 s = _mm256_set1_ps(constant(o.scale, n * groups + g));
  if (o.int4) {
    const __m128i bytes = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(o.block(n, b)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 off = _mm256_set1_ps(constant(o.offset, n * groups + g));
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), s, off);
  } else {
    const int8_t* src = reinterpret_cast<const int8_t*>(o.block(n, b));
    for (int i = 0; i < 4; ++i) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s);
    }
  }
}

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int M, int R>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const Operands& o, int64_t n0, int64_t r0,
                                                        float* y) {
  __m256 acc[R][M][2];
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r) acc[t][r][0] = acc[t][r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < o.k / kBlock; ++b) {
    for (int t = 0; t < R; ++t) {
      __m256 w[4];
      unpack_avx2(o, n0 + t, b, w);
      for (int r = 0; r < M; ++r) {
        const float* xr = o.x + (r0 + r) * o.k + b * kBlock;
        for (int i = 0; i < 4; ++i)
          acc[t][r][i & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * i), w[i], acc[t][r][i & 1]);
      }
    }
  }
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < M; ++r)
      y[(r0 + r) * o.n + n0 + t] = hsum_avx2(_mm256_add_ps(acc[t][r][0], acc[t][r][1]));
}

#define PAGEDLLM_TILE_M(fn, R, m, ...)     \
  switch (m) {                              \
    case 1: fn<1, R>(__VA_ARGS__); break;   \
    case 2: fn<2, R>(__VA_ARGS__); break;   \
    case 3: fn<3, R>(__VA_ARGS__); break;   \
    default: fn<4, R>(__VA_ARGS__); break;  \
  }

template <int R>
void tiles(Isa i, const Operands& o, int64_t n, int64_t r0, int mr, float* y) {
  if (i == Isa::kAvx512) {
    PAGEDLLM_TILE_M(tile_avx512, R, mr, o, n, r0, y)
  } else {
    PAGEDLLM_TILE_M(tile_avx2, R, mr, o, n, r0, y)
  }
}

// Weight rows [n0, n1) for every row of x: 4 weight rows per pass for one row of x (decode),
// 2 for more (their accumulators fill the registers).
void rows_simd(Isa i, const Operands& o, int64_t n0, int64_t n1, float* y) {
  for (int64_t r0 = 0; r0 < o.m; r0 += kTileM) {
    const int mr = int(std::min<int64_t>(kTileM, o.m - r0));
    int64_t n = n0;
    if (mr == 1)
      for (; n + 4 <= n1; n += 4) tiles<4>(i, o, n, r0, mr, y);
    for (; n + 2 <= n1; n += 2) tiles<2>(i, o, n, r0, mr, y);
    for (; n < n1; ++n) tiles<1>(i, o, n, r0, mr, y);
  }
}
#endif

void rows(Isa i, const Operands& o, int64_t n0, int64_t n1, float* y) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  if (i != Isa::kScalar) return rows_simd(i, o, n0, n1, y);
#endif
  rows_scalar(o, n0, n1, y);
}

#if PAGEDLLM_X86 && defined(__GNUC__)
// ---- int8 activations (AVX2): x rounded to int8 per block of 32 ------------------------------
// Weights by rows (a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks: groups of 32; any group a multiple
// of 32) on a few rows of x, isa "int8" / "int8_residual": each row of x becomes int8 codes per
// block of 32 with the scale max|x| / 127 (llama.cpp's q8_1), and a block's integer product
// with the weight's codes comes from maddubs (int4 codes are unsigned; int8 ones lend x their
// sign). Eight blocks' integer sums are gathered into one vector before they meet their
// scales, so the float work is an eighth of a block's (groups wider than a block: the groups
// the eight blocks span, spread to them by a permute, constants8). The int4 offsets meet the
// rounded x's block sums, so their rounding errors cancel as in x w. "int8_residual" runs each
// row as two int8 parts, x rounded and what the rounding left (fp32 x's accuracy, as the
// AVX-512 panels' residual form), both against one load of the codes, into one sum; int8 codes
// take x on int16 instead (the same accuracy at half the multiplies, int16_x_linear below).
//
// For int4 codes x is stored by pairs of blocks, so that one 32-byte load of codes serves two
// blocks: its low nibbles are features 0-15 of both, its high nibbles features 16-31, and x's
// pair holds [a 0-15 | b 0-15 | a 16-31 | b 16-31]. The pair's sums then land as a's in the low
// lane and b's in the high one, and eight blocks' totals come out in the order 0 2 4 6 1 3 5 7,
// which x's block constants are stored in and the weight's are permuted to.
// Rows of x on int8 at most: "int8" 4, as the AVX-512 panels (at 8-16 rows it is 1.5x the fp32
// x path on SmolLM2's products, a 2-core Zen 3, but a short prompt's prefill on int8 x turns
// SmolLM2's answer to "What is the capital of France?" away from "Paris"); "int8_residual" 2.
// Past them both forms take the int16 slices (the residual form's int8 codes at 4 rows
// 1.12-1.39x the fp32 kernel by rows it took before, at 3 rows 0.97-1.18x, on SmolLM2's and
// the 125M model's shapes, a 2-core Zen 3).
constexpr int64_t kInt8MaxRows = 4, kResidualMaxRows = 2;
constexpr int64_t kAhead = 4;  // passes a prefetch runs ahead (int8_x_linear)

struct RoundedX {
  const int8_t* q;   // [rows, parts, padded * 32] (int4: by pairs of blocks)
  const float* sx;   // [rows, parts, padded]: the block's scale, zero past the last block
  const float* sum;  // [rows, parts, padded]: sx times the block's code sum (int4 offsets)
  int64_t parts, padded;
};

// A block of 32 features of x into v, and its largest |x|.
__attribute__((target("avx2,fma"), always_inline)) inline float block_max_avx2(const float* x,
                                                                              __m256 (&v)[4]) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// One row x [k] -> codes, scales and scaled code sums; rest (when not null) takes what the
// rounding left, the next part's x. pairs: int4's order of codes and constants (above).
__attribute__((target("avx2,fma"))) void round_row_avx2(const float* x, int64_t k, bool pairs,
                                                        int8_t* q, float* sx, float* sum,
                                                        float* rest) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4];
    const float top = block_max_avx2(x + b * kBlock, v), scale = top / 127.0f;
    const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i c[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {  // rounded to nearest even, |code| <= 127
      c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      total = _mm256_add_epi32(total, c[i]);
      if (rest != nullptr)
        _mm256_storeu_ps(rest + b * kBlock + 8 * i,
                         _mm256_fnmadd_ps(_mm256_cvtepi32_ps(c[i]), _mm256_set1_ps(scale), v[i]));
    }
    // the 32 codes as bytes in feature order: the packs interleave the 128-bit lanes' 4-code
    // runs, the permutation puts them back (a loop of 32 byte stores took 4 cycles a feature)
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // int4: block b of its pair p = b / 2 at bytes 64 p + 16 (b % 2) (features 0-15) and
    // 64 p + 32 + 16 (b % 2) (16-31); its constants at 8 (b / 8) + {0 2 4 6 1 3 5 7}[b % 8]
    if (pairs) {
      int8_t* dst = q + (b / 2) * 64 + (b % 2) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(bytes));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32), _mm256_extracti128_si256(bytes, 1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), bytes);
    }
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    sum4 = _mm_hadd_epi32(sum4, sum4);
    const int32_t s = _mm_cvtsi128_si32(_mm_hadd_epi32(sum4, sum4));
    const int64_t at = pairs ? b / 8 * 8 + (b % 8) / 2 + (b % 2) * 4 : b;
    sx[at] = scale;
    sum[at] = scale * float(s);
  }
}

// Four pairs of blocks (int4) or eight blocks (int8) of one weight row against P parts of x:
// each part's eight block totals (int4 in pair order) in t[p]. Inlined where count is 8, so a
// whole group runs without a branch.
//
// int4: a pair's two maddubs make 16 int16 sums, each <= 2 * 2 * 15 * 127 = 7620. Two levels
// of hadd_epi16 over the four pairs keep them in int16 (<= 30480) and leave each block's sum in
// two lanes, which one madd with ones widens to int32: one madd a group where a madd a pair and
// three hadd_epi32 took a fifth more time (vpmaddubsw and vpmaddwd share the same two pipes on
// Zen 3, two of them a cycle). int8 codes lend x their sign, so a lane reaches 2 * 127 * 127:
// they widen each block at once.
template <bool kInt4, int P>
__attribute__((target("avx2,fma"), always_inline)) inline void totals8_avx2(
    const uint8_t* w, const int8_t* x, int64_t stride, int count, __m256i (&t)[P]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kInt4) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256i v[P][4];
    for (int j = 0; j < 4; ++j) {
      if (2 * j >= count) {
        for (int p = 0; p < P; ++p) v[p][j] = _mm256_setzero_si256();
        continue;
      }
      // a last pair of one block reads its 16 bytes only (x is zero for the missing one)
      const __m256i c =
          2 * j + 1 < count
              ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j))
              : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 32 * j)));
      const __m256i lo = _mm256_and_si256(c, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
      for (int p = 0; p < P; ++p) {
        const int8_t* xp = x + p * stride + 64 * j;
        v[p][j] = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp))),
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32))));
      }
    }
    for (int p = 0; p < P; ++p)
      t[p] = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(v[p][0], v[p][1]),
                                                 _mm256_hadd_epi16(v[p][2], v[p][3])),
                               ones);
  } else {
    __m256i v[P][8];
    for (int j = 0; j < 8; ++j) {
      if (j >= count) {
        for (int p = 0; p < P; ++p) v[p][j] = _mm256_setzero_si256();
        continue;
      }
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      const __m256i magnitude = _mm256_abs_epi8(c);
      for (int p = 0; p < P; ++p) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + p * stride + 32 * j));
        v[p][j] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, c)), ones);
      }
    }
    for (int p = 0; p < P; ++p) {
      const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[p][0], v[p][1]),
                                          _mm256_hadd_epi32(v[p][2], v[p][3]));
      const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[p][4], v[p][5]),
                                          _mm256_hadd_epi32(v[p][6], v[p][7]));
      t[p] = _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                              _mm256_permute2x128_si256(a, b, 0x31));
    }
  }
}

// fp16 constants of blocks [b, b + count) (count <= 8) of the weight row whose constants begin
// at src, one at a time (constants8's rare case: a wider group, the weight's last row). In
// registers: eight stores and a load of them would stall the load.
__attribute__((noinline)) __m128i half_constants(const Operands& o, const uint16_t* src,
                                                 int64_t b, int count) {
  auto at = [&](int j) { return j < count ? short(src[o.group_of[b + j]]) : short(0); };
  return _mm_setr_epi16(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
}

// Eight blocks' constants from block b on (count of them; 0 past those), of the weight row
// whose constants begin at `row`, in the order of their totals. A group a block: a masked load
// of fp32 (the weight's constants past its last block are never read); of fp16, a load of
// eight (the next row's past this row's last block, masked off) and their conversion. A wider
// group (the int8 format's one group a row, the int4 method's groups of 64 or 128): the eight
// or fewer groups the blocks span, loaded the same way from the first block's group on and
// spread to their blocks by a permute. A gather of each block's group took as long as the
// rest of a one-row int8 product's block on a Zen 3. kWide (o.group > kBlock) is the kernels'
// template argument, so that a group a block's loops carry none of the wider groups' work
// (with both in one loop, a GGUF file's Q8_0 layers ran 4-8% slower at 1-4 rows).
template <bool kHalf, bool kWide>
__attribute__((target("avx2,fma,f16c"))) inline __m256 constants8(const Operands& o,
                                                                  const Constants& c, int64_t row,
                                                                  int64_t b, int count,
                                                                  __m256i lanes, __m256i order) {
  if constexpr (!kWide) {
    if constexpr (kHalf) {
      const uint16_t* src = c.f16() + row;
      const __m128i bits = row + b + 8 <= o.n * o.groups
                               ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + b))
                               : half_constants(o, src, b, count);
      const __m256 v = _mm256_and_ps(_mm256_cvtph_ps(bits), _mm256_castsi256_ps(lanes));
      return _mm256_permutevar8x32_ps(v, order);
    }
    return _mm256_permutevar8x32_ps(_mm256_maskload_ps(c.f32() + row + b, lanes), order);
  }
  const __m256i ordered = _mm256_permutevar8x32_epi32(lanes, order);
  const int64_t first = o.group_of[b];
  __m256 spanned;
  if constexpr (kHalf) {
    if (row + first + 8 > o.n * o.groups) {  // the weight's last row: no eight to load
      const __m256 v = _mm256_cvtph_ps(half_constants(o, c.f16() + row, b, count));
      return _mm256_and_ps(_mm256_permutevar8x32_ps(v, order), _mm256_castsi256_ps(ordered));
    }
    const uint16_t* src = c.f16() + row + first;
    spanned = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  } else {
    const __m256i span = _mm256_set1_epi32(int32_t(o.group_of[b + count - 1] - first + 1));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    spanned = _mm256_maskload_ps(c.f32() + row + first, _mm256_cmpgt_epi32(span, lane));
  }
  const __m256i at = _mm256_sub_epi32(_mm256_maskload_epi32(o.group_of + b, lanes),
                                      _mm256_set1_epi32(int32_t(first)));
  return _mm256_and_ps(_mm256_permutevar8x32_ps(spanned, _mm256_permutevar8x32_epi32(at, order)),
                       _mm256_castsi256_ps(ordered));
}

// f(std::true_type) where the weight's groups are wider than a block, else f(std::false_type):
// the row kernels' kWide.
template <typename F>
void by_group_width(const Operands& o, const F& f) {
  if (o.group > kBlock) return f(std::true_type{});
  f(std::false_type{});
}

// y[r, n] for weight rows [n0, n1), R at a time, and every row of x (its P parts summed);
// kHalf: fp16 constants; kWide: groups wider than a block.
template <bool kInt4, bool kHalf, bool kWide, int R, int P>
__attribute__((target("avx2,fma,f16c"))) void rows_int8_avx2(const Operands& o, const RoundedX& x,
                                                             int64_t n0, int64_t n1, float* y) {
  const int64_t blocks = o.k / kBlock, row_bytes = kInt4 ? o.k / 2 : o.k;
  const int64_t stride = x.padded * kBlock;  // one part's codes
  const __m256i order = kInt4 ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)
                              : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < o.m; ++r) {
    const int8_t* xq = x.q + r * P * stride;
    const float* sx = x.sx + r * P * x.padded;
    const float* xs = x.sum + r * P * x.padded;
    for (int64_t n = n0; n + R <= n1; n += R) {
      // the rows kAhead passes on, codes and constants, on their way into the L1
      const int64_t ahead = std::min(n + kAhead * R, n1 - 1);
      for (int64_t i = 0; i < R * row_bytes; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(o.q + ahead * row_bytes + i), _MM_HINT_T0);
      for (int64_t i = 0; i < R * o.groups * o.scale.bytes(); i += 64) {
        _mm_prefetch(o.scale.address(ahead * o.groups) + i, _MM_HINT_T0);
        if constexpr (kInt4) _mm_prefetch(o.offset.address(ahead * o.groups) + i, _MM_HINT_T0);
      }
      __m256 acc[R];
      for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; b += 8) {
        const int count = int(std::min<int64_t>(8, blocks - b));
        const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(count),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int t = 0; t < R; ++t) {
          const int64_t row = (n + t) * o.groups;
          __m256i totals[P];
          totals8_avx2<kInt4, P>(o.q + (n + t) * row_bytes + b * (row_bytes / blocks),
                                 xq + b * kBlock, stride, count, totals);
          const __m256 ws = constants8<kHalf, kWide>(o, o.scale, row, b, count, lanes, order);
          for (int p = 0; p < P; ++p)
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals[p]),
                                     _mm256_mul_ps(ws, _mm256_loadu_ps(sx + p * x.padded + b)),
                                     acc[t]);
          if constexpr (kInt4) {
            const __m256 wo = constants8<kHalf, kWide>(o, o.offset, row, b, count, lanes, order);
            for (int p = 0; p < P; ++p)
              acc[t] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xs + p * x.padded + b), acc[t]);
          }
        }
      }
      for (int t = 0; t < R; ++t) y[r * o.n + n + t] = hsum_avx2(acc[t]);
    }
  }
}

// The int4 codes of a GGUF Q4_0 / Q4_1 file (fp16 constants, a group a block, an even block
// count) against one int8 part of x: rows_int8_avx2's sums with the branches and lookups of its
// general case taken out. Whole groups load their eight constants at once; the last group's
// kRestPairs pairs of blocks (SmolLM2's 576 features: 2 of 18 blocks) are a constant count.
// On SmolLM2 Q4_1's products at one row of x, a 2-core Zen 3: 1.08-1.20x the general kernel
// before it (benchmarks/weight_only_rows.py).
template <int R, int kRestPairs>
__attribute__((target("avx2,fma,f16c"))) void rows_q4_avx2(const Operands& o, const RoundedX& x,
                                                          int64_t n0, int64_t n1, float* y) {
  const int64_t blocks = o.k / kBlock, row_bytes = o.k / 2, whole = blocks - 2 * kRestPairs;
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i rest_lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * kRestPairs),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const uint16_t* scale = o.scale.f16();
  const uint16_t* offset = o.offset.f16();
  // a whole group's eight constants in one load: constants8's runtime checks and mask made
  // these products 0.85-0.95x as fast (measured in one process, taking turns)
  auto constants = [&](const uint16_t* c, int64_t at) __attribute__((target("avx2,f16c"))) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + at));
    return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(bits), order);
  };
  for (int64_t r = 0; r < o.m; ++r) {
    const int8_t* xq = x.q + r * x.padded * kBlock;
    const float* sx = x.sx + r * x.padded;
    const float* xs = x.sum + r * x.padded;
    for (int64_t n = n0; n + R <= n1; n += R) {
      const int64_t ahead = std::min(n + kAhead * R, n1 - 1);
      for (int64_t i = 0; i < R * row_bytes; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(o.q + ahead * row_bytes + i), _MM_HINT_T0);
      for (int64_t i = 0; i < R * blocks * 2; i += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(scale + ahead * blocks) + i, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(offset + ahead * blocks) + i, _MM_HINT_T0);
      }
      __m256 acc[R];
      for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t b = 0; b < whole; b += 8) {
        const __m256 sxb = _mm256_loadu_ps(sx + b), xsb = _mm256_loadu_ps(xs + b);
        for (int t = 0; t < R; ++t) {
          __m256i totals[1];
          totals8_avx2<true, 1>(o.q + (n + t) * row_bytes + b * 16, xq + b * kBlock, 0, 8, totals);
          const int64_t at = (n + t) * blocks + b;
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals[0]),
                                   _mm256_mul_ps(constants(scale, at), sxb), acc[t]);
          acc[t] = _mm256_fmadd_ps(constants(offset, at), xsb, acc[t]);
        }
      }
      if constexpr (kRestPairs > 0) {
        const __m256 sxb = _mm256_loadu_ps(sx + whole), xsb = _mm256_loadu_ps(xs + whole);
        for (int t = 0; t < R; ++t) {
          const int count = 2 * kRestPairs;
          __m256i totals[1];
          totals8_avx2<true, 1>(o.q + (n + t) * row_bytes + whole * 16, xq + whole * kBlock, 0,
                                count, totals);
          const int64_t row = (n + t) * blocks;
          const __m256 ws =
              constants8<true, false>(o, o.scale, row, whole, count, rest_lanes, order);
          const __m256 wo =
              constants8<true, false>(o, o.offset, row, whole, count, rest_lanes, order);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals[0]), _mm256_mul_ps(ws, sxb), acc[t]);
          acc[t] = _mm256_fmadd_ps(wo, xsb, acc[t]);
        }
      }
      // summed as rows_int8_avx2 sums: fp32 constants give the same result, bit for bit
      for (int t = 0; t < R; ++t) y[r * o.n + n + t] = hsum_avx2(acc[t]);
    }
  }
}

// rows_q4_avx2 for the weight's count of blocks past its whole groups of eight (even)
template <int R>
void rows_q4(const Operands& o, const RoundedX& x, int64_t n0, int64_t n1, float* y) {
  switch (o.k / kBlock % 8) {
    case 0: return rows_q4_avx2<R, 0>(o, x, n0, n1, y);
    case 2: return rows_q4_avx2<R, 1>(o, x, n0, n1, y);
    case 4: return rows_q4_avx2<R, 2>(o, x, n0, n1, y);
    default: return rows_q4_avx2<R, 3>(o, x, n0, n1, y);
  }
}

template <bool kInt4, bool kHalf, int P>
void rows_int8(const Operands& o, const RoundedX& x, int64_t n0, int64_t n1, float* y) {
  constexpr int R = P == 1 ? 2 : 1;  // two weight rows a pass where the registers allow
  const int64_t whole = n0 + (n1 - n0) / R * R;
  if constexpr (kInt4 && kHalf && P == 1) {
    if (o.group == kBlock && o.k / kBlock % 2 == 0) {
      rows_q4<2>(o, x, n0, whole, y);
      if (whole < n1) rows_q4<1>(o, x, whole, n1, y);
      return;
    }
  }
  by_group_width(o, [&](auto wide) {
    constexpr bool kWide = decltype(wide)::value;
    rows_int8_avx2<kInt4, kHalf, kWide, R, P>(o, x, n0, whole, y);
    if (whole < n1) rows_int8_avx2<kInt4, kHalf, kWide, 1, P>(o, x, whole, n1, y);
  });
}

template <bool kInt4, bool kHalf>
void rows_int8(const Operands& o, const RoundedX& x, int64_t n0, int64_t n1, float* y) {
  if (x.parts == 2) return rows_int8<kInt4, kHalf, 2>(o, x, n0, n1, y);
  rows_int8<kInt4, kHalf, 1>(o, x, n0, n1, y);
}

// ---- int8 codes against x on int16: the residual form's accuracy at half its multiplies ----
// "int8_residual" on int8 codes (a GGUF file's Q8_0 embedding as its LM head, the int8
// format's down_proj and LM head): each row of x rounded to int16 per block of 32 (scale
// max|x| / 32767, off by at most 1.5e-5 times the block's largest |x|, as two int8 parts are),
// and codes widened to int16 meet it through one madd a 16 features. Two int8 parts take a
// maddubs and a madd each a 32 features, and those share two pipes on Zen 3: this is half as
// many, and SmolLM2's LM head at one row of x (its GGUF file's Q8_0 embedding) took 1.6x less
// time on 1 and on 2 threads of a 2-core Zen 3.
__attribute__((target("avx2,fma"))) void round_row_int16_avx2(const float* x, int64_t k,
                                                              int16_t* q, float* sx) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4];
    const float top = block_max_avx2(x + b * kBlock, v);
    const __m256 inv = _mm256_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    for (int h = 0; h < 2; ++h) {  // packs works within 128-bit lanes: features back in order
      const __m256i packed = _mm256_packs_epi32(c[2 * h], c[2 * h + 1]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock + 16 * h),
                          _mm256_permute4x64_epi64(packed, 0xD8));
    }
    sx[b] = top / 32767.0f;
  }
}

// y[r, n] for int8 weight rows [n0, n1) against every row of x on int16 (codes xq [rows,
// padded * 32], block scales sx [rows, padded]); kHalf: fp16 constants; kWide: groups wider
// than a block (the int8 format's one group a row).
template <bool kHalf, bool kWide>
__attribute__((target("avx2,fma,f16c"))) void rows_int16x_avx2(const Operands& o, const int16_t* xq,
                                                               const float* sx, int64_t padded,
                                                               int64_t n0, int64_t n1, float* y) {
  const int64_t blocks = o.k / kBlock;
  const __m256i order = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < o.m; ++r) {
    const int16_t* x = xq + r * padded * kBlock;
    const float* s = sx + r * padded;
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t ahead = std::min(n + 2 * kAhead, n1 - 1);
      for (int64_t i = 0; i < o.k; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(o.q + ahead * o.k + i), _MM_HINT_T0);
      for (int64_t i = 0; i < o.groups * o.scale.bytes(); i += 64)
        _mm_prefetch(o.scale.address(ahead * o.groups) + i, _MM_HINT_T0);
      const uint8_t* w = o.q + n * o.k;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; b += 8) {
        const int count = int(std::min<int64_t>(8, blocks - b));
        const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), order);
        __m256i v[8];
        for (int j = 0; j < 8; ++j) {  // a block's 32 products <= 32 * 128 * 32767: int32
          if (j >= count) {
            v[j] = _mm256_setzero_si256();
            continue;
          }
          const uint8_t* wj = w + (b + j) * kBlock;
          const int16_t* xj = x + (b + j) * kBlock;
          v[j] = _mm256_add_epi32(
              _mm256_madd_epi16(
                  _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj))),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj))),
              _mm256_madd_epi16(
                  _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + 16))),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj + 16))));
        }
        const __m256i a =
            _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        const __m256i c =
            _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
        const __m256i totals = _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20),
                                                _mm256_permute2x128_si256(a, c, 0x31));
        const __m256 ws =
            constants8<kHalf, kWide>(o, o.scale, n * o.groups, b, count, lanes, order);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals),
                              _mm256_mul_ps(ws, _mm256_loadu_ps(s + b)), acc);
      }
      y[r * o.n + n] = hsum_avx2(acc);
    }
  }
}

// x [M, K] fp32, a few rows -> y [M, N] fp32 with int8 codes, x on int16.
at::Tensor int16_x_linear(const at::Tensor& xf, const Operands& o) {
  const int64_t m = xf.size(0), k = o.k, padded = (k / kBlock + 7) / 8 * 8;
  thread_local std::vector<int16_t> q;
  thread_local std::vector<float> sx;
  q.assign(m * padded * kBlock, 0), sx.assign(m * padded, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    round_row_int16_avx2(xf.data_ptr<float>() + r * k, k, q.data() + r * padded * kBlock,
                         sx.data() + r * padded);
  const int16_t* codes = q.data();  // the threads below see their own thread_locals
  const float* scales = sx.data();
  at::Tensor y = at::empty({m, o.n}, xf.options());
  float* out = y.data_ptr<float>();
  const int64_t chunk = std::max<int64_t>(4, (16 << 10) / k);  // ~16 KiB of codes
  pagedllm_cpu::balanced_for(o.n, chunk, [&](int64_t n0, int64_t n1) {
    by_group_width(o, [&](auto wide) {
      constexpr bool kWide = decltype(wide)::value;
      if (o.scale.half) return rows_int16x_avx2<true, kWide>(o, codes, scales, padded, n0, n1, out);
      rows_int16x_avx2<false, kWide>(o, codes, scales, padded, n0, n1, out);
    });
  });
  return y;
}

// x [M, K] fp32, a few rows -> y [M, N] fp32 on int8 x (parts 1 or 2 a row).
at::Tensor int8_x_linear(const at::Tensor& xf, const Operands& o, int parts) {
  if (parts == 2 && !o.int4) return int16_x_linear(xf, o);
  const int64_t m = xf.size(0), k = o.k, blocks = k / kBlock;
  const int64_t padded = (blocks + 7) / 8 * 8, kernel_rows = m * parts;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> sx, sum, rest;
  q.assign(kernel_rows * padded * kBlock, 0), rest.resize(k);
  sx.assign(kernel_rows * padded, 0.0f), sum.assign(kernel_rows * padded, 0.0f);
  for (int64_t r = 0; r < kernel_rows; ++r) {
    // residual: the odd parts round what the even one before them left
    const float* src = parts == 2 && r % 2 == 1 ? rest.data() : xf.data_ptr<float>() + r / parts * k;
    round_row_avx2(src, k, o.int4, q.data() + r * padded * kBlock, sx.data() + r * padded,
                   sum.data() + r * padded, parts == 2 && r % 2 == 0 ? rest.data() : nullptr);
  }
  const RoundedX x{q.data(), sx.data(), sum.data(), parts, padded};
  at::Tensor y = at::empty({m, o.n}, xf.options());
  float* out = y.data_ptr<float>();
  const int64_t chunk = std::max<int64_t>(4, (16 << 10) / (o.int4 ? k / 2 : k));  // ~16 KiB
  pagedllm_cpu::balanced_for(o.n, chunk, [&](int64_t n0, int64_t n1) {
    if (o.int4 && o.scale.half) return rows_int8<true, true>(o, x, n0, n1, out);
    if (o.int4) return rows_int8<true, false>(o, x, n0, n1, out);
    if (o.scale.half) return rows_int8<false, true>(o, x, n0, n1, out);
    rows_int8<false, false>(o, x, n0, n1, out);
  });
  return y;
}

bool int8_x_runs() { return cpu_runs(Isa::kAvx2); }
#endif

// ---- many rows: dequantized slabs and ATen's GEMM -----------------------------------------------
#if PAGEDLLM_X86 && defined(__GNUC__)
// Rows [n0, n1) as fp32 through the kernel's own block unpacking (the slab path's cost beside
// its GEMM).
__attribute__((target("avx2,fma,f16c"))) void dequantize_rows_avx2(const Operands& w, int64_t n0,
                                                                   int64_t n1, float* out) {
  __m256 v[4];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < w.k / kBlock; ++b) {
      unpack_avx2(w, n, b, v);
      float* dst = out + (n - n0) * w.k + b * kBlock;
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(dst + 8 * i, v[i]);
    }
}

// The same rows straight into bf16 (AVX-512 BF16's rounding to nearest even, as ATen's
// conversion does), for a bf16 x: no fp32 tile to convert.
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bf16")))
void dequantize_rows_bf16(const Operands& w, int64_t n0, int64_t n1, at::BFloat16* out) {
  __m256 v[4];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < w.k / kBlock; ++b) {
      unpack_avx2(w, n, b, v);
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

void dequantize_rows(const Operands& w, int64_t n0, int64_t n1, float* out) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  static const bool avx2 = cpu_runs(Isa::kAvx2);
  if (avx2) return dequantize_rows_avx2(w, n0, n1, out);
#endif
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < w.k / kBlock; ++b)
      unpack_scalar(w, n, b, out + (n - n0) * w.k + b * kBlock);
}

#if PAGEDLLM_X86 && defined(__GNUC__)
// ---- many rows on AVX2: the weight by slices in fp32 panels, a broadcast tile ----------------
// Beyond kSliceMinRows rows on an AVX2 CPU each thread dequantizes a slice of weight rows at a
// time into its own fp32 scratch, in panels of 16 rows stored feature by feature ([K][16], about
// kSliceBytes in all, so the slice stays in L2), and every row of x meets it there: tiles of 6
// rows of x by a panel, one x value broadcast against the panel's two vectors per feature, 12
// accumulators. The weight is read from memory once a call and nothing is written out to memory
// or repacked, as the slabs beside ATen's GEMM do for each slab. On a 2-core Zen 3, taking turns
// with the slabs: SmolLM2's LM head (49152 x 576) at 48-2048 rows 100-145 GFLOP/s against
// 41-83, its layers up to 1.9x at 48 rows and level at 2048 (the int8 format's down_proj, K =
// 1536, 0.85x there), and from 12 rows on ahead of the kernel unpacking in registers (level at
// 8).
constexpr int64_t kPanel = 16;
constexpr int64_t kSliceBytes = 192 << 10;

// 8 x 8 floats transposed: rows `in` apart in, `out` apart out.
__attribute__((target("avx2,fma"))) inline void transpose8_avx2(const float* in, int64_t ld_in,
                                                                float* out, int64_t ld_out) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * ld_in);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ld_out, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ld_out, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// 16 rows of `units` 32-bit values each (by_rows [16, units]) into a panel [units][16].
void transpose_panel_avx2(const float* by_rows, int64_t units, float* panel) {
  for (int64_t half = 0; half < kPanel; half += 8)
    for (int64_t j = 0; j < units; j += 8)
      transpose8_avx2(by_rows + half * units + j, units, panel + j * kPanel + half, kPanel);
}

// Weight rows [n0, n0 + rows) (rows <= 16) as one panel [K][16], rows past the end zero; rows:
// a [16, K] fp32 scratch for the rows as they unpack.
void dequantize_panel_avx2(const Operands& w, int64_t n0, int64_t rows, float* by_rows,
                           float* panel) {
  dequantize_rows_avx2(w, n0, n0 + rows, by_rows);
  std::fill(by_rows + rows * w.k, by_rows + kPanel * w.k, 0.f);
  transpose_panel_avx2(by_rows, w.k, panel);
}

// Rows of x [MR] by one panel: y[r, 0..nr) of rows ldy apart.
template <int MR>
__attribute__((target("avx2,fma"))) void panel_tile_avx2(const float* x, int64_t k,
                                                         const float* panel, int nr, float* y,
                                                         int64_t ldy) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; ++j) {
    const __m256 w0 = _mm256_load_ps(panel + j * kPanel);
    const __m256 w1 = _mm256_load_ps(panel + j * kPanel + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k + j);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
  alignas(32) float out[MR][kPanel];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(out[r], lo[r]);
    _mm256_store_ps(out[r] + 8, hi[r]);
  }
  for (int r = 0; r < MR; ++r) std::copy(out[r], out[r] + nr, y + r * ldy);
}

void panel_tile(int mr, const float* x, int64_t k, const float* panel, int nr, float* y,
                int64_t ldy) {
  switch (mr) {
    case 1: return panel_tile_avx2<1>(x, k, panel, nr, y, ldy);
    case 2: return panel_tile_avx2<2>(x, k, panel, nr, y, ldy);
    case 3: return panel_tile_avx2<3>(x, k, panel, nr, y, ldy);
    case 4: return panel_tile_avx2<4>(x, k, panel, nr, y, ldy);
    case 5: return panel_tile_avx2<5>(x, k, panel, nr, y, ldy);
    default: return panel_tile_avx2<6>(x, k, panel, nr, y, ldy);
  }
}

// Panels a slice holds, of weights `bytes` wide.
int64_t slice_panels(int64_t k, int64_t bytes = 4) {
  return std::max<int64_t>(1, kSliceBytes / (bytes * kPanel * k));
}

// Weight rows [n0, n1) (n0 a multiple of 16) for every row of x (fp32 [M, K]) into y [M, N];
// scratch: the slice's panels and one panel's rows.
void slices_avx2(const Operands& w, int64_t n0, int64_t n1, float* scratch, float* y) {
  const int64_t k = w.k, step = slice_panels(k) * kPanel;
  float* by_rows = scratch + step * k;
  for (int64_t s = n0; s < n1; s += step) {
    const int64_t e = std::min(n1, s + step);
    for (int64_t n = s; n < e; n += kPanel)
      dequantize_panel_avx2(w, n, std::min(kPanel, e - n), by_rows, scratch + (n - s) * k);
    for (int64_t r = 0; r < w.m; r += 6) {
      const int mr = int(std::min<int64_t>(6, w.m - r));
      for (int64_t n = s; n < e; n += kPanel)
        panel_tile(mr, w.x + r * k, k, scratch + (n - s) * k, int(std::min(kPanel, e - n)),
                   y + r * w.n + n, w.n);
    }
  }
}

at::Tensor slice_linear(const at::Tensor& xf, const Operands& w) {
  at::Tensor y = at::empty({w.m, w.n}, xf.options());
  const int64_t panels = (w.n + kPanel - 1) / kPanel, step = slice_panels(w.k);
  at::parallel_for(0, panels, step, [&](int64_t p0, int64_t p1) {
    const at::Tensor scratch = at::empty({(step + 1) * kPanel * w.k}, xf.options());  // aligned
    slices_avx2(w, p0 * kPanel, std::min(w.n, p1 * kPanel), scratch.data_ptr<float>(),
                y.data_ptr<float>());
  });
  return y;
}

// ---- many rows on AVX2 with x on int16: the codes in int16 panels ------------------------------
// The int8 activation forms ("int8", "int8_residual") beyond their rows: each row of x rounded
// to int16 per block of 32 (round_row_int16_avx2: off by at most 1.5e-5 times the block's
// largest |x|), and the slices' scheme with the codes themselves, widened to int16, in place of
// fp32 weights: panels of 16 weight rows by pairs of features ([K / 2][16][2]), so that one
// madd multiplies a pair of x's features, broadcast, into 8 of the panel's rows: 16
// multiply-adds where an FMA does 8, and Zen 3 issues two of either a cycle (with the madd's
// add to its int32 sums, 1.3-1.5x the fp32 slices on SmolLM2's products at 12-1024 rows, one
// thread, taking turns in one process). A block's int32 sums (at most 32 * 128 * 32767) meet
// their constants once per block: the weight's scale and x's, and for int4 codes the offset
// times x's block sum. A row of x sums its blocks in order, whatever tile it falls in.
struct Int16X {
  const int16_t* q;    // [M, K] codes
  const float* scale;  // [M, K / 32]
  const float* sum;    // [M, K / 32]: scale times the block's code sum (int4 offsets), or null
};

// Rows [r0, r1) of x (fp32 [M, K]) rounded to int16 per block, and their blocks' sums.
void round_rows_int16(const float* x, int64_t k, int64_t r0, int64_t r1, int16_t* q,
                      float* scale, float* sum) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    round_row_int16_avx2(x + r * k, k, q + r * k, scale + r * blocks);
    for (int64_t b = 0; sum != nullptr && b < blocks; ++b) {
      int32_t total = 0;
      for (int i = 0; i < kBlock; ++i) total += q[r * k + b * kBlock + i];
      sum[r * blocks + b] = float(total) * scale[r * blocks + b];
    }
  }
}

// A panel's constants by group, [groups][16] (the panel's row i in lane i, rows past `rows`
// zero), from c [N, groups]: 8 rows by 8 groups a transpose, where a GGUF file's groups of 32
// took two scalar loads a block and row.
__attribute__((target("avx2,fma,f16c"))) void panel_constants_avx2(const Constants& c,
                                                                   int64_t groups, int64_t n0,
                                                                   int64_t rows, float* out) {
  alignas(32) float tile[8][8];
  for (int64_t h = 0; h < kPanel; h += 8) {
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      for (int64_t i = 0; i < 8; ++i) {
        const int64_t at = (n0 + h + i) * groups + g;
        __m256 v = _mm256_setzero_ps();
        if (h + i < rows && c.half)
          v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c.f16() + at)));
        else if (h + i < rows)
          v = _mm256_loadu_ps(c.f32() + at);
        _mm256_store_ps(tile[i], v);
      }
      transpose8_avx2(tile[0], 8, out + g * kPanel + h, kPanel);
    }
    for (; g < groups; ++g)
      for (int64_t i = 0; i < 8; ++i)
        out[g * kPanel + h + i] = h + i < rows ? constant(c, (n0 + h + i) * groups + g) : 0.0f;
  }
}

// Weight rows [n0, n0 + rows) (rows <= 16) as one int16 panel [K / 2][16][2] and their
// constants by block ([K / 32][16] scales, and offsets for int4), rows past the end zero. The
// codes are transposed as bytes, a pair of features a 16-bit unit, and only then widened: no
// scratch of widened rows in between (half the loads and stores of widening each row and then
// moving its 32-bit pairs, and 112 shuffles for 16 rows of a block where those took 128).
__attribute__((target("avx2,fma,f16c"))) void widen_panel_avx2(const Operands& w, int64_t n0,
                                                               int64_t rows, int16_t* panel,
                                                               float* scales, float* offsets) {
  const int64_t blocks = w.k / kBlock;
  panel_constants_avx2(w.scale, w.groups, n0, rows, scales);
  if (w.int4) panel_constants_avx2(w.offset, w.groups, n0, rows, offsets);
  for (int64_t b = blocks - 1; w.groups < blocks && b >= 0; --b) {  // group_of[b] <= b
    const int64_t g = w.group_of[b];
    std::copy_n(scales + g * kPanel, kPanel, scales + b * kPanel);
    if (w.int4) std::copy_n(offsets + g * kPanel, kPanel, offsets + b * kPanel);
  }
  alignas(32) static const uint8_t zeros[kBlock] = {};  // a row past the end's block
  const int64_t row_bytes = w.int4 ? w.k / 2 : w.k;
  const __m128i nibble = _mm_set1_epi8(0x0F);
  // The next panel's codes, a block's share of them a block: read block by block, a panel's
  // 16 rows are 16 streams, more than the hardware's prefetch follows.
  const int64_t share = kPanel * row_bytes / blocks;
  const char* next = n0 + kPanel < w.n
                         ? reinterpret_cast<const char*>(w.q + (n0 + kPanel) * row_bytes)
                         : nullptr;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t j = 0; next != nullptr && j < share; j += 64)
      _mm_prefetch(next + b * share + j, _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {  // features [16h, 16h + 16) of the block: 8 pairs
      __m128i r[kPanel];  // each row's 16 codes as bytes
      for (int64_t i = 0; i < kPanel; ++i) {
        const uint8_t* codes = i < rows ? w.block(n0 + i, b) : zeros;
        if (w.int4) {  // features j and j + 16 share byte j
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
          r[i] = _mm_and_si128(h == 0 ? bytes : _mm_srli_epi16(bytes, 4), nibble);
        } else {
          r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * h));
        }
      }
      // rows i and i + 8 in the two lanes; an 8 x 8 transpose of 16-bit units in each lane
      __m256i y[8], t[8];
      for (int i = 0; i < 8; ++i) y[i] = _mm256_set_m128i(r[i + 8], r[i]);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi16(y[i], y[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi16(y[i], y[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        y[i] = _mm256_unpacklo_epi32(t[i], t[i + 2]);
        y[i + 1] = _mm256_unpackhi_epi32(t[i], t[i + 2]);
        y[i + 2] = _mm256_unpacklo_epi32(t[i + 1], t[i + 3]);
        y[i + 3] = _mm256_unpackhi_epi32(t[i + 1], t[i + 3]);
      }
      for (int i = 0; i < 4; ++i) {  // pairs 2i and 2i + 1 from rows 0-3 and 4-7 of each lane
        t[2 * i] = _mm256_unpacklo_epi64(y[i], y[i + 4]);
        t[2 * i + 1] = _mm256_unpackhi_epi64(y[i], y[i + 4]);
      }
      int16_t* out = panel + (b * kBlock + 16 * h) * kPanel;  // pair 8h + p of the block
      for (int p = 0; p < 8; ++p) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + p * 2 * kPanel),
                           _mm256_cvtepi8_epi16(_mm256_castsi256_si128(t[p])));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + p * 2 * kPanel + kPanel),
                           _mm256_cvtepi8_epi16(_mm256_extracti128_si256(t[p], 1)));
      }
    }
  }
}

// Rows [r0, r0 + MR) of x by one int16 panel: y[r, 0..nr) of rows ldy apart. kOffsets: int4.
template <int MR, bool kOffsets>
__attribute__((target("avx2,fma"))) void int16_tile_avx2(const Int16X& x, int64_t r0, int64_t k,
                                                         const int16_t* panel,
                                                         const float* scales,
                                                         const float* offsets, int nr, float* y,
                                                         int64_t ldy) {
  const int64_t blocks = k / kBlock;
  alignas(32) float out[MR][kPanel] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i lo[MR], hi[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    const int16_t* wb = panel + b * kBlock * kPanel;
    const int16_t* xb = x.q + r0 * k + b * kBlock;
    for (int p = 0; p < kBlock / 2; ++p) {
      const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + 2 * p * kPanel));
      const __m256i w1 =
          _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + 2 * p * kPanel + kPanel));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, xb + r * k + 2 * p, 4);
        const __m256i xv = _mm256_set1_epi32(pair);
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(xv, w0));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(xv, w1));
        // In place: left to itself GCC 12 adds into a new register and copies it back, 8
        // more instructions a pair (1.2x slower, a C++ harness of this tile on Zen 3).
        __asm__("" : "+x"(lo[r]), "+x"(hi[r]));
      }
    }
    const __m256 s0 = _mm256_loadu_ps(scales + b * kPanel);
    const __m256 s1 = _mm256_loadu_ps(scales + b * kPanel + 8);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 sx = _mm256_set1_ps(x.scale[(r0 + r) * blocks + b]);
      __m256 o0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r]), _mm256_mul_ps(s0, sx),
                                  _mm256_load_ps(out[r]));
      __m256 o1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), _mm256_mul_ps(s1, sx),
                                  _mm256_load_ps(out[r] + 8));
      if constexpr (kOffsets) {
        const __m256 xs = _mm256_set1_ps(x.sum[(r0 + r) * blocks + b]);
        o0 = _mm256_fmadd_ps(_mm256_loadu_ps(offsets + b * kPanel), xs, o0);
        o1 = _mm256_fmadd_ps(_mm256_loadu_ps(offsets + b * kPanel + 8), xs, o1);
      }
      _mm256_store_ps(out[r], o0);
      _mm256_store_ps(out[r] + 8, o1);
    }
  }
  for (int r = 0; r < MR; ++r) std::copy(out[r], out[r] + nr, y + r * ldy);
}

template <bool kOffsets>
void int16_tile(int mr, const Int16X& x, int64_t r0, int64_t k, const int16_t* panel,
                const float* scales, const float* offsets, int nr, float* y, int64_t ldy) {
  switch (mr) {
    case 1: return int16_tile_avx2<1, kOffsets>(x, r0, k, panel, scales, offsets, nr, y, ldy);
    case 2: return int16_tile_avx2<2, kOffsets>(x, r0, k, panel, scales, offsets, nr, y, ldy);
    case 3: return int16_tile_avx2<3, kOffsets>(x, r0, k, panel, scales, offsets, nr, y, ldy);
    default: return int16_tile_avx2<4, kOffsets>(x, r0, k, panel, scales, offsets, nr, y, ldy);
  }
}

// Weight rows [n0, n1) (n0 a multiple of 16) for every row of x into y [M, N]; scratch: the
// slice's panels (int16), then the slice's constants (fp32).
void int16_slices_avx2(const Operands& w, const Int16X& x, int64_t n0, int64_t n1,
                       int16_t* scratch, float* constants, float* y) {
  const int64_t k = w.k, blocks = k / kBlock, step = slice_panels(k, 2) * kPanel;
  float* offsets = constants + step * blocks;
  for (int64_t s = n0; s < n1; s += step) {
    const int64_t e = std::min(n1, s + step);
    for (int64_t n = s; n < e; n += kPanel)
      widen_panel_avx2(w, n, std::min(kPanel, e - n), scratch + (n - s) * k,
                       constants + (n - s) * blocks, offsets + (n - s) * blocks);
    for (int64_t r = 0; r < w.m; r += 4) {
      const int mr = int(std::min<int64_t>(4, w.m - r));
      for (int64_t n = s; n < e; n += kPanel) {
        const int nr = int(std::min(kPanel, e - n));
        const int64_t at = (n - s) * blocks;
        float* out = y + r * w.n + n;
        if (w.int4)
          int16_tile<true>(mr, x, r, k, scratch + (n - s) * k, constants + at, offsets + at, nr,
                           out, w.n);
        else
          int16_tile<false>(mr, x, r, k, scratch + (n - s) * k, constants + at, nullptr, nr,
                            out, w.n);
      }
    }
  }
}

// x [M, K] fp32, many rows -> y [M, N] fp32 on int16 x.
at::Tensor int16_x_slice_linear(const at::Tensor& xf, const Operands& w) {
  const int64_t m = w.m, k = w.k, blocks = k / kBlock;
  const at::Tensor q = at::empty({m, k}, xf.options().dtype(at::kShort));
  const at::Tensor sx = at::empty({2, m, blocks}, xf.options());
  int16_t* codes = q.data_ptr<int16_t>();
  float* scales = sx.data_ptr<float>();
  float* sums = w.int4 ? scales + m * blocks : nullptr;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    round_rows_int16(w.x, k, r0, r1, codes, scales, sums);
  });
  const Int16X x{codes, scales, sums};
  at::Tensor y = at::empty({m, w.n}, xf.options());
  const int64_t panels = (w.n + kPanel - 1) / kPanel, step = slice_panels(k, 2);
  at::parallel_for(0, panels, step, [&](int64_t p0, int64_t p1) {
    const at::Tensor scratch = at::empty({step * kPanel * k}, q.options());  // aligned
    const at::Tensor constants = at::empty({2 * step * kPanel * blocks}, xf.options());
    int16_slices_avx2(w, x, p0 * kPanel, std::min(w.n, p1 * kPanel), scratch.data_ptr<int16_t>(),
                      constants.data_ptr<float>(), y.data_ptr<float>());
  });
  return y;
}
#endif

at::Tensor slab_linear(const at::Tensor& x, const Operands& w) {
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

// Whether this CPU runs weights by rows on int8 x (isa "int8" / "int8_residual"): AVX2.
bool int8_activations() {
#if PAGEDLLM_X86 && defined(__GNUC__)
  return int8_x_runs();
#else
  return false;
#endif
}

// ---- the op ------------------------------------------------------------------------------------
at::Tensor weight_only_linear(const at::Tensor& x, const at::Tensor& qweight,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                              int64_t bits, const c10::optional<at::Tensor>& bias,
                              const c10::optional<std::string>& force_isa) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16");
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be contiguous 2-D");
  TORCH_CHECK(bits == 8 ? qweight.scalar_type() == at::kChar : qweight.scalar_type() == at::kByte,
              "qweight must be int8 (bits 8) or uint8 (bits 4)");
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(scale.dim() == 2 && (half || scale.scalar_type() == at::kFloat) &&
                  scale.is_contiguous(),
              "scale must be contiguous float32 or float16 [N, groups]");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * (bits == 4 ? 2 : 1) == k, "qweight does not match K = ", k);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(scale.size(0) == n && scale.size(1) > 0 && k % scale.size(1) == 0,
              "scale must be [N, K / group]");
  const int64_t group = k / scale.size(1);
  TORCH_CHECK(group % kBlock == 0, "group size must be a multiple of 32, got ", group);
  TORCH_CHECK(bits == 8 || offset.has_value(), "int4 needs an offset tensor");
  if (offset.has_value())
    TORCH_CHECK(offset->sizes() == scale.sizes() &&
                    offset->scalar_type() == scale.scalar_type() && offset->is_contiguous(),
                "offset must be a contiguous tensor of scale's shape and dtype");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == n && bias->is_contiguous()),
              "bias must be contiguous [N]");
  // isa "int8" / "int8_residual": x on int8 up to kInt8MaxRows / kResidualMaxRows rows, the
  // best instruction set beyond; avx512 / avx2 / scalar: x in fp32 on that one (tests).
  const bool residual = force_isa.has_value() && *force_isa == "int8_residual";
  const bool int8_x = residual || (force_isa.has_value() && *force_isa == "int8");
  TORCH_CHECK(!int8_x || int8_activations(), "int8 activations need AVX2");
  const Isa i = force_isa.has_value() && !int8_x ? isa_from_name(*force_isa) : best_isa();
  TORCH_CHECK(cpu_runs(i), "this CPU does not run ", isa_name(i));

  std::vector<int32_t> group_of(k / kBlock);
  for (int64_t b = 0; b < k / kBlock; ++b) group_of[b] = int32_t(b * kBlock / group);
  Operands o{nullptr,  // x: set below where the path reads it in fp32
             reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
             Constants{scale.data_ptr(), half},
             Constants{bits == 4 ? offset->data_ptr() : nullptr, half},
             m, n, k, group, bits == 4, k / group, group_of.data()};
  const int64_t int8_rows = residual ? kResidualMaxRows : kInt8MaxRows;
#if PAGEDLLM_X86 && defined(__GNUC__)
  // AVX2: slices beyond 8 rows, the int8 forms' (on int16 x) beyond their rows by rows
  const bool slices = i == Isa::kAvx2 && m > (int8_x ? int8_rows : kSliceMinRows);
#else
  constexpr bool slices = false;
#endif
  if (!slices && m > kKernelMaxRows) {
    at::Tensor y = slab_linear(x.contiguous(), o);
    if (bias.has_value()) y.add_(bias->to(y.scalar_type()));
    return y;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  o.x = xf.data_ptr<float>();
  at::Tensor y;
#if PAGEDLLM_X86 && defined(__GNUC__)
  if (slices && int8_x)  // AVX2: slices of int16 codes on x rounded to int16
    y = int16_x_slice_linear(xf, o);
  else if (slices)  // AVX2: fp32 slices through the broadcast tile
    y = slice_linear(xf, o);
  else if (int8_x && m > 0 && n > 0 && m <= int8_rows)
    y = int8_x_linear(xf, o, residual ? 2 : 1);
#endif
  if (!y.defined()) {
    y = at::empty({m, n}, xf.options());
    if (m == 0 || n == 0) return y.to(x.scalar_type());
    float* out = y.data_ptr<float>();
    const int64_t row_bytes = bits == 4 ? k / 2 : k;
    // Tasks of whole groups of 4 rows, each streaming at least ~32 KiB of weight.
    const int64_t quads = (n + 3) / 4;
    const int64_t grain = std::max<int64_t>(1, (32 << 10) / (4 * row_bytes));
    at::parallel_for(0, quads, grain, [&](int64_t p0, int64_t p1) {
      rows(i, o, p0 * 4, std::min(n, p1 * 4), out);
    });
  }
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

std::string isa() { return isa_name(best_isa()); }

bool runs(const std::string& name) { return cpu_runs(isa_from_name(name)); }

// The most rows of x the kernel unpacking in registers takes on this CPU.
int64_t kernel_max_rows() { return best_isa() == Isa::kAvx2 ? kSliceMinRows : kKernelMaxRows; }

}  // namespace

TORCH_LIBRARY(pagedllm_wo, m) {
  m.def(
      "weight_only_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? offset, int bits, "
      "Tensor? bias, str? isa=None) -> Tensor",
      &weight_only_linear);
  m.def("isa() -> str", &isa);
  m.def("runs(str isa) -> bool", &runs);
  m.def("kernel_max_rows() -> int", &kernel_max_rows);
  m.def("int8_activations() -> bool", &int8_activations);
}
