// Float linear products on a weight stored in panels: y[M, N] = x[M, K] . W[N, K]^T (+ bias)
// for float32 and bfloat16, at every row count, from one copy of the weight.
//
// The layout (made by layers/panel_gemm.py at load time; N a multiple of 16):
//   float32  [N / 16][K][16]        one 64-byte vector per k: w[16p .. 16p + 15, k]
//   bfloat16 [N / 16][K / 2][32]    one 64-byte vector per pair of k: the 16 pairs
//                                   (w[n, 2k], w[n, 2k + 1]), the operand of AVX512-BF16's
//                                   vdpbf16ps (K even)
// so a micro-kernel keeps an MR x (NR * 16) tile of y in registers and, per k, loads NR
// vectors of weight and broadcasts MR values of x. At one to a few rows (decode) that streams
// the weight once at memory speed; at many rows (prefill) a panel group's slice of K stays in
// L2 while every row tile passes over it. A plain [N, K] weight would need either a dot
// product per output (horizontal sums, the one-row GEMV of fused_ops.cpp) or a blocked copy
// made per call (what BLAS does with an unpacked weight: half the speed at 8-64 rows here).
//
// Sums run in fp32 in a fixed order. Needs AVX-512F (checked at run time); bfloat16 uses
// vdpbf16ps where the CPU has AVX512-BF16 and two FMAs per pair (exact bf16 -> fp32) where not.
// layers/panel_gemm.py keeps the plain layout on a CPU without AVX-512.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGEDLLM_X86 1
#else
#define PAGEDLLM_X86 0
#endif

namespace {

constexpr int64_t kPanel = 16;     // output features per panel: one 512-bit vector of fp32
constexpr int kMaxMR = 6;          // rows of x per micro-kernel call
constexpr int kMaxNR = 4;          // panels per micro-kernel call (64 outputs)
constexpr int64_t kSliceBytes = 192 << 10;  // a panel group's K slice: stays in L2

// Steps of K (k, or pairs of k in bfloat16) per slice: all of K for one row tile (each
// weight is read once whatever the order), else what keeps a group's slice in L2 while every
// row tile passes over it (L1-sized slices measured slower: the partial sums go round trips).
int64_t slice_steps(int64_t m, int64_t steps, int64_t width, int64_t elem) {
  if (m <= kMaxMR) return steps;
  return std::max<int64_t>(16, kSliceBytes / (kMaxNR * width * elem));
}

enum class Isa { kNone = 0, kAvx512 = 1, kAvx512Bf16 = 2 };

Isa detect() {
#if PAGEDLLM_X86 && defined(__GNUC__)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) return Isa::kNone;
  return __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
#else
  return Isa::kNone;
#endif
}

Isa cpu_isa() {
  static const Isa isa = detect();
  return isa;
}

// One call's operands: x rows of `xs` elements, the panels, y rows of `ys` elements; a slice
// [k0, k1) of K (in k for float32, in pairs of k for bfloat16).
template <typename T>
struct Tile {
  const T* x;
  int64_t xs;
  const T* w;        // the first panel of the group
  int64_t panel;     // elements per panel
  const float* bias; // fp32 [N] slice of this group, or null
  T* y;
  int64_t ys;
  float* acc;        // fp32 partial sums [M][ys] between K slices (bfloat16 only), or null
  int64_t k0, k1;
  bool first, last;
  bool dp;           // bfloat16: vdpbf16ps (AVX512-BF16), else two FMAs per pair
};

#if PAGEDLLM_X86 && defined(__GNUC__)

__attribute__((target("avx512f"))) inline __m512 bf16_to_f32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Round to nearest even, NaN kept (a quiet NaN), as c10::BFloat16's conversion does.
__attribute__((target("avx512f"))) inline __m256i f32_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

template <int MR, int NR, typename T>
__attribute__((target("avx512f"))) inline void load_acc(const Tile<T>& t, __m512 (&acc)[MR][NR]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      if (!t.first) {
        if constexpr (std::is_same_v<T, float>)
          acc[i][j] = _mm512_loadu_ps(t.y + i * t.ys + j * kPanel);
        else
          acc[i][j] = _mm512_loadu_ps(t.acc + i * t.ys + j * kPanel);
      } else {
        acc[i][j] = t.bias != nullptr ? _mm512_loadu_ps(t.bias + j * kPanel) : _mm512_setzero_ps();
      }
    }
}

