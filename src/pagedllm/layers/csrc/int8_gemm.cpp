// int8 GEMM for a few rows (decode): y[M, N] = float(xq[M, K] . wq[N, K]) * w_scale[N] * step[M]
//
// One call per linear layer does what the oneDNN path needs several torch ops for: each row of
// x is quantized to int8 by its own absolute maximum (step = absmax / levels), stored as u8
// with zero point levels + 1, multiplied against the prepacked int8 weight with exact int32
// accumulation, and rescaled. The zero point is removed with the weight's row sums. The
// integer sums are exact on every path, so the result equals the oneDNN kernel's.
//
// Weight layout: rows in blocks of 16, K in groups of 4: packed[N/16][K/4][16][4]. One 64-byte
// load holds 4 K values of 16 output rows; each row of x contributes a broadcast 4-byte group,
// so a loaded weight block serves every row of x (the weight is read once per call).
//
// The instruction set is chosen at run time (compiled per function with target attributes):
// AVX-512 VNNI (vpdpbusd), AVX-VNNI, AVX-512BW or AVX2 (vpmaddubsw + vpmaddwd: u8 x s8 pairs
// saturate in int16, so activations must keep |xq| <= 63 there), else portable C++.
//
// x is float32 or bfloat16 (widened exactly before it is quantized), y comes out in x's dtype:
// a bfloat16 y is the float32 one rounded to nearest even, as torch's conversion does, without
// the two conversions of the whole tensors a bfloat16 model's layer otherwise pays.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "balanced_for.h"
#include "bf16_round.h"
#include "l2_prefetch.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

using pagedllm_cpu::balanced_for;

constexpr int kRows = 16;  // output rows per weight block
constexpr int kGroup = 4;  // K values per 4-byte group
constexpr int kMaxM = 8;   // rows of x per pass over a weight block (accumulators in registers)

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512bw = 2, kAvxVnni = 3, kAvx512Vnni = 4 };

// Whether this CPU runs an instruction set (cpuid through the compiler's builtins).
bool cpu_runs(Isa i) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  __builtin_cpu_init();
  switch (i) {
    case Isa::kAvx512Vnni:
      return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
    case Isa::kAvxVnni:
#if defined(__clang__) || __GNUC__ >= 11
      return __builtin_cpu_supports("avxvnni");
#else
      return false;
#endif
    case Isa::kAvx512bw: return __builtin_cpu_supports("avx512bw");
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default: return true;
  }
#else
  return i == Isa::kScalar;
#endif
}

Isa detect_isa() {
  for (Isa i : {Isa::kAvx512Vnni, Isa::kAvxVnni, Isa::kAvx512bw, Isa::kAvx2})
    if (cpu_runs(i)) return i;
  return Isa::kScalar;
}

Isa isa() {
  static const Isa value = detect_isa();
  return value;
}

const char* isa_name(Isa i);

Isa isa_from_name(const std::string& name) {
  for (Isa i : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512bw, Isa::kAvxVnni, Isa::kAvx512Vnni})
    if (name == isa_name(i)) return i;
  TORCH_CHECK(false, "unknown instruction set ", name);
}

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvxVnni: return "avx_vnni";
    case Isa::kAvx512bw: return "avx512bw";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

bool has_vnni(Isa i) { return i == Isa::kAvx512Vnni || i == Isa::kAvxVnni; }

// ---- the block micro-kernels: acc[m][16] += sum over K groups of xu[m] . w -----------------
// Row r's group g of x: 4 u8 values as one int32, the operand each kernel broadcasts.
inline int32_t x_group(const uint8_t* xu, int64_t kp, int r, int64_t g) {
  int32_t v;
  std::memcpy(&v, xu + r * kp + g * kGroup, 4);
  return v;
}

