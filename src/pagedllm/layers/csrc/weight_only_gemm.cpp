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
// Up to kKernelMaxRows rows of x (decode): each 32-feature block is unpacked to fp32 in
// registers, scaled there, and multiplied into every row of x (up to kTileM rows per pass
// over the weight), so x stays exact and no dequantized copy of the weight is written. More
// rows (prefill, large decode batches): a slab of output rows at a time is dequantized into a
// scratch tile (straight into bf16 for a bf16 x where the CPU converts natively) and
// multiplied with ATen's GEMM in x's dtype.
//
// The instruction set (AVX-512, AVX2 + FMA, portable C++) is picked at run time, each
// compiled with its own target attribute, so one build serves any x86 CPU. Sums run in fp32
// in a fixed order per instruction set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
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

constexpr int kBlock = 32;  // features per unpacked block
constexpr int kTileM = 4;   // rows of x per pass over a weight row pair
constexpr int64_t kKernelMaxRows = 16;      // beyond this the slab path (GEMM) is faster
constexpr int64_t kSlabElements = 1 << 22;  // weights dequantized per slab (16 MiB fp32)

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

bool cpu_runs(Isa i) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  __builtin_cpu_init();
  switch (i) {
    case Isa::kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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

// The operands of one call, as raw pointers.
struct Operands {
  const float* x;        // [M, K]
  const uint8_t* q;      // int8: [N, K] bytes; int4: [N, K / 2] bytes
  const float* scale;    // [N, K / G]
  const float* offset;   // [N, K / G] (int4) or nullptr
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
  const float s = o.scale[n * groups + g];
  if (o.int4) {
    const uint8_t* src = o.block(n, b);
    const float off = o.offset[n * groups + g];
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
// ---- AVX-512: a block is two 16-lane vectors ----------------------------------------------
__attribute__((target("avx512f,avx512bw"))) inline void unpack_avx512(const Operands& o,
                                                                      int64_t n, int64_t b,
                                                                      __m512& lo, __m512& hi) {
  const int64_t groups = o.groups, g = o.group_of[b];
  const __m512 s = _mm512_set1_ps(o.scale[n * groups + g]);
  if (o.int4) {
    const __m128i bytes = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(o.block(n, b)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m512 off = _mm512_set1_ps(o.offset[n * groups + g]);
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
__attribute__((target("avx512f,avx512bw"))) void tile_avx512(const Operands& o, int64_t n0,
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
__attribute__((target("avx2,fma"))) inline void unpack_avx2(const Operands& o, int64_t n,
                                                            int64_t b, __m256 w[4]) {
  const int64_t groups = o.groups, g = o.group_of[b];
  const __m256 s = _mm256_set1_ps(o.scale[n * groups + g]);
  if (o.int4) {
    const __m128i bytes = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(o.block(n, b)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 off = _mm256_set1_ps(o.offset[n * groups + g]);
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
__attribute__((target("avx2,fma"))) void tile_avx2(const Operands& o, int64_t n0, int64_t r0,
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

// ---- many rows: dequantized slabs and ATen's GEMM -----------------------------------------------
#if PAGEDLLM_X86 && defined(__GNUC__)
// Rows [n0, n1) as fp32 through the kernel's own block unpacking (the slab path's cost beside
// its GEMM).
__attribute__((target("avx2,fma"))) void dequantize_rows_avx2(const Operands& w, int64_t n0,
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
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bf16"))) void dequantize_rows_bf16(
    const Operands& w, int64_t n0, int64_t n1, at::BFloat16* out) {
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

  std::vector<int32_t> group_of(k / kBlock);
  for (int64_t b = 0; b < k / kBlock; ++b) group_of[b] = int32_t(b * kBlock / group);
  if (m > kKernelMaxRows) {
    const Operands w{nullptr, reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                     scale.data_ptr<float>(), bits == 4 ? offset->data_ptr<float>() : nullptr,
                     m, n, k, group, bits == 4, k / group, group_of.data()};
    at::Tensor y = slab_linear(x.contiguous(), w);
    if (bias.has_value()) y.add_(bias->to(y.scalar_type()));
    return y;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({m, n}, xf.options());
  if (m == 0 || n == 0) return y.to(x.scalar_type());
  Operands o{xf.data_ptr<float>(),
             reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
             scale.data_ptr<float>(),
             bits == 4 ? offset->data_ptr<float>() : nullptr,
             m, n, k, group, bits == 4, k / group, group_of.data()};
  float* out = y.data_ptr<float>();
  const int64_t row_bytes = bits == 4 ? k / 2 : k;
  // Tasks of whole groups of 4 rows, each streaming at least ~32 KiB of weight.
  const int64_t quads = (n + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (4 * row_bytes));
  at::parallel_for(0, quads, grain, [&](int64_t p0, int64_t p1) {
    rows(i, o, p0 * 4, std::min(n, p1 * 4), out);
  });
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

std::string isa() { return isa_name(best_isa()); }

bool runs(const std::string& name) { return cpu_runs(isa_from_name(name)); }

int64_t kernel_max_rows() { return kKernelMaxRows; }

}  // namespace

TORCH_LIBRARY(pagedllm_wo, m) {
  m.def(
      "weight_only_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? offset, int bits, "
      "Tensor? bias, str? isa=None) -> Tensor",
      &weight_only_linear);
  m.def("isa() -> str", &isa);
  m.def("runs(str isa) -> bool", &runs);
  m.def("kernel_max_rows() -> int", &kernel_max_rows);
}