template <int MR, int NR, typename T>
__attribute__((target("avx512f"))) inline void store_acc(const Tile<T>& t,
                                                         const __m512 (&acc)[MR][NR]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(t.y + i * t.ys + j * kPanel, acc[i][j]);
      } else if (t.last) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.y + i * t.ys + j * kPanel),
                            f32_to_bf16(acc[i][j]));
      } else {
        _mm512_storeu_ps(t.acc + i * t.ys + j * kPanel, acc[i][j]);
      }
    }
}

template <int MR, int NR>
__attribute__((target("avx512f"))) void tile_f32(const Tile<float>& t) {
  __m512 acc[MR][NR];
  load_acc<MR, NR>(t, acc);
  const float* w = t.w;
  for (int64_t k = t.k0; k < t.k1; ++k) {
    __m512 b[NR];
    for (int j = 0; j < NR; ++j) b[j] = _mm512_loadu_ps(w + j * t.panel + k * kPanel);
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(t.x[i * t.xs + k]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
    }
  }
  store_acc<MR, NR>(t, acc);
}

inline int32_t pair_at(const at::BFloat16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int MR, int NR>
__attribute__((target("avx512f,avx512bf16"))) void tile_bf16_dp(const Tile<at::BFloat16>& t) {
  __m512 acc[MR][NR];
  load_acc<MR, NR>(t, acc);
  const at::BFloat16* w = t.w;
  for (int64_t k = t.k0; k < t.k1; ++k) {  // k: a pair of input features
    __m512i b[NR];
    for (int j = 0; j < NR; ++j)
      b[j] = _mm512_loadu_si512(w + j * t.panel + k * 2 * kPanel);
    for (int i = 0; i < MR; ++i) {
      const __m512i a = _mm512_set1_epi32(pair_at(t.x + i * t.xs + 2 * k));
      for (int j = 0; j < NR; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)a, (__m512bh)b[j]);
    }
  }
  store_acc<MR, NR>(t, acc);
}

template <int MR, int NR>
__attribute__((target("avx512f"))) void tile_bf16_fma(const Tile<at::BFloat16>& t) {
  __m512 acc[MR][NR];
  load_acc<MR, NR>(t, acc);
  const at::BFloat16* w = t.w;
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  for (int64_t k = t.k0; k < t.k1; ++k) {
    for (int j = 0; j < NR; ++j) {
      const __m512i v = _mm512_loadu_si512(w + j * t.panel + k * 2 * kPanel);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      for (int i = 0; i < MR; ++i) {
        const at::BFloat16* xp = t.x + i * t.xs + 2 * k;
        acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(float(xp[0])), even, acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(float(xp[1])), odd, acc[i][j]);
      }
    }
  }
  store_acc<MR, NR>(t, acc);
}

template <int MR, int NR>
void tile(const Tile<float>& t) { tile_f32<MR, NR>(t); }

template <int MR, int NR>
void tile(const Tile<at::BFloat16>& t) {
  if (t.dp) tile_bf16_dp<MR, NR>(t); else tile_bf16_fma<MR, NR>(t);
}

template <typename T, int MR>
void tile_nr(int nr, const Tile<T>& t) {
  switch (nr) {
    case 1: return tile<MR, 1>(t);
    case 2: return tile<MR, 2>(t);
    case 3: return tile<MR, 3>(t);
    default: return tile<MR, 4>(t);
  }
}

template <typename T>
void tile_any(int mr, int nr, const Tile<T>& t) {
  switch (mr) {
    case 1: return tile_nr<T, 1>(nr, t);
    case 2: return tile_nr<T, 2>(nr, t);
    case 3: return tile_nr<T, 3>(nr, t);
    case 4: return tile_nr<T, 4>(nr, t);
    case 5: return tile_nr<T, 5>(nr, t);
    default: return tile_nr<T, 6>(nr, t);
  }
}