// w points at one block ([K/4][16][4] bytes); xu rows are [M][Kp] u8, stride kp.
void block_scalar(const int8_t* w, const uint8_t* xu, int64_t kp, int m, int32_t* acc) {
  for (int r = 0; r < m; ++r) {
    const uint8_t* x = xu + r * kp;
    int32_t* a = acc + r * kRows;
    for (int64_t g = 0; g < kp / kGroup; ++g) {
      const int8_t* wg = w + g * kRows * kGroup;
      const uint8_t* xg = x + g * kGroup;
      for (int n = 0; n < kRows; ++n) {
        int32_t s = 0;
        for (int j = 0; j < kGroup; ++j) s += int32_t(xg[j]) * int32_t(wg[n * kGroup + j]);
        a[n] += s;
      }
    }
  }
}

#if PAGEDLLM_X86 && defined(__GNUC__)
// How far ahead of its loads the one-row kernel requests the weight (the next blocks: they
// are contiguous). The hardware prefetcher alone left one-row products of SmolLM2's and the
// 125M model's small layers at 15-20 GB/s.
constexpr int64_t kPrefetchAhead = 4096;

using pagedllm_cpu::to_l2;

template <int M>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void block_avx512vnni(
    const int8_t* w, const uint8_t* xu, int64_t kp, int32_t* acc) {
  __m512i a[M], b[M];
  for (int r = 0; r < M; ++r) a[r] = b[r] = _mm512_setzero_si512();
  const int64_t groups = kp / kGroup;
  int64_t g = 0;
  // Two accumulator chains (even and odd groups): a single vpdpbusd chain is latency-bound
  // at M = 1 when the weight is in cache.
  for (; g + 2 <= groups; g += 2) {
    const int8_t* wg = w + g * kRows * kGroup;
    if constexpr (M <= 2) {  // decode streams the weight: request it ahead into L2
      _mm_prefetch(reinterpret_cast<const char*>(wg) + kPrefetchAhead, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(wg) + kPrefetchAhead + 64, _MM_HINT_T1);
    }
    const __m512i w0 = _mm512_loadu_si512(wg);
    const __m512i w1 = _mm512_loadu_si512(wg + kRows * kGroup);
    for (int r = 0; r < M; ++r) {
      a[r] = _mm512_dpbusd_epi32(a[r], _mm512_set1_epi32(x_group(xu, kp, r, g)), w0);
      b[r] = _mm512_dpbusd_epi32(b[r], _mm512_set1_epi32(x_group(xu, kp, r, g + 1)), w1);
    }
  }
  for (; g < groups; ++g) {
    const __m512i wv = _mm512_loadu_si512(w + g * kRows * kGroup);
    for (int r = 0; r < M; ++r) {
      const int32_t xg = x_group(xu, kp, r, g);
      a[r] = _mm512_dpbusd_epi32(a[r], _mm512_set1_epi32(xg), wv);
    }
  }
  for (int r = 0; r < M; ++r)
    _mm512_storeu_si512(acc + r * kRows, _mm512_add_epi32(a[r], b[r]));
}

// Many rows on AVX-512 VNNI: two weight blocks (32 outputs) a pass, so that each broadcast of
// x feeds two vpdpbusd (one a block, as above, left the broadcasts as many as the products):
// 16 sums in registers, up to kPairRows rows. SmolLM2's products at 48 / 256 / 2,048 rows
// (gate_up, 3,072 x 576, 2 threads, builds taking turns): 590-726 -> 778-807, 653-760 ->
// 796-849, 604-624 -> 721-726 GOP/s. Four blocks of 6 rows (24 sums) ran at 420-470.
// A pass also requests its share of the next pair's lines (`ahead`, `ahead_lines`), one every
// few groups: the next pair's first pass otherwise waited on its weight from memory. The 125M
// model's 48 layer products in int8 with bf16 x, 2 threads, one process taking turns: 16 rows
// 5.63 -> 4.47 ms, 64 rows 15.0 -> 14.1 ms, 256 rows 52.2 -> 51.2 ms, 2,048 rows unchanged.
constexpr int kPairRows = 8;

template <int M>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void pair_avx512vnni(
    const int8_t* w, int64_t block_bytes, const uint8_t* xu, int64_t kp, int32_t* acc,
    const char* ahead, int64_t ahead_lines) {
  __m512i a[M][2];  // (as a[M] and b[M], GCC copied every sum to another register each step)
  for (int r = 0; r < M; ++r) a[r][0] = a[r][1] = _mm512_setzero_si512();
  const int64_t groups = kp / kGroup;
  const int every = int(std::max<int64_t>(1, groups / std::max<int64_t>(1, ahead_lines)));
  int wait = 1;
  for (int64_t g = 0, line = 0; g < groups; ++g) {
    if (--wait == 0) {
      wait = every;
      if (line < ahead_lines) to_l2(ahead + 64 * line++);
    }
    __m512i v[2];
    for (int j = 0; j < 2; ++j) v[j] = _mm512_loadu_si512(w + j * block_bytes + g * kRows * kGroup);
    for (int r = 0; r < M; ++r) {
      const __m512i xv = _mm512_set1_epi32(x_group(xu, kp, r, g));
      for (int j = 0; j < 2; ++j) a[r][j] = _mm512_dpbusd_epi32(a[r][j], xv, v[j]);
    }
  }
  for (int j = 0; j < 2; ++j)  // acc: the first block's M rows of 16, then the second's
    for (int r = 0; r < M; ++r) _mm512_storeu_si512(acc + (j * kPairRows + r) * kRows, a[r][j]);
}

template <int M>
__attribute__((target("avx512f,avx512bw"))) void block_avx512bw(const int8_t* w,
                                                                 const uint8_t* xu, int64_t kp,
                                                                 int32_t* acc) {
  const __m512i ones = _mm512_set1_epi16(1);
  __m512i a[M];
  for (int r = 0; r < M; ++r) a[r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const __m512i wv = _mm512_loadu_si512(w + g * kRows * kGroup);
    for (int r = 0; r < M; ++r) {
      const int32_t xg = x_group(xu, kp, r, g);
      const __m512i p = _mm512_maddubs_epi16(_mm512_set1_epi32(xg), wv);
      a[r] = _mm512_add_epi32(a[r], _mm512_madd_epi16(p, ones));
    }
  }
  for (int r = 0; r < M; ++r) _mm512_storeu_si512(acc + r * kRows, a[r]);
}

#if defined(__clang__) || __GNUC__ >= 11
template <int M>
__attribute__((target("avx2,avxvnni"))) void block_avxvnni(const int8_t* w, const uint8_t* xu,
                                                           int64_t kp, int32_t* acc) {
  __m256i lo[M], hi[M];
  for (int r = 0; r < M; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const int8_t* wg = w + g * kRows * kGroup;
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32));
    for (int r = 0; r < M; ++r) {
      const int32_t xg = x_group(xu, kp, r, g);
      const __m256i xv = _mm256_set1_epi32(xg);
      lo[r] = _mm256_dpbusd_avx_epi32(lo[r], xv, w0);
      hi[r] = _mm256_dpbusd_avx_epi32(hi[r], xv, w1);
    }
  }
  for (int r = 0; r < M; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kRows), lo[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kRows + 8), hi[r]);
  }
}
#endif

// acc[r][16] of M (<= 4) rows of xu with one weight block on AVX2: 8 accumulators, the block's
// two vectors, the broadcast x and the ones fill 12 of the 16 registers. One or two rows
// stream the weight and request it 1 KB ahead (to_l2: an asm prefetcht1 the compiler keeps).
// SmolLM2's 90 one-row qkv, o and gate_up products back to back (80 MB, from memory), 2
// threads of a Zen 3, one process switching the distance: none 3.01 ms (median of 21), 256 B
// 2.87, 512 B 2.84, 1 KB 2.82, 2 KB 3.14.
constexpr int64_t kAvx2Ahead = 1024;