// Panels [p0, p1) of y for all M rows: K in slices that keep a panel group's weight in L2,
// each slice over every group of kMaxNR panels and every tile of kMaxMR rows.
template <typename T>
void panels(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y,
            float* acc, bool dp, int64_t p0, int64_t p1) {
  const int64_t m = x.size(0), steps = w.size(1), width = w.size(2);  // width: 16 or 32
  const int64_t panel = steps * width;
  const int64_t slice = slice_steps(m, steps, width, sizeof(T));
  Tile<T> t{};
  t.dp = dp;
  t.xs = x.stride(0);
  t.panel = panel;
  t.ys = y.stride(0);
  for (int64_t k0 = 0; k0 < steps; k0 += slice) {
    t.k0 = k0;
    t.k1 = std::min(steps, k0 + slice);
    t.first = k0 == 0;
    t.last = t.k1 == steps;
    for (int64_t p = p0; p < p1; p += kMaxNR) {
      const int nr = int(std::min<int64_t>(kMaxNR, p1 - p));
      t.w = w.data_ptr<T>() + p * panel;
      t.bias = bias != nullptr ? bias + p * kPanel : nullptr;
      for (int64_t r = 0; r < m; r += kMaxMR) {
        const int mr = int(std::min<int64_t>(kMaxMR, m - r));
        t.x = x.data_ptr<T>() + r * t.xs;
        t.y = y.data_ptr<T>() + r * t.ys + p * kPanel;
        t.acc = acc != nullptr ? acc + r * t.ys + p * kPanel : nullptr;
        tile_any<T>(mr, nr, t);
      }
    }
  }
}

#endif  // PAGEDLLM_X86 && __GNUC__

Isa isa_from_name(const std::string& name) {
  if (name == "avx512_bf16") return Isa::kAvx512Bf16;
  if (name == "avx512") return Isa::kAvx512;
  TORCH_CHECK(false, "panel_linear: isa is avx512_bf16 or avx512, not ", name);
}

// isa: the instruction set to run (tests of the path a CPU without AVX512-BF16 takes);
// default: the best this CPU has.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias,
                        const c10::optional<std::string>& isa) {
  const Isa use = isa.has_value() ? isa_from_name(*isa) : cpu_isa();
  TORCH_CHECK(cpu_isa() != Isa::kNone && use <= cpu_isa(), "panel_linear: this CPU lacks ",
              use == Isa::kAvx512Bf16 ? "AVX512-BF16" : "AVX-512F");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(2) * w.element_size() == 64,
              "panel_linear: weight panels [N / 16, K (/ 2), 16 (* 2)]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "panel_linear: x and the panels in float32 or bfloat16 alike");
  const int64_t n = w.size(0) * kPanel, k = w.size(1) * w.size(2) / kPanel;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1, "panel_linear: x [M, ", k,
              "] with unit stride");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == n),
              "panel_linear: bias [", n, "]");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const int64_t m = x.size(0);
  if (m == 0) return y;
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t row_bytes = k * x.element_size();
  const bool sliced = w.size(1) > slice_steps(m, w.size(1), w.size(2), w.element_size());
  // bfloat16 keeps fp32 partial sums between K slices (float32 keeps them in y)
  at::Tensor acc;
  if (sliced && x.scalar_type() == at::kBFloat16) acc = at::empty({m, n}, x.options().dtype(at::kFloat));
  float* ap = acc.defined() ? acc.data_ptr<float>() : nullptr;
  // Tasks of whole panels streaming at least ~32 KiB of weight, or of work at many rows.
  const int64_t panel_bytes = k * kPanel * x.element_size();
  const int64_t work = panel_bytes * std::max<int64_t>(1, m / kMaxMR) + row_bytes;
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / work);
#if PAGEDLLM_X86 && defined(__GNUC__)
  at::parallel_for(0, w.size(0), grain, [&](int64_t p0, int64_t p1) {
    if (x.scalar_type() == at::kFloat)
      panels<float>(x, w, bp, y, nullptr, false, p0, p1);
    else
      panels<at::BFloat16>(x, w, bp, y, ap, use == Isa::kAvx512Bf16, p0, p1);
  });
#endif
  return y;
}

bool available() { return cpu_isa() != Isa::kNone; }

std::string isa() {
  switch (cpu_isa()) {
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    default: return "none";
  }
}

}  // namespace

TORCH_LIBRARY(pagedllm_panel, m) {
  m.def("panel_linear(Tensor x, Tensor w, Tensor? bias, str? isa=None) -> Tensor",
        &panel_linear);
  m.def("available() -> bool", &available);
  m.def("isa() -> str", &isa);
}