template <int M>
__attribute__((target("avx2,fma"))) void rows_avx2(const int8_t* w, const uint8_t* xu,
                                                   int64_t kp, int32_t* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo[M], hi[M];
  for (int r = 0; r < M; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const int8_t* wg = w + g * kRows * kGroup;
    if constexpr (M <= 2) to_l2(wg + kAvx2Ahead);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32));
    for (int r = 0; r < M; ++r) {
      const int32_t xg = x_group(xu, kp, r, g);
      const __m256i xv = _mm256_set1_epi32(xg);
      lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w0), ones));
      hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w1), ones));
    }
  }
  for (int r = 0; r < M; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kRows), lo[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kRows + 8), hi[r]);
  }
}

// More rows in two passes over the block (in L1 for the second): eight at once needed 20
// registers, and GCC kept the accumulators on the stack, a load and a store for every add
// (SmolLM2's products at 48 and 512 rows, one thread, builds taking turns: gate/up 86-129 ->
// 136-149 GOP/s, o 68-107 -> 116-124).
template <int M>
void block_avx2(const int8_t* w, const uint8_t* xu, int64_t kp, int32_t* acc) {
  if constexpr (M > 4) {
    rows_avx2<4>(w, xu, kp, acc);
    rows_avx2<M - 4>(w, xu + 4 * kp, kp, acc + 4 * kRows);
  } else {
    rows_avx2<M>(w, xu, kp, acc);
  }
}

#define PAGEDLLM_DISPATCH_M(fn, m, ...)   \
  switch (m) {                             \
    case 1: fn<1>(__VA_ARGS__); break;     \
    case 2: fn<2>(__VA_ARGS__); break;     \
    case 3: fn<3>(__VA_ARGS__); break;     \
    case 4: fn<4>(__VA_ARGS__); break;     \
    case 5: fn<5>(__VA_ARGS__); break;     \
    case 6: fn<6>(__VA_ARGS__); break;     \
    case 7: fn<7>(__VA_ARGS__); break;     \
    default: fn<8>(__VA_ARGS__); break;    \
  }
#endif

// acc[m][16] = int32 dot products of m (<= kMaxM) rows of xu with one weight block.
void block(Isa i, const int8_t* w, const uint8_t* xu, int64_t kp, int m, int32_t* acc) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  switch (i) {
    case Isa::kAvx512Vnni: PAGEDLLM_DISPATCH_M(block_avx512vnni, m, w, xu, kp, acc) return;
#if defined(__clang__) || __GNUC__ >= 11
    case Isa::kAvxVnni: PAGEDLLM_DISPATCH_M(block_avxvnni, m, w, xu, kp, acc) return;
#endif
    case Isa::kAvx512bw: PAGEDLLM_DISPATCH_M(block_avx512bw, m, w, xu, kp, acc) return;
    case Isa::kAvx2: PAGEDLLM_DISPATCH_M(block_avx2, m, w, xu, kp, acc) return;
    default: break;
  }
#endif
  std::fill(acc, acc + m * kRows, 0);
  block_scalar(w, xu, kp, m, acc);
}

#if PAGEDLLM_X86 && defined(__GNUC__)
// acc[2][kPairRows][16] = the dot products of m (<= kPairRows) rows with two weight blocks.
void block_pair(const int8_t* w, int64_t block_bytes, const uint8_t* xu, int64_t kp, int m,
                int32_t* acc, const char* ahead, int64_t ahead_lines) {
  PAGEDLLM_DISPATCH_M(pair_avx512vnni, m, w, block_bytes, xu, kp, acc, ahead, ahead_lines)
}
#endif

// y[r][0:16] = float(acc[r] - zero * sums) * w_scale * step[r] (+ bias) for a whole block of
// 16 outputs, on 16 lanes (the scalar loop's operations in its order); Out float or bf16.
#if PAGEDLLM_X86 && defined(__GNUC__)
template <typename Out>
__attribute__((target("avx512f"))) void rescale_block_avx512(
    const int32_t* acc, int mr, int32_t zero, const int32_t* sums, const float* ws,
    const float* step, const float* bias, Out* y, int64_t ys) {
  const __m512i zs = _mm512_mullo_epi32(_mm512_set1_epi32(zero), _mm512_loadu_si512(sums));
  const __m512 scale = _mm512_loadu_ps(ws);
  for (int r = 0; r < mr; ++r) {
    const __m512i a = _mm512_sub_epi32(_mm512_loadu_si512(acc + r * kRows), zs);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), scale),
                             _mm512_set1_ps(step[r]));
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    if constexpr (std::is_same_v<Out, float>)
      _mm512_storeu_ps(y + r * ys, v);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ys), pagedllm_cpu::bf16_round16(v));
  }
}

// The same on 8 lanes, two halves of the block. Without FMA in its target, so the multiply and
// the bias's add stay two roundings, as in the scalar loop.
template <typename Out>
__attribute__((target("avx2"))) void rescale_block_avx2(const int32_t* acc, int mr, int32_t zero,
                                                        const int32_t* sums, const float* ws,
                                                        const float* step, const float* bias,
                                                        Out* y, int64_t ys) {
  for (int h = 0; h < kRows; h += 8) {
    const __m256i zs = _mm256_mullo_epi32(
        _mm256_set1_epi32(zero), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + h)));
    const __m256 scale = _mm256_loadu_ps(ws + h);
    for (int r = 0; r < mr; ++r) {
      const __m256i a = _mm256_sub_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * kRows + h)), zs);
      __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a), scale),
                               _mm256_set1_ps(step[r]));
      if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + h));
      if constexpr (std::is_same_v<Out, float>)
        _mm256_storeu_ps(y + r * ys + h, v);
      else
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * ys + h), pagedllm_cpu::bf16_round8(v));
    }
  }
}
#endif

// ---- ops -------------------------------------------------------------------------------------
// weight int8 [N, K] -> (packed int8 [ceil(N/16), ceil(K/4), 64], row sums int32 [N]).
std::tuple<at::Tensor, at::Tensor> int8_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "weight must be int8 2-D");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t nb = (n + kRows - 1) / kRows, kg = (k + kGroup - 1) / kGroup;
  at::Tensor packed = at::zeros({nb, kg, kRows * kGroup}, w.options());
  at::Tensor rowsum = at::empty({n}, w.options().dtype(at::kInt));
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* sums = rowsum.data_ptr<int32_t>();
  for (int64_t row = 0; row < n; ++row) {
    int32_t s = 0;
    for (int64_t c = 0; c < k; ++c) {
      const int8_t v = src[row * k + c];
      s += v;
      dst[((row / kRows) * kg + c / kGroup) * kRows * kGroup + (row % kRows) * kGroup +
          c % kGroup] = v;
    }
    sums[row] = s;
  }
  return {packed, rowsum};
}

// quantize_rows' two passes over a row on 16 lanes (AVX-512) or 8 (AVX2), as far as whole
// vectors go (the callers finish the rest with the scalar loops): the same maxima, divisions,
// clamps and rounding, so bit for bit those loops (which the generic build does not vectorize:
// the maximum is a float reduction, and prefill rounds 2,048 rows a call). Each returns the
// features it covered.
#if PAGEDLLM_X86 && defined(__GNUC__)
__attribute__((target("avx512f"))) int64_t absmax_avx512(const float* row, int64_t k,
                                                         float* absmax) {
  __m512 mx = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(row + c)));
  *absmax = _mm512_reduce_max_ps(mx);
  return c;
}

__attribute__((target("avx512f"))) int64_t round_avx512(const float* row, int64_t k, float s,
                                                        float lv, float zero, float magic,
                                                        uint8_t* out) {
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-lv), hi = _mm512_set1_ps(lv);
  const __m512 mv = _mm512_set1_ps(magic), zv = _mm512_set1_ps(zero);
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) {
    const __m512 x = _mm512_div_ps(_mm512_loadu_ps(row + c), sv);
    const __m512 v = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    const __m512 q = _mm512_add_ps(_mm512_sub_ps(_mm512_add_ps(v, mv), mv), zv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c),
                     _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q)));
  }
  return c;
}

// The same on 8 lanes (AVX2).
__attribute__((target("avx2"))) int64_t absmax_avx2(const float* row, int64_t k, float* absmax) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= k; c += 8)
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + c)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  *absmax = *std::max_element(lanes, lanes + 8);
  return c;
}

__attribute__((target("avx2"))) int64_t round_avx2(const float* row, int64_t k, float s, float lv,
                                                   float zero, float magic, uint8_t* out) {
  const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-lv), hi = _mm256_set1_ps(lv);
  const __m256 mv = _mm256_set1_ps(magic), zv = _mm256_set1_ps(zero);
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(row + c), sv);
    const __m256 v = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 q = _mm256_add_ps(_mm256_sub_ps(_mm256_add_ps(v, mv), mv), zv);
    const __m256i codes = _mm256_cvttps_epi32(q);  // 0 .. 2 levels + 1: packed without clamping
    const __m128i words =
        _mm_packus_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + c), _mm_packus_epi16(words, words));
  }
  return c;
}
#endif

// Each row of x to u8 (xq + zero, xq = round(x / step) in [-levels, levels]); K padded with
// the zero point (xq = 0). Same arithmetic as the torch path: step = max(absmax, tiny) / levels.
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t kp, int levels, uint8_t* xu,
                   float* step) {
  const float tiny = std::numeric_limits<float>::min();
  const float lv = float(levels), zero = float(levels + 1);
  // Adding and subtracting 1.5 * 2^23 rounds |v| < 2^22 half to even, like torch.round, in a
  // loop the compiler vectorizes (std::nearbyint is a library call on baseline x86-64).
  const float magic = 12582912.0f;
#if PAGEDLLM_X86 && defined(__GNUC__)
  const bool avx512 = cpu_runs(Isa::kAvx512bw), avx2 = cpu_runs(Isa::kAvx2);
#else
  const bool avx512 = false, avx2 = false;
#endif
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k)),
                   [&](int64_t r0, int64_t r1) {
    std::vector<float> wide;  // a bf16 row widened (exactly) to fp32
    for (int64_t r = r0; r < r1; ++r) {
      const float* row;
      if constexpr (std::is_same_v<T, float>) {
        row = x + r * k;
      } else {
        wide.resize(k);
        for (int64_t c = 0; c < k; ++c) wide[c] = float(x[r * k + c]);
        row = wide.data();
      }
      uint8_t* out = xu + r * kp;
      float absmax = 0.f;
      int64_t c = 0;
#if PAGEDLLM_X86 && defined(__GNUC__)
      if (avx512)
        c = absmax_avx512(row, k, &absmax);
      else if (avx2)
        c = absmax_avx2(row, k, &absmax);
#endif
      for (; c < k; ++c) absmax = std::max(absmax, std::fabs(row[c]));
      const float s = std::max(absmax, tiny) / lv;
      step[r] = s;
      c = 0;
#if PAGEDLLM_X86 && defined(__GNUC__)
      if (avx512)
        c = round_avx512(row, k, s, lv, zero, magic, out);
      else if (avx2)
        c = round_avx2(row, k, s, lv, zero, magic, out);
#endif
      for (; c < k; ++c) {
        const float v = std::min(std::max(row[c] / s, -lv), lv);  // clamp, then round: same
        out[c] = uint8_t(int32_t((v + magic) - magic + zero));     // as round, then clamp
      }
      for (c = k; c < kp; ++c) out[c] = uint8_t(levels + 1);
    }
  });
}

std::atomic<int64_t> pair_pass_count{0};  // passes of block_pair run (pair_passes())
std::atomic<int64_t> ahead_line_count{0};  // lines requested a pair ahead (ahead_lines())

// The products and rescale of int8_linear for y of type Out: row chunks of x that stay in L2,
// the blocks of the weight spread over the threads.
template <typename Out>
void int8_products(Isa i, const uint8_t* xu, const float* step, int64_t m, int64_t kp,
                   const at::Tensor& packed, const int32_t* sums, const float* ws,
                   const float* b, int64_t n, int32_t zero, Out* out) {
  const int8_t* w = packed.data_ptr<int8_t>();
  const int64_t nb = packed.size(0), block_bytes = packed.size(1) * kRows * kGroup;
  // Chunks of blocks that stream at least ~64 KiB of weight, handed out as threads finish;
  // ~16 KiB at the one or two rows of decode, where a chunk is a few microseconds of reading
  // and the thread that finished first waited for the other's last one: in SmolLM2's
  // one-user int8 steps on a 2-core Zen 3, each thread timed in a development build, the two
  // threads of a qkv, o or gate_up product (28 us on average) ended 2.2-2.5 us apart, with
  // these 0.53-0.56 us.
  const int64_t chunk_bytes = m <= 2 ? (16 << 10) : (64 << 10);
  const int64_t blocks = std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(1, block_bytes));
  // Rows of x in chunks of about 256 KiB (half of a core's L2 on small-L2 CPUs), each chunk
  // multiplied with every block of the task's weight: x comes from L2, not once per block
  // from memory (prefill's 2,048 rows are more than a core's L2).
  const int64_t chunk = std::max<int64_t>(kMaxM, (256 << 10) / kp / kMaxM * kMaxM);
  const bool avx512 = i == Isa::kAvx512Vnni || i == Isa::kAvx512bw;
  const bool avx2 = i == Isa::kAvx2 || i == Isa::kAvxVnni;
  // two blocks a pass beyond the one or two rows of decode (those stream the weight once)
  const bool pairs = i == Isa::kAvx512Vnni && m > 2;
  const auto rescale = [&](const int32_t* acc, int64_t r0, int mr, int64_t bi) {
    const int64_t n0 = bi * kRows, rows = std::min<int64_t>(kRows, n - n0);
#if PAGEDLLM_X86 && defined(__GNUC__)
    if (avx512 && rows == kRows)
      return rescale_block_avx512(acc, mr, zero, sums + n0, ws + n0, step + r0,
                                  b ? b + n0 : nullptr, out + r0 * n + n0, n);
    if (avx2 && rows == kRows)
      return rescale_block_avx2(acc, mr, zero, sums + n0, ws + n0, step + r0,
                                b ? b + n0 : nullptr, out + r0 * n + n0, n);
#endif
    for (int r = 0; r < mr; ++r) {
      Out* yr = out + (r0 + r) * n + n0;
      const float s = step[r0 + r];
      for (int64_t c = 0; c < rows; ++c) {
        const float v = float(acc[r * kRows + c] - zero * sums[n0 + c]) * ws[n0 + c] * s;
        yr[c] = Out(b ? v + b[n0 + c] : v);
      }
    }
  };
  balanced_for(nb, blocks, [&](int64_t b0, int64_t b1) {
    int32_t acc[2 * kMaxM * kRows];
    int64_t passes = 0, requested = 0;
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
      const int64_t c1 = std::min(m, c0 + chunk);
      int64_t bi = b0;
#if PAGEDLLM_X86 && defined(__GNUC__)
      const int64_t row_passes = (c1 - c0 + kPairRows - 1) / kPairRows;
      for (; pairs && bi + 2 <= b1; bi += 2) {
        // the next pair of blocks (past b1: the chunk this thread likely takes next),
        // requested a share a pass
        const int64_t next = bi + 4 <= nb ? bi + 2 : -1;
        const int64_t lines = next >= 0 ? 2 * block_bytes / 64 : 0;
        requested += lines;
        const char* next_pair =
            reinterpret_cast<const char*>(w + std::max<int64_t>(0, next) * block_bytes);
        for (int64_t r0 = c0; r0 < c1; r0 += kPairRows) {
          const int mr = int(std::min<int64_t>(kPairRows, c1 - r0));
          const int64_t pass = (r0 - c0) / kPairRows, first = pass * lines / row_passes;
          block_pair(w + bi * block_bytes, block_bytes, xu + r0 * kp, kp, mr, acc,
                     next_pair + 64 * first, (pass + 1) * lines / row_passes - first);
          rescale(acc, r0, mr, bi);
          rescale(acc + kPairRows * kRows, r0, mr, bi + 1);
          ++passes;
        }
      }
#endif
      for (; bi < b1; ++bi)
        for (int64_t r0 = c0; r0 < c1; r0 += kMaxM) {
          const int mr = int(std::min<int64_t>(kMaxM, c1 - r0));
          block(i, w + bi * block_bytes, xu + r0 * kp, kp, mr, acc);
          rescale(acc, r0, mr, bi);
        }
    }
    if (passes > 0) pair_pass_count.fetch_add(passes, std::memory_order_relaxed);
    if (requested > 0) ahead_line_count.fetch_add(requested, std::memory_order_relaxed);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& rowsum,
                       const at::Tensor& w_scale, int64_t levels,
                       const c10::optional<at::Tensor>& bias,
                       const c10::optional<std::string>& force_isa) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(2) == kRows * kGroup,
              "packed must come from int8_pack");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  rowsum.scalar_type() == at::kInt && rowsum.numel() == w_scale.numel(),
              "w_scale must be float32 [N] and rowsum int32 [N]");
  const Isa i = force_isa.has_value() ? isa_from_name(*force_isa) : isa();
  TORCH_CHECK(cpu_runs(i), "this CPU does not run ", isa_name(i));
  TORCH_CHECK(levels >= 1 && levels <= 127, "levels must be in [1, 127]");
  TORCH_CHECK(levels <= 63 || has_vnni(i) || i == Isa::kScalar,
              "without VNNI, activations must keep |xq| <= 63 (int16 pair sums)");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = w_scale.numel();
  const int64_t nb = packed.size(0), kp = packed.size(1) * kGroup;
  TORCH_CHECK(nb == (n + kRows - 1) / kRows && kp >= k && kp - k < kGroup, "shape mismatch");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n &&
                                    bias->is_contiguous()),
              "bias must be float32 [N]");
  at::Tensor y = at::empty({m, n}, xc.options());
  if (m == 0) return y;
  std::vector<uint8_t> xu(m * kp);
  std::vector<float> step(m);
  const int32_t zero = int32_t(levels) + 1;
  const int32_t* sums = rowsum.data_ptr<int32_t>();
  const float* ws = w_scale.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (xc.scalar_type() == at::kFloat) {
    quantize_rows(xc.data_ptr<float>(), m, k, kp, int(levels), xu.data(), step.data());
    int8_products(i, xu.data(), step.data(), m, kp, packed, sums, ws, b, n, zero,
                  y.data_ptr<float>());
  } else {
    quantize_rows(xc.data_ptr<at::BFloat16>(), m, k, kp, int(levels), xu.data(), step.data());
    int8_products(i, xu.data(), step.data(), m, kp, packed, sums, ws, b, n, zero,
                  y.data_ptr<at::BFloat16>());
  }
  return y;
}

std::string int8_isa() { return isa_name(isa()); }

int64_t pair_passes() { return pair_pass_count.load(); }
int64_t ahead_lines() { return ahead_line_count.load(); }

}  // namespace

TORCH_LIBRARY(pagedllm_int8, m) {
  m.def("int8_pack(Tensor weight) -> (Tensor, Tensor)", &int8_pack);
  m.def(
      "int8_linear(Tensor x, Tensor packed, Tensor rowsum, Tensor w_scale, int levels, "
      "Tensor? bias, str? isa=None) -> Tensor",
      &int8_linear);
  m.def("isa() -> str", &int8_isa);
  m.def("pair_passes() -> int", &pair_passes);
  m.def("ahead_lines() -> int", &ahead_lines);
}
