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
// Sums run in fp32 in a fixed order. Needs AVX-512F or AVX2 with FMA (checked at run time);
// bfloat16 uses vdpbf16ps where the CPU has AVX512-BF16 and two FMAs per pair (exact bf16 ->
// fp32) where not. On AVX2 the same panels and tiles run on 256-bit vectors ("AVX2 tiles").
// Weight-only codes in panels ("quantized panels") need AVX-512F; layers/panel_gemm.py keeps
// the plain layout on a CPU with neither.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "balanced_for.h"
#include "bf16_round.h"
#include "l2_prefetch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDLLM_X86 1
#else
#define PAGEDLLM_X86 0
#endif

namespace {

using pagedllm_cpu::balanced_for;
#if PAGEDLLM_X86
using pagedllm_cpu::bf16_round16;
using pagedllm_cpu::bf16_round8;
using pagedllm_cpu::bf16_round_bits8;
using pagedllm_cpu::bf16_rounded_bits;
#endif
#if PAGEDLLM_X86 && defined(__GNUC__)
using pagedllm_cpu::to_l2;
using pagedllm_cpu::to_write;
#endif

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

// A chunk of balanced_for for the products: `panels` rounded up to whole groups of kMaxNR
// (the micro-kernels' width; a shorter run loads x again), at least one group.
int64_t whole_groups(int64_t panels) {
  return std::max<int64_t>(1, (panels + kMaxNR - 1) / kMaxNR) * kMaxNR;
}

std::atomic<int64_t> row_block_count{0};  // (group, block of rows) items run (row_blocks())
std::atomic<int64_t> ahead_line_count{0};  // lines requested a group ahead (ahead_lines())
std::atomic<int64_t> int8_row_count{0};    // rows of x run on int8 activations (int8_rows())

// Rows a block of a product of many rows takes (a multiple of kMaxMR; m: one block), so that
// two threads get even shares: a panel group at a time left one thread a group more than the
// other where the groups are few (SmolLM2's o_proj and down_proj: 9 groups of 4 panels, 5
// against 4), and a group's row tiles cost the same wherever they run (its weight comes from
// L2 for each). Not where K is sliced: there every row passes over one slice before the next.
int64_t block_rows(int64_t m, int64_t panels, bool sliced) {
  if (m <= kMaxMR || sliced) return m;
  const int64_t groups = whole_groups(panels) / kMaxNR, tiles = (m + kMaxMR - 1) / kMaxMR;
  const int64_t items = 16 * int64_t(at::get_num_threads());  // each 1/16 of a thread's share
  const int64_t blocks = std::clamp<int64_t>((items + groups - 1) / groups, 1, tiles);
  return (tiles + blocks - 1) / blocks * kMaxMR;
}

// kAvx2: AVX2 and FMA, no AVX-512F (float panels only); kAmxBf16: AVX512-BF16 and AMX-BF16
// tiles (bfloat16 products of more than kMaxMR rows). Each CPU runs its own and those before.
enum class Isa { kNone = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmxBf16 = 4 };

#if PAGEDLLM_X86 && defined(__GNUC__)
// AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), and the tile data state granted to
// this process: Linux hands it out on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool detect_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}
#endif

Isa detect() {
#if PAGEDLLM_X86 && defined(__GNUC__)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f"))
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? Isa::kAvx2
                                                                           : Isa::kNone;
  if (!__builtin_cpu_supports("avx512bf16")) return Isa::kAvx512;
  return detect_amx() ? Isa::kAmxBf16 : Isa::kAvx512Bf16;
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
  T* y;              // y in x's dtype, or null where yf is set
  float* yf;         // bfloat16 x: fp32 y holding the bf16-rounded sums (logits), or null
  int64_t ys;
  float* acc;        // fp32 partial sums [M][ys] between K slices (bfloat16 only), or null
  int64_t k0, k1;
  bool first, last;
  bool dp;           // bfloat16: vdpbf16ps (AVX512-BF16), else two FMAs per pair
  bool avx2;         // 256-bit vectors (a CPU without AVX-512F): the AVX2 tiles
  const float* xf;   // AVX2, bfloat16: x widened to fp32 (rows of xfs), read in its place
  int64_t xfs;
  const T* w_end;    // one row tile (streaming): the end of the weight's panels, else null
  int64_t stream_ahead;  // streaming: bytes each panel is requested ahead (panel_ahead_bytes)
  // Many rows: lines of the next panel group's slice this tile requests (Ahead), or none.
  const T* ahead;    // the next group's first panel at its slice's first step, or null
  int64_t ahead_first, ahead_lines;  // this tile's share: lines [first, first + lines)
  int ahead_nr;      // panels of the next group
};

// Where tile t stores rows [r, r + MR) of panels from p on: into y of x's dtype, or into an
// fp32 y the bf16 results widened (bfloat16 x and y in float32: panel_linear's out_dtype).
template <typename T>
inline void point_output(Tile<T>& t, at::Tensor& y, int64_t r, int64_t p) {
  const int64_t first = r * t.ys + p * kPanel;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (y.scalar_type() == at::kFloat) {
      t.y = nullptr;
      t.yf = y.data_ptr<float>() + first;
      return;
    }
  }
  t.y = y.data_ptr<T>() + first;
  t.yf = nullptr;
}

// A row tile's share `i` of `tiles` of the `lines` a product requests ahead.
template <typename T>
inline void ahead_share(Tile<T>& t, int64_t i, int64_t tiles, int64_t lines) {
  t.ahead_first = i * lines / tiles;
  t.ahead_lines = (i + 1) * lines / tiles - t.ahead_first;
}

#define ALWAYS_INLINE_PANEL inline __attribute__((always_inline))
#if PAGEDLLM_X86 && defined(__GNUC__)

// A row tile that streams the weight (up to kMaxMR rows: each weight read once) requests each
// panel's stream panel_ahead_bytes() ahead into L2; past the group's last step, the same place
// in the next group's panel. SmolLM2's bf16 GGUF at batch 1 (alternating engines in one
// process, 4 rounds, a 2-core Xeon with AMX), 2 KB ahead against none: 84.6-95.4 -> 93.8-102.5
// tok/s; fp32 about 6% faster. On AMD the distance is 1 KB: SmolLM2's decode at batch 1 on a
// 2-core Zen 4 guest, one process switching the distance every 16 steps (a development A/B,
// 30-60 pairs each), 1 KB against 2 KB: fp32 1.13x (37 of 40 pairs faster), bf16 1.02x; against
// 512 B 1.02x / 1.04x, against 1.5 KB (fp32) 1.12x, against none 1.04x / 1.06x. The 120 one-row
// fp32 layer products alone ran 2 KB ahead at 32-37 GB/s where the read bandwidth reached 53,
// 1 KB ahead at 39-43. Zen 3's AVX2 GEMV found 1 KB best for bf16 too (kGemvAheadBytes,
// fused_ops.cpp).
// Zen 5 (AMD family 26) streams faster with no requests at all: a one-row fp32 panel product's
// read pattern (four panels side by side, two threads, 512 MB), every variant in turn in one
// process, five runs of 12 rounds on a 2-core Zen 5 guest: none against 1 KB ahead 1.07-1.23x
// (medians 61.6 / 49.9, 39.8 / 36.3, 44.3 / 40.4 GB/s on 2 MB pages, 37.8 / 35.4 on 4 KB
// pages), and 2 or 4 KB ahead no better than 1 KB (benchmarks/stream_ahead.py, which also
// switches a decoding engine's distance every few steps).
// AMD cores without AVX-512 (Zen 3 and before, the AVX2 tiles) stream one float32 row with no
// requests, and bfloat16 and several rows 1 KB ahead: SmolLM2 decoding on a 2-core Zen 3
// guest, the distance switched every 33 steps in one process (benchmarks/stream_ahead.py
// --model), one row of float32 15.02 ms a step with none against 15.50 at 1 KB (none faster in
// 11 of 15 block pairs), bfloat16 9.27 at 1 KB against 9.73 with none (12 of 15), as Zen 3's
// AVX2 GEMV had found (BENCHMARKS.md round twenty-three); 4 users at once (--users 4), 1 KB
// against none: float32 20.04 against 21.72 ms, bfloat16 12.58 against 14.55 (16 of 16 each).
// The kernels take the distance as a template argument: as a value from the tile, one more
// live integer made GCC spill a tile's vectors inside its loop over K.
constexpr int64_t kPanelAheadShort = 1024, kPanelAheadLong = 2048;

// The CPU's family as CPUID leaf 1 reports it (base family, plus the extended one past 15).
int cpu_family() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
  const int base = (eax >> 8) & 0xf;
  return base == 0xf ? base + int((eax >> 20) & 0xff) : base;
}

// This CPU's distance for one row of float32 (fp32_row), else for any other stream.
int64_t cpu_ahead_bytes(bool fp32_row) {
  static const bool amd = (__builtin_cpu_init(), __builtin_cpu_is("amd"));
  static const int64_t any =
      !amd ? kPanelAheadLong : cpu_family() >= 26 ? int64_t(0) : kPanelAheadShort;
  return fp32_row && amd && cpu_isa() == Isa::kAvx2 ? 0 : any;
}

// The distance a benchmark set for every stream (stream_ahead_bytes) to compare them, or -1.
std::atomic<int64_t>& panel_ahead() {
  static std::atomic<int64_t> bytes{-1};
  return bytes;
}

int64_t panel_ahead_bytes(bool fp32_row) {
  const int64_t set = panel_ahead().load(std::memory_order_relaxed);
  return set >= 0 ? set : cpu_ahead_bytes(fp32_row);
}

// A tile of many rows requests its share of the next panel group's lines (Tile::ahead), spread
// over its steps of K: line i is step i / nr of panel i % nr. The first row tile of a group
// otherwise waited on its weight from memory (a decode step's 200 MB of weights do not stay
// in the L3), while the following tiles found it in L2. One process taking turns, 2 threads,
// the 125M model's 48 layer products and its LM head, bf16 weights on huge pages: 64 rows
// 34.0 -> 32.3 ms, 32 rows 19.2 -> 17.5, 12 rows 9.0 -> 7.7, fp32 at 16 rows 20.6 -> 18.9;
// 256 and 2,048 rows unchanged; the shared-prefix workload (64 requests) 5.61 -> 5.27 s.
// A many-row kernel (AHEAD == 0 below) requests its share of the next group kBatchLines lines
// at a time, between runs of its loop over K. Requested a step at a time inside the loop, the
// Ahead's state took registers from the rows' pointers, which GCC then reloaded from the stack
// on every step. One process taking turns with the two builds (16 times), the 125M model's
// four products in bf16, two threads over 12 layers' weights: 64 rows 1.03x, 256 rows 1.04x,
// 16 rows 0.99x; 2,048 rows (one layer) 1.05x; 64 rows on one thread, the weight in L3, 1.04x.
// Bigger batches hurt where a tile requests several lines a step (8 rows: two tiles, two lines
// a step): 32 lines a batch, 0.95x. The float32 and two-FMA kernels gained nothing this way.
constexpr int64_t kBatchLines = 16;

template <typename T>
struct Ahead {
  const T* line;     // panel j's line of step s
  int64_t panel, width, left;
  int nr, j;
  int per;           // lines a step of K, enough for the tile's share over its steps
  // Out of line: inlined, its division took registers from the streaming kernels' loops.
  __attribute__((noinline)) Ahead(const Tile<T>& t, int64_t width)
      : panel(t.panel), width(width), left(0), nr(1), j(0), per(0) {
    line = t.ahead;
    if (line == nullptr) return;
    nr = t.ahead_nr;
    left = t.ahead_lines;
    per = int((left + t.k1 - t.k0 - 1) / (t.k1 - t.k0));
    const int64_t s = t.ahead_first / nr;
    j = int(t.ahead_first - s * nr);
    line += j * panel + s * width;
  }
  ALWAYS_INLINE_PANEL void step() {
    if (left <= 0) return;
    to_l2(line);
    --left;
    if (++j < nr) {
      line += panel;
    } else {
      j = 0;
      line += width - (nr - 1) * panel;
    }
  }
  // Steps of K between two batches of requests (kBatchLines lines), of a tile's `steps`.
  int64_t batch_steps(int64_t steps) const {
    return per > 0 ? std::max<int64_t>(1, kBatchLines / per) : std::max<int64_t>(1, steps);
  }
  // One step of K's share, for the kernels that request a step at a time. Not advance(1):
  // that loop's other shape moved the float32 and streaming kernels' registers (objdump: one
  // more stack access in the loop over K of 34 instantiations, one fewer in 24).
  ALWAYS_INLINE_PANEL void advance() {
    for (int u = 0; u < per; ++u) step();
  }
  // The share of `steps` steps of K, requested before they run.
  ALWAYS_INLINE_PANEL void advance(int64_t steps) {
    for (int64_t u = per * steps; u > 0; --u) step();
  }
};

template <int64_t AHEAD, typename T, int NR>
inline void prefetch_panels(const Tile<T>& t, int64_t k, int64_t width) {
  if constexpr (AHEAD == 0) return;  // the hardware's prefetchers alone (panel_ahead_bytes)
  if (t.w_end == nullptr) return;
  const int64_t steps = t.panel / width;
  const int64_t ahead = AHEAD / (width * int64_t(sizeof(T)));
  for (int j = 0; j < NR; ++j) {
    const int64_t at = k + ahead;
    const T* line = at < steps ? t.w + j * t.panel + at * width
                               : t.w + (j + NR) * t.panel + (at - steps) * width;
    if (line < t.w_end) to_l2(line);
  }
}

// A tile's output lines requested for writing before its loop over K. Beyond one row tile,
// each tile stores its MR rows x NR panels to lines no other tile has touched (rows ys apart,
// often not in the L2: a 2,048-row product's y is 16 MB), and its stores waited on those
// lines at the tile's end (perf: 7.5% of the kernel's time outside its loop over K, 2.6%
// after). Two threads, bf16, the 125M model's gate_up at 2,048 rows 371 -> 410 GFLOP/s; its
// 48 layer products and LM head, alternating processes: 64 rows 33.7-34.6 -> 32.7-33.3 ms,
// 256 rows 130.8-132.7 -> 125.4-127.3 ms, 2,048 rows 1,119-1,145 -> 1,069-1,093 ms, 16 rows
// and fp32 within the noise.
template <int MR, int NR, typename T>
ALWAYS_INLINE_PANEL void claim_outputs(const Tile<T>& t) {
  const char* out;  // where store_acc writes: float y, the bf16 sums' fp32 scratch, or y
  int64_t elem = sizeof(float);
  if constexpr (std::is_same_v<T, float>) {
    out = reinterpret_cast<const char*>(t.y);
  } else if (!t.last) {
    out = reinterpret_cast<const char*>(t.acc);
  } else if (t.yf != nullptr) {
    out = reinterpret_cast<const char*>(t.yf);
  } else {
    out = reinterpret_cast<const char*>(t.y);
    elem = sizeof(T);
  }
  const int64_t row_bytes = NR * kPanel * elem, stride = t.ys * elem;
  for (int i = 0; i < MR; ++i)
    for (int64_t b = 0; b < row_bytes; b += 64) to_write(out + i * stride + b);
}

template <int MR, int NR, typename T>
__attribute__((target("avx512f"))) inline void load_acc(const Tile<T>& t, __m512 (&acc)[MR][NR]) {
  claim_outputs<MR, NR>(t);
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
      } else if (t.last && t.yf != nullptr) {  // the bf16 value, widened
        const __m512i wide = _mm512_cvtepu16_epi32(bf16_round16(acc[i][j]));
        _mm512_storeu_ps(t.yf + i * t.ys + j * kPanel,
                         _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
      } else if (t.last) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.y + i * t.ys + j * kPanel),
                            bf16_round16(acc[i][j]));
      } else {
        _mm512_storeu_ps(t.acc + i * t.ys + j * kPanel, acc[i][j]);
      }
    }
}

template <int MR, int NR, int64_t AHEAD>
__attribute__((target("avx512f"))) void tile_f32(const Tile<float>& t) {
  __m512 acc[MR][NR];
  load_acc<MR, NR>(t, acc);
  const float* w = t.w;
  Ahead<float> ahead(t, kPanel);
  for (int64_t k = t.k0; k < t.k1; ++k) {
    prefetch_panels<AHEAD, float, NR>(t, k, kPanel);
    ahead.advance();
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

// One step of K (a pair of input features) of an MR x NR tile.
template <int MR, int NR>
__attribute__((target("avx512f,avx512bf16"))) ALWAYS_INLINE_PANEL void dp_step(
    const Tile<at::BFloat16>& t, int64_t k, __m512 (&acc)[MR][NR]) {
  __m512i b[NR];
  for (int j = 0; j < NR; ++j) b[j] = _mm512_loadu_si512(t.w + j * t.panel + k * 2 * kPanel);
  for (int i = 0; i < MR; ++i) {
    const __m512i a = _mm512_set1_epi32(pair_at(t.x + i * t.xs + 2 * k));
    for (int j = 0; j < NR; ++j)
      acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)a, (__m512bh)b[j]);
  }
}

// AHEAD > 0: a row tile streaming the weight; 0: many rows, the next group's share requested
// between batches of steps (kBatchLines).
template <int MR, int NR, int64_t AHEAD>
__attribute__((target("avx512f,avx512bf16"))) void tile_bf16_dp(const Tile<at::BFloat16>& t) {
  __m512 acc[MR][NR];
  load_acc<MR, NR>(t, acc);
  Ahead<at::BFloat16> ahead(t, 2 * kPanel);
  if constexpr (AHEAD > 0) {
    for (int64_t k = t.k0; k < t.k1; ++k) {
      prefetch_panels<AHEAD, at::BFloat16, NR>(t, k, 2 * kPanel);
      ahead.advance();
      dp_step<MR, NR>(t, k, acc);
    }
  } else {
    const int64_t batch = ahead.batch_steps(t.k1 - t.k0);
    for (int64_t c = t.k0; c < t.k1; c += batch) {
      const int64_t c1 = std::min(t.k1, c + batch);
      ahead.advance(c1 - c);
      for (int64_t k = c; k < c1; ++k) dp_step<MR, NR>(t, k, acc);
    }
  }
  store_acc<MR, NR>(t, acc);
}

template <int MR, int NR, int64_t AHEAD>
__attribute__((target("avx512f"))) void tile_bf16_fma(const Tile<at::BFloat16>& t) {
  __m512 acc[MR][NR];
  load_acc<MR, NR>(t, acc);
  const at::BFloat16* w = t.w;
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  Ahead<at::BFloat16> ahead(t, 2 * kPanel);
  for (int64_t k = t.k0; k < t.k1; ++k) {
    prefetch_panels<AHEAD, at::BFloat16, NR>(t, k, 2 * kPanel);
    ahead.advance();
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

// ---- AVX2 tiles (a CPU without AVX-512F) -----------------------------------------------------
// The same panels and row tiles on 256-bit vectors: a panel's 16 outputs are two vectors, so
// an MR x NR tile's 2 * MR * NR sums would outgrow AVX2's 16 registers. A tile runs as blocks
// of PB panels (MR * PB <= 6: 12 sums, a panel's two weight vectors and a broadcast of x),
// each block over the tile's slice of K. The blocks read disjoint panels, so a row tile that
// streams the weight still reads it once, PB panels side by side. bfloat16 pairs widen as in
// tile_bf16_fma (the even feature by a shift, the odd one by a mask), against x widened to
// fp32 once a call (Tile::xf): one broadcast per feature and row.
template <int MR, int PB, typename T>
__attribute__((target("avx2,fma"))) inline void avx2_load_acc(const Tile<T>& t, int j0,
                                                              __m256 (&acc)[MR][2 * PB]) {
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 12
    for (int h = 0; h < 2 * PB; ++h) {
      const int64_t at = i * t.ys + j0 * kPanel + h * 8;
      if (t.first) {
        acc[i][h] = t.bias != nullptr ? _mm256_loadu_ps(t.bias + j0 * kPanel + h * 8)
                                      : _mm256_setzero_ps();
      } else if constexpr (std::is_same_v<T, float>) {
        acc[i][h] = _mm256_loadu_ps(t.y + at);
      } else {
        acc[i][h] = _mm256_loadu_ps(t.acc + at);
      }
    }
}

template <int MR, int PB, typename T>
__attribute__((target("avx2,fma"))) inline void avx2_store_acc(const Tile<T>& t, int j0,
                                                               const __m256 (&acc)[MR][2 * PB]) {
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 12
    for (int h = 0; h < 2 * PB; ++h) {
      const int64_t at = i * t.ys + j0 * kPanel + h * 8;
      if constexpr (std::is_same_v<T, float>) {
        _mm256_storeu_ps(t.y + at, acc[i][h]);
      } else if (t.last && t.yf != nullptr) {  // the bf16 value, widened
        const __m256i bits = _mm256_slli_epi32(bf16_round_bits8(acc[i][h]), 16);
        _mm256_storeu_ps(t.yf + at, _mm256_castsi256_ps(bits));
      } else if (t.last) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(t.y + at), bf16_round8(acc[i][h]));
      } else {
        _mm256_storeu_ps(t.acc + at, acc[i][h]);
      }
    }
}

// One step of K of a block of PB panels from w: float32 weights against x of rows xs apart.
template <int MR, int PB>
__attribute__((target("avx2,fma"))) ALWAYS_INLINE_PANEL void avx2_step(
    const float* w, int64_t panel, const float* x, int64_t xs, int64_t k,
    __m256 (&acc)[MR][2 * PB]) {
#pragma GCC unroll 12
  for (int j = 0; j < PB; ++j) {
    const __m256 b0 = _mm256_loadu_ps(w + j * panel + k * kPanel);
    const __m256 b1 = _mm256_loadu_ps(w + j * panel + k * kPanel + 8);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * xs + k);
      acc[i][2 * j] = _mm256_fmadd_ps(a, b0, acc[i][2 * j]);
      acc[i][2 * j + 1] = _mm256_fmadd_ps(a, b1, acc[i][2 * j + 1]);
    }
  }
}

// bfloat16 pairs: the even feature of every panel against x's, then the odd one.
template <int MR, int PB>
__attribute__((target("avx2,fma"))) ALWAYS_INLINE_PANEL void avx2_step(
    const at::BFloat16* w, int64_t panel, const float* x, int64_t xs, int64_t k,
    __m256 (&acc)[MR][2 * PB]) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
#pragma GCC unroll 2
  for (int odd = 0; odd < 2; ++odd)
#pragma GCC unroll 12
    for (int j = 0; j < PB; ++j) {
      const at::BFloat16* pair = w + j * panel + k * 2 * kPanel;
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 16));
      const __m256 b0 =
          _mm256_castsi256_ps(odd ? _mm256_and_si256(v0, high) : _mm256_slli_epi32(v0, 16));
      const __m256 b1 =
          _mm256_castsi256_ps(odd ? _mm256_and_si256(v1, high) : _mm256_slli_epi32(v1, 16));
#pragma GCC unroll 12
      for (int i = 0; i < MR; ++i) {
        const __m256 a = _mm256_broadcast_ss(x + i * xs + 2 * k + odd);
        acc[i][2 * j] = _mm256_fmadd_ps(a, b0, acc[i][2 * j]);
        acc[i][2 * j + 1] = _mm256_fmadd_ps(a, b1, acc[i][2 * j + 1]);
      }
    }
}

// Panels [j0, j0 + PB) of tile t over its slice of K, the tile's share of the next group's
// lines requested a batch of steps at a time (as tile_bf16_dp does).
template <int MR, int PB, int64_t AHEAD, typename T>
__attribute__((target("avx2,fma"))) void avx2_block(const Tile<T>& t, int j0, Ahead<T>& ahead) {
  constexpr bool kFloat = std::is_same_v<T, float>;
  constexpr int64_t kWidth = kFloat ? kPanel : 2 * kPanel;  // elements a step of K
  __m256 acc[MR][2 * PB];
  avx2_load_acc<MR, PB>(t, j0, acc);
  Tile<T> block = t;  // the block's panels, for prefetch_panels
  block.w = t.w + j0 * t.panel;
  const float* x;
  int64_t xs;
  if constexpr (kFloat) {
    x = t.x, xs = t.xs;
  } else {
    x = t.xf, xs = t.xfs;
  }
  const T* w = block.w;
  const int64_t panel = t.panel, batch = ahead.batch_steps(t.k1 - t.k0);
  for (int64_t c = t.k0; c < t.k1; c += batch) {
    const int64_t c1 = std::min(t.k1, c + batch);
    ahead.advance(c1 - c);
    for (int64_t k = c; k < c1; ++k) {
      prefetch_panels<AHEAD, T, PB>(block, k, kWidth);
      avx2_step<MR, PB>(w, panel, x, xs, k, acc);
    }
  }
  avx2_store_acc<MR, PB>(t, j0, acc);
}

template <int MR, int NR, int PB, int64_t AHEAD, typename T>
inline void avx2_blocks(const Tile<T>& t, int j0, Ahead<T>& ahead) {
  if constexpr (NR > 0) {
    constexpr int now = PB < NR ? PB : NR;
    avx2_block<MR, now, AHEAD, T>(t, j0, ahead);
    avx2_blocks<MR, NR - now, PB, AHEAD>(t, j0 + now, ahead);
  }
}

template <int MR, int NR, int64_t AHEAD, typename T>
void tile_avx2(const Tile<T>& t) {
  // bfloat16 at 2-3 rows: 2 and 1 panels (4-6 sums), since the widened weights of 3 and 2
  // panels took registers from the sums (GCC kept them on the stack)
  constexpr int kSums = std::is_same_v<T, float> || MR == 1 || MR > 3 ? 6 : 4;
  constexpr int PB = kSums / MR < 1 ? 1 : kSums / MR;
  claim_outputs<MR, NR>(t);
  Ahead<T> ahead(t, std::is_same_v<T, float> ? kPanel : 2 * kPanel);
  avx2_blocks<MR, NR, PB, AHEAD>(t, 0, ahead);
}

template <int MR, int NR, int64_t AHEAD>
void tile_ahead(const Tile<float>& t) {
  if (t.avx2) tile_avx2<MR, NR, AHEAD>(t); else tile_f32<MR, NR, AHEAD>(t);
}

template <int MR, int NR, int64_t AHEAD>
void tile_ahead(const Tile<at::BFloat16>& t) {
  if (t.avx2) tile_avx2<MR, NR, AHEAD>(t);
  else if (t.dp) tile_bf16_dp<MR, NR, AHEAD>(t);
  else tile_bf16_fma<MR, NR, AHEAD>(t);
}

// The stream distance of this call (panel_ahead_bytes) as the kernels' template argument; 0
// for vdpbf16ps over many rows (tile_bf16_dp's batches of Ahead's requests, none where a row
// tile streams the weight) and for a row tile streaming with no requests (Zen 5).
template <int MR, int NR, typename T>
void tile(const Tile<T>& t) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (t.dp && t.w_end == nullptr) return tile_bf16_dp<MR, NR, 0>(t);  // many rows: Ahead
  }
  if (t.w_end != nullptr && t.stream_ahead == 0) return tile_ahead<MR, NR, 0>(t);
  if (t.stream_ahead == kPanelAheadShort)
    tile_ahead<MR, NR, kPanelAheadShort>(t);
  else
    tile_ahead<MR, NR, kPanelAheadLong>(t);
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

// ---- AMX tiles (bfloat16, more than kMaxMR rows) ----------------------------------------------
// One tdpbf16ps multiplies a tile of 16 rows x 32 features of x (16 x 64 bytes) by a tile of
// 32 features x 16 outputs in pairs (16 x 64 bytes), adding into 16 x 16 fp32 sums. The bf16
// panel layout's 16 pairs of a panel are that second tile as stored (one tileloadd, stride 64
// bytes), so a group of 4 panels is 4 tiles of sums (tmm0-3) against one tile of x (tmm4), the
// weights passing through tmm5-7. Rows go in blocks of 16 (x padded with zero rows to a
// multiple of 16); a group's panels stay in L2 while every block passes over them.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12's tile intrinsics are asm statements that do not tell the compiler which memory they
// read or write (_tile_loadconfig names 8 bytes of the 64, and the rows and widths were dropped
// as dead stores): the configuration is loaded with the whole of it as the operand, and
// amx_block fences the compiler's memory order on entry and exit.
__attribute__((target("amx-tile"))) void amx_begin() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  asm volatile("ldtilecfg %0" : : "m"(config));
}

inline void memory_fence_for_compiler() { asm volatile("" : : : "memory"); }

__attribute__((target("amx-tile"))) void amx_end() { _tile_release(); }

// sums [16][kMaxNR * 16] = 16 rows of x (rows of x_bytes) . panels [0, NR) at w, `pairs` pairs of
// features (a multiple of 16) from the panels' first.
template <int NR>
__attribute__((target("amx-tile,amx-bf16"))) void amx_block(const at::BFloat16* x,
                                                             int64_t x_bytes,
                                                             const at::BFloat16* w, int64_t panel,
                                                             int64_t pairs, float* sums) {
  memory_fence_for_compiler();  // x and w as written before the call
  _tile_zero(0);
  if constexpr (NR > 1) _tile_zero(1);
  if constexpr (NR > 2) _tile_zero(2);
  if constexpr (NR > 3) _tile_zero(3);
  for (int64_t s = 0; s < pairs; s += 16) {
    const at::BFloat16* ws = w + s * 2 * kPanel;
    _tile_loadd(4, x + 2 * s, x_bytes);
    _tile_loadd(5, ws, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NR > 1) {
      _tile_loadd(6, ws + panel, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NR > 2) {
      _tile_loadd(7, ws + 2 * panel, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NR > 3) {
      _tile_loadd(5, ws + 3 * panel, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  constexpr int64_t stride = kMaxNR * kPanel * sizeof(float);
  _tile_stored(0, sums, stride);
  if constexpr (NR > 1) _tile_stored(1, sums + kPanel, stride);
  if constexpr (NR > 2) _tile_stored(2, sums + 2 * kPanel, stride);
  if constexpr (NR > 3) _tile_stored(3, sums + 3 * kPanel, stride);
  memory_fence_for_compiler();  // sums as the tiles stored them
}

// One K slice of panels [p, p + nr) for every row: x (a multiple of 16 rows of xs elements, at
// the slice's first feature), the weight at w (panel elements apart), `pairs` of features. The
// sums go to y (the last slice, rounded) or to acc (fp32 [rows][ys]), with the bias (first
// slice) or acc's earlier sums added, as the AVX-512 tiles do.
struct AmxSlice {
  const at::BFloat16* x;
  int64_t xs, rows;  // rows: the real ones (x has them padded to a multiple of 16)
  const at::BFloat16* w;
  int64_t panel, pairs;
  const float* bias;  // this group's, or null
  at::BFloat16* y;    // this group's first output of row 0
  float* acc;         // likewise, or null (one slice)
  int64_t ys;
  bool first, last;
};

// Blocks of 16 rows run on AMX tiles in this process (amx_blocks()).
std::atomic<int64_t> amx_block_count{0};

__attribute__((target("avx512f"))) void amx_slice(const AmxSlice& a, int nr) {
  amx_block_count.fetch_add((a.rows + 15) / 16, std::memory_order_relaxed);
  alignas(64) float sums[16][kMaxNR * kPanel];
  for (int64_t r0 = 0; r0 < a.rows; r0 += 16) {
    const at::BFloat16* x = a.x + r0 * a.xs;
    const int64_t x_bytes = a.xs * int64_t(sizeof(at::BFloat16));
    switch (nr) {
      case 1: amx_block<1>(x, x_bytes, a.w, a.panel, a.pairs, &sums[0][0]); break;
      case 2: amx_block<2>(x, x_bytes, a.w, a.panel, a.pairs, &sums[0][0]); break;
      case 3: amx_block<3>(x, x_bytes, a.w, a.panel, a.pairs, &sums[0][0]); break;
      default: amx_block<4>(x, x_bytes, a.w, a.panel, a.pairs, &sums[0][0]); break;
    }
    for (int64_t i = 0; i < std::min<int64_t>(16, a.rows - r0); ++i)
      for (int j = 0; j < nr; ++j) {
        const int64_t at = (r0 + i) * a.ys + j * kPanel;
        __m512 v = _mm512_load_ps(&sums[i][j * kPanel]);
        if (!a.first)
          v = _mm512_add_ps(v, _mm512_loadu_ps(a.acc + at));
        else if (a.bias != nullptr)
          v = _mm512_add_ps(v, _mm512_loadu_ps(a.bias + j * kPanel));
        if (a.last)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.y + at), bf16_round16(v));
        else
          _mm512_storeu_ps(a.acc + at, v);
      }
  }
}

// x [M, K] bf16 as the tiles read it: itself when M is a multiple of 16, else a copy with zero
// rows up to one. Plain copies, only the padding zeroed: at::zeros with a narrowed copy_ took
// 15-20 us a product at 40-64 rows of the 125M model (three dispatched ops, the whole tile
// written twice), about 0.9 ms of a 24 ms decode step of 40 rows.
at::Tensor amx_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), padded = (m + 15) / 16 * 16;
  if (padded == m) return x;
  at::Tensor xp = at::empty({padded, k}, x.options());
  auto* dst = xp.data_ptr<at::BFloat16>();
  const auto* src = x.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(dst + r * k, src + r * x.stride(0), k * sizeof(at::BFloat16));
  std::memset(dst + m * k, 0, (padded - m) * k * sizeof(at::BFloat16));
  return xp;
}

// Rows of x a pass over the panels takes on AMX (a multiple of 16): as many as keep
// kAmxRowBytes of x in L2 while every panel group passes over them. One pass over all of
// prefill's rows read x again from memory for each group of 4 panels (2,048 rows of the 125M
// model's gate_up: 64 groups x 3 MB).
constexpr int64_t kAmxRowBytes = 512 << 10;

int64_t amx_row_chunk(int64_t m, int64_t k) {
  const int64_t rows = std::max<int64_t>(16, kAmxRowBytes / (k * 2) / 16 * 16);
  return std::min(rows, (m + 15) / 16 * 16);
}

// Panels [p0, p1) of y for all rows on AMX, whole K per group (the group's panels stay in L2),
// the rows in chunks of amx_row_chunk.
void amx_panels(const at::Tensor& xp, int64_t m, const at::Tensor& w, const float* bias,
                at::Tensor& y, int64_t p0, int64_t p1) {
  const int64_t pairs = w.size(1), panel = pairs * 2 * kPanel;
  const int64_t chunk = amx_row_chunk(m, 2 * pairs);
  amx_begin();
  for (int64_t r = 0; r < m; r += chunk)
    for (int64_t p = p0; p < p1; p += kMaxNR) {
      const int nr = int(std::min<int64_t>(kMaxNR, p1 - p));
      AmxSlice a{xp.data_ptr<at::BFloat16>() + r * xp.stride(0), xp.stride(0),
                 std::min(chunk, m - r), w.data_ptr<at::BFloat16>() + p * panel, panel, pairs,
                 bias != nullptr ? bias + p * kPanel : nullptr,
                 y.data_ptr<at::BFloat16>() + r * y.stride(0) + p * kPanel, nullptr,
                 y.stride(0), true, true};
      amx_slice(a, nr);
    }
  amx_end();
}

// Panels [p0, p1) of y for rows [r0, r1): K in slices that keep a panel group's weight in L2,
// each slice over every group of kMaxNR panels and every tile of kMaxMR rows. AVX2 tiles where
// avx2 (xf: a bfloat16 x widened to fp32, [M, K]).
template <typename T>
void panels(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y,
            float* acc, bool dp, bool avx2, const float* xf, int64_t p0, int64_t p1, int64_t r0,
            int64_t r1, int64_t after = -1) {
  const int64_t m = x.size(0), steps = w.size(1), width = w.size(2);  // width: 16 or 32
  const int64_t panel = steps * width;
  const int64_t slice = slice_steps(m, steps, width, sizeof(T));
  Tile<T> t{};
  t.dp = dp;
  t.avx2 = avx2;
  t.xfs = x.size(1);
  t.xs = x.stride(0);
  t.panel = panel;
  t.ys = y.stride(0);
  // the prefetch runs on past p1: a thread's next chunk is the group after (balanced_for)
  if (m <= kMaxMR) {
    t.w_end = w.data_ptr<T>() + w.size(0) * panel;
    t.stream_ahead = panel_ahead_bytes(std::is_same_v<T, float> && m == 1);
  }
  int64_t requested = 0;  // lines requested a group ahead (ahead_lines(), counted once a call)
  for (int64_t k0 = 0; k0 < steps; k0 += slice) {
    t.k0 = k0;
    t.k1 = std::min(steps, k0 + slice);
    t.first = k0 == 0;
    t.last = t.k1 == steps;
    for (int64_t p = p0; p < p1; p += kMaxNR) {
      const int nr = int(std::min<int64_t>(kMaxNR, p1 - p));
      t.w = w.data_ptr<T>() + p * panel;
      t.bias = bias != nullptr ? bias + p * kPanel : nullptr;
      // many rows: the group after this one (this slice of it; past the last group, the
      // first group's next slice, then the group this thread is likely to take next)
      int64_t next = -1, next_k0 = k0;
      if (p + kMaxNR < p1) next = p + kMaxNR;
      else if (k0 + slice < steps) next = p0, next_k0 = k0 + slice;
      else if (after >= 0) next = after, next_k0 = 0;
      t.ahead = nullptr;
      const int64_t tiles = (r1 - r0 + kMaxMR - 1) / kMaxMR;
      int64_t lines = 0;
      if (m > kMaxMR && next >= 0 && next < w.size(0)) {
        t.ahead_nr = int(std::min<int64_t>(kMaxNR, w.size(0) - next));
        t.ahead = w.data_ptr<T>() + next * panel + next_k0 * width;
        lines = t.ahead_nr * (std::min(steps, next_k0 + slice) - next_k0);
        requested += lines;
      }
      for (int64_t r = r0; r < r1; r += kMaxMR) {
        const int mr = int(std::min<int64_t>(kMaxMR, r1 - r));
        ahead_share(t, (r - r0) / kMaxMR, tiles, lines);
        t.x = x.data_ptr<T>() + r * t.xs;
        t.xf = xf != nullptr ? xf + r * t.xfs : nullptr;
        point_output(t, y, r, p);
        t.acc = acc != nullptr ? acc + r * t.ys + p * kPanel : nullptr;
        tile_any<T>(mr, nr, t);
      }
    }
  }
  if (requested > 0) ahead_line_count.fetch_add(requested, std::memory_order_relaxed);
}

// ---- quantized panels (weight-only int8 / int4) ---------------------------------------------
// codes int8 [N/16][K][16] (int8) or uint8 [N/16][K/2][16] (int4: byte j of step s holds
// q[16p + j, 2s] in its low nibble and q[16p + j, 2s + 1] in its high one); scale and, for
// int4, offset [N/16][K/G][16], fp32, or fp16 as a GGUF file stores them (fewer bytes to
// stream: 0.625 against 0.75 per int4 weight): w = scale * q (+ offset). Each is stored four
// panels at a time (Quant::block / Quant::constant): a decode product reads three long streams
// where one per 4.6 KB panel (SmolLM2's int4) left the hardware prefetcher to start over on
// every panel (the 120 layer products of a SmolLM2 step at one row, in one process against the
// panel-by-panel order over 300 interleaved rounds: 12-13% faster on one thread, 3-4% on two;
// a development A/B, not kept as a command). A slice of K of one panel group at a time is
// dequantized into a per-thread scratch in the float panel layout (bf16 pairs for a bf16 x,
// fp32 otherwise) and run by the float micro-kernel over every row of x: the codes stream from
// memory once per call, the scratch stays in L2 (4 panels x 1,024 features: 128 KB in bf16,
// 256 KB in fp32). Slices of 256 (the scratch in L1) cost the tiles a round trip of their fp32
// partial sums per slice: the 49,152-row LM head at 48 / 256 rows of bf16 x took 10.2-10.7 /
// 62-74 ms against 8.4-9.0 / 35-39 ms with whole 576-feature rows.
constexpr int64_t kQuantSliceK = 1024;  // input features per dequantized slice (a multiple of 32)

// fn(p, nr) over panels [p0, p1) in runs of up to kMaxNR panels of one stored group (Quant): a
// thread's share of whole panels need not start at a group, which keeps two threads even
// (SmolLM2's 36-panel products split 18 / 18 rather than 20 / 16).
template <typename F>
inline void stored_groups(int64_t p0, int64_t p1, const F& fn) {
  for (int64_t p = p0; p < p1;) {
    const int64_t end = std::min(p1, (p / kMaxNR + 1) * kMaxNR);
    fn(p, int(end - p));
    p = end;
  }
}

struct Quant {
  const uint8_t* codes;
  const void* scale;
  const void* offset;  // null for int8
  int64_t n, k, group, groups;
  bool int4;
  bool half;  // scale and offset in fp16

  // Panels are stored in groups of kMaxNR (the last may hold fewer), a group block by block:
  // block b of its panels side by side, then block b + 1 (the codes; the constants likewise,
  // per group of features). A decode product then reads its weight as a few long streams, where
  // panel after panel gave every 4.6 KB panel of SmolLM2 its own short one.
  int64_t panels() const { return n / kPanel; }
  int64_t blocks() const { return k / 32; }
  int64_t in_group(int64_t p) const {  // panels in p's group
    return std::min<int64_t>(kMaxNR, panels() - p / kMaxNR * kMaxNR);
  }
  // Panel p's codes of block b (32 input features: 256 bytes in int4, 512 in int8).
  const uint8_t* block(int64_t p, int64_t b) const {
    const int64_t first = p / kMaxNR * kMaxNR, bytes = (int4 ? 16 : 32) * kPanel;
    return codes + (first * blocks() + b * in_group(p) + (p - first)) * bytes;
  }
  // The element of scale / offset where panel p's 16 constants of feature group c start.
  int64_t constant(int64_t p, int64_t c) const {
    const int64_t first = p / kMaxNR * kMaxNR;
    return (first * groups + c * in_group(p) + (p - first)) * kPanel;
  }

  // The 16 outputs' constants of one group at element c of scale / offset, as fp32.
  __attribute__((target("avx512f"))) __m512 at(const void* base, int64_t c) const {
    if (half) {
      const uint16_t* h = static_cast<const uint16_t*>(base) + c;
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
    }
    return _mm512_loadu_ps(static_cast<const float*>(base) + c);
  }
};

// codes, scale and offset as quant_panel_linear and quant_panel_rows take them, checked: codes
// int8 [N / 16, K, 16] (8 bits) or uint8 [N / 16, K / 2, 16] (4 bits), scale fp32 / fp16
// [N / 16, K / G, 16] with G a multiple of 32, offset like scale for 4 bits and absent for 8.
Quant quant_operands(const at::Tensor& codes, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& offset, int64_t bits, const char* op) {
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits 4 or 8");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kPanel && codes.is_contiguous() &&
                  codes.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              op, ": codes [N / 16, K (/ 2), 16] of uint8 (int4) / int8");
  const int64_t n = codes.size(0) * kPanel, k = codes.size(1) * (bits == 4 ? 2 : 1);
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == codes.size(0) && scale.size(2) == kPanel &&
                  (half || scale.scalar_type() == at::kFloat) && scale.is_contiguous(),
              op, ": scale fp32 / fp16 [N / 16, K / G, 16]");
  const int64_t groups = scale.size(1);
  TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % 32 == 0,
              op, ": groups of a multiple of 32 input features");
  TORCH_CHECK((bits == 4) == offset.has_value(), op, ": int4 has offsets, int8 none");
  if (offset.has_value())
    TORCH_CHECK(offset->sizes() == scale.sizes() && offset->scalar_type() == scale.scalar_type() &&
                    offset->is_contiguous(), op, ": offset like scale");
  return Quant{reinterpret_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr(),
               offset.has_value() ? offset->data_ptr() : nullptr,
               n, k, k / groups, groups, bits == 4, half};
}

// The codes of a panel's 16 outputs at features t and t + 1 (t even) of the block at `at`, as
// fp32.
template <bool INT4>
__attribute__((target("avx512f"))) inline void codes_pair(const uint8_t* at, int64_t t,
                                                          __m512& even, __m512& odd) {
  if constexpr (INT4) {
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + t / 2 * kPanel)));
    even = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  } else {
    const int8_t* row = reinterpret_cast<const int8_t*>(at) + t * kPanel;
    even = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
    odd = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + kPanel))));
  }
}

// Round to bf16 (nearest even) and interleave: lane j = (bf16(even[j]), bf16(odd[j])).
__attribute__((target("avx512f"))) inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  return _mm512_or_si512(_mm512_srli_epi32(bf16_rounded_bits(even), 16),
                         _mm512_and_si512(bf16_rounded_bits(odd), high));
}

// Panels [p, p + nr) at input features [k0, k1) as the float panel layout (w = d q + m).
template <bool INT4, typename T>
__attribute__((target("avx512f"))) void dequant_slice(const Quant& q, int64_t p, int nr,
                                                      int64_t k0, int64_t k1, T* out) {
  for (int j = 0; j < nr; ++j)
    for (int64_t b = k0; b < k1; b += 32) {  // a group holds whole blocks of 32 features
      const int64_t c = q.constant(p + j, b / q.group);
      const __m512 d = q.at(q.scale, c);
      const __m512 m = INT4 ? q.at(q.offset, c) : _mm512_setzero_ps();
      for (int64_t k = b; k < b + 32; k += 2) {
        __m512 even, odd;
        codes_pair<INT4>(q.block(p + j, k / 32), k % 32, even, odd);
        even = _mm512_fmadd_ps(even, d, m);
        odd = _mm512_fmadd_ps(odd, d, m);
        T* dst = out + (j * kQuantSliceK + (k - k0)) * kPanel;  // bf16: (k - k0) / 2 pairs of 32
        if constexpr (std::is_same_v<T, float>) {
          _mm512_storeu_ps(dst, even);
          _mm512_storeu_ps(dst + kPanel, odd);
        } else {
          _mm512_storeu_si512(dst, bf16_pairs(even, odd));
        }
      }
    }
}

// The weight kAheadBytes ahead of a block of panels [p, p + nr) is requested into L2: the codes
// in the stored order, which runs on from a group's last block into the next group's first
// (the groups lie one after another), and the constants as far ahead in their own order (once
// per feature group). At one row a product only streams its weight, and the hardware
// prefetcher alone kept SmolLM2's Q4_1 products well below the read bandwidth. Measured on a
// 2-core Xeon with AMX (a development A/B in one process, 25 interleaved rounds, the weights
// cold): the 120 one-row Q4_1 products of a step 4.27 -> 3.97 ms median, the Q8_0 head after
// them 1.08 -> 0.82 ms; 4 to 16 KB ahead measured alike.
constexpr int64_t kAheadBytes = 8192;

// One stored group's weight as the small-row kernels walk it, block by block from panel p:
// the codes and the constants advance by fixed steps (the index arithmetic of Quant::block
// and Quant::constant, with a division by the group size, done once per tile rather than per
// block and panel), and prefetch requests what lies kAheadBytes ahead.
struct GroupWalk {
  const uint8_t* codes;      // panel p's block b
  int64_t code_step;         // bytes from block b to b + 1 (in_group panels side by side)
  int64_t block_bytes;       // one panel's block
  int64_t constant;          // the element of panel p's constants of block b's feature group
  int64_t constant_step;     // elements from one feature group to the next
  int64_t per_group;         // blocks per feature group
  int64_t left;              // blocks of this feature group from the current one on
  const char* codes_end;
  int64_t constants_ahead;   // bytes, the constants' distance matching kAheadBytes of codes
  int64_t constants_end;     // bytes

  GroupWalk(const Quant& q, int64_t p) {
    const int64_t bits = q.int4 ? 4 : 8, elem = q.half ? 2 : 4;
    codes = q.block(p, 0);
    block_bytes = 32 * kPanel * bits / 8;
    code_step = q.in_group(p) * block_bytes;
    constant = q.constant(p, 0);
    constant_step = q.in_group(p) * kPanel;
    per_group = left = q.group / 32;
    codes_end = reinterpret_cast<const char*>(q.codes) + q.n * q.k * bits / 8;
    // The constants' order advances elem * 16 bytes per panel and feature group, the codes'
    // group * 16 * bits / 8: the same distance in features is this many bytes of constants.
    constants_ahead = kAheadBytes * elem * 8 / (q.group * bits);
    constants_end = q.n * q.groups * elem;
  }

  // On to the next block (a counter, not a division per block).
  void next() {
    codes += code_step;
    if (--left == 0) constant += constant_step, left = per_group;
  }

  void prefetch(const Quant& q, int nr) const {
    const char* ahead = reinterpret_cast<const char*>(codes) + kAheadBytes;
    for (int64_t line = 0; line < nr * block_bytes; line += 64)
      if (ahead + line < codes_end) to_l2(ahead + line);
    if (left != per_group) return;  // the constants once per feature group
    const int64_t elem = q.half ? 2 : 4, c = constant * elem + constants_ahead;
    for (int64_t line = 0; line < nr * kPanel * elem; line += 64) {
      if (c + line >= constants_end) break;
      to_l2(static_cast<const char*>(q.scale) + c + line);
      if (q.int4) to_l2(static_cast<const char*>(q.offset) + c + line);
    }
  }
};

// Up to kSmallRows rows (decode): the codes unpacked in registers, never stored. Per block of
// 32 input features, s = sum_k x[k] q[k] over the block's codes, then y += d * s (+ m *
// sum_k x[k] for int4): the group constants are applied once per block, not per weight. x in
// fp32 (exact), xsum its per-block sums (int4 only).
constexpr int kSmallRows = 8;  // beyond: the dequantized scratch (measured crossover)

template <int MR, int NR, bool INT4>
__attribute__((target("avx512f"))) void quant_tile_small(const Quant& q, const float* x,
                                                         const float* xsum, int64_t p,
                                                         const float* bias,
                                                         float (&out)[MR][NR][16]) {
  GroupWalk walk(q, p);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      acc[i][j] = bias != nullptr ? _mm512_loadu_ps(bias + j * kPanel) : _mm512_setzero_ps();
  const int64_t blocks = q.k / 32;
  for (int64_t b = 0; b < blocks; walk.next(), ++b) {
    if (MR <= 2) walk.prefetch(q, NR);
    __m512 s[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) s[i][j] = _mm512_setzero_ps();
    const float* xb = x + b * 32;
    for (int t = 0; t < 32; t += 2) {
      for (int j = 0; j < NR; ++j) {
        __m512 lo, hi;
        codes_pair<INT4>(walk.codes + j * walk.block_bytes, t, lo, hi);
        for (int i = 0; i < MR; ++i) {
          s[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(xb[i * q.k + t]), lo, s[i][j]);
          s[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(xb[i * q.k + t + 1]), hi, s[i][j]);
        }
      }
    }
    for (int j = 0; j < NR; ++j) {
      const int64_t c = walk.constant + j * kPanel;
      const __m512 d = q.at(q.scale, c);
      if constexpr (INT4) {
        const __m512 m = q.at(q.offset, c);
        for (int i = 0; i < MR; ++i)
          acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[i * blocks + b]), m,
                                      _mm512_fmadd_ps(s[i][j], d, acc[i][j]));
      } else {
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(s[i][j], d, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(out[i][j], acc[i][j]);
}

// Up to kVnniRows rows on a CPU with AVX512-VNNI and VBMI, when asked: x quantized to int8
// per block of 32 features (scale max|x| / 127, as llama.cpp's q8_0 / q8_1 activations) and
// the codes multiplied in int32, four bytes per lane per vpdpbusd: 64 codes of 16 outputs
// (4 steps) are one load and a byte permute (lane j: its 4 steps), then for int4 a nibble
// split, for int8 a flip of the top bit (vpdpbusd takes the codes unsigned, q + 128, and x
// signed: 128 times x's block sum is taken off again, one integer per row and block);
// y += d * sx * s (+ m * sx * sum_k q[k]). One row of int4 codes streamed at 25-35 GB/s
// against 18-25 with the fp32 unpacking above (8 matrices of 4-6 MB, 2 threads).
// x words per row: int4, per 8 features, (q[0], q[2], q[4], q[6]) then (q[1], q[3], ...);
// int8, per 4 features, q[0..3].
// Beyond kVnniRows rows x stays float ("avx512_vnni"): a prompt's rows on int8 x turn
// SmolLM2's Q4_1 answer to "What is the capital of France?" into French babble (llama.cpp,
// which rounds every row, answers the same babble). A decode step's rows take int8 x at any
// count ("avx512_vnni_all", quantization.x_form), the numerics of one decoding sequence, in
// tiles of 4 rows over each group of 4 panels (the group stays in cache): SmolLM2's Q4_1 file
// decoding 8 / 48 sequences 2.0-2.1x / 1.6-1.7x the float path's step on fp32 x, 2.0-2.1x /
// 1.2-1.3x on bf16 x (the builds taking turns, profile_decode.py --batch).
constexpr int kVnniRows = 4;
constexpr int kResidualRows = 1;  // two kernel rows each; at 2 rows the fp32 path was as fast

bool detect_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
}

bool cpu_has_vnni() {
  static const bool has = detect_vnni();
  return has;
}

std::atomic<bool>& vnni_flag() {
  static std::atomic<bool> flag{cpu_has_vnni()};
  return flag;
}

// Row x [k] -> words [k / 4], scales [k / 32] and the rounded x's block sums [k / 32] in
// integers (the int4 offsets meet the same x as the codes: their errors then cancel as in
// x w, q8_1's way). residual (when not null) [k]: x less its rounded form, the second part of
// a residual row.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi"))) void quantize_row(
    const float* x, int64_t k, bool int4, int32_t* words, float* sx, int32_t* qsum,
    float* residual = nullptr) {
  // The int4 word order as a byte permute: out byte 4 w + t takes q[8 (w / 2) + 2 t + w % 2].
  alignas(32) int8_t order[32];
  for (int w = 0; w < 8; ++w)
    for (int t = 0; t < 4; ++t) order[4 * w + t] = (int8_t)(8 * (w / 2) + 2 * t + (w % 2));
  const __m256i idx = _mm256_load_si256(reinterpret_cast<const __m256i*>(order));
  for (int64_t b = 0; b < k / 32; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * 32), hi = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    sx[b] = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    // x * inv rounded to nearest even (nearbyint under the default rounding mode), |q| <= 127
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    qsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    if (residual != nullptr) {
      const __m512 d = _mm512_set1_ps(sx[b]);
      _mm512_storeu_ps(residual + b * 32, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo), d, lo));
      _mm512_storeu_ps(residual + b * 32 + 16, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi), d, hi));
    }
    __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(qlo)),
                                        _mm512_cvtepi32_epi8(qhi), 1);
    if (int4) q = _mm256_permutexvar_epi8(idx, q);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + b * 8), q);
  }
}

template <int MR, int NR, bool INT4>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi"))) void quant_tile_vnni(
    const Quant& q, const int32_t* xw, const float* xs, const int32_t* xq_sum, int64_t p,
    const float* bias, float (&out)[MR][NR][16]) {
  // Lane j of a permuted load: bytes (step t, output j) for t = 0..3, from byte 16 t + j.
  alignas(64) int8_t order[64];
  for (int j = 0; j < 16; ++j)
    for (int t = 0; t < 4; ++t) order[4 * j + t] = (int8_t)(16 * t + j);
  const __m512i idx = _mm512_load_si512(order);
  const __m512i nibble = _mm512_set1_epi8(15), top = _mm512_set1_epi8(-128);
  GroupWalk walk(q, p);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      acc[i][j] = bias != nullptr ? _mm512_loadu_ps(bias + j * kPanel) : _mm512_setzero_ps();
  const int64_t blocks = q.k / 32, row_words = q.k / 4;
  for (int64_t b = 0; b < blocks; walk.next(), ++b) {
    walk.prefetch(q, NR);
    __m512i s[MR][NR];
    for (int j = 0; j < NR; ++j)
      for (int i = 0; i < MR; ++i) s[i][j] = _mm512_setzero_si512();
    for (int v = 0; v < 8; v += INT4 ? 2 : 1) {  // 64 code bytes each
      for (int j = 0; j < NR; ++j) {
        const uint8_t* src = walk.codes + j * walk.block_bytes + (INT4 ? v * 2 : v * 4) * kPanel;
        const __m512i c = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(src));
        if constexpr (INT4) {
          const __m512i lo = _mm512_and_si512(c, nibble);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
          for (int i = 0; i < MR; ++i) {
            const int32_t* w = xw + i * row_words + b * 8 + v;
            s[i][j] = _mm512_dpbusd_epi32(s[i][j], lo, _mm512_set1_epi32(w[0]));
            s[i][j] = _mm512_dpbusd_epi32(s[i][j], hi, _mm512_set1_epi32(w[1]));
          }
        } else {
          const __m512i cu = _mm512_xor_si512(c, top);  // q + 128
          for (int i = 0; i < MR; ++i)
            s[i][j] = _mm512_dpbusd_epi32(s[i][j], cu,
                                          _mm512_set1_epi32(xw[i * row_words + b * 8 + v]));
        }
      }
    }
    if constexpr (!INT4)  // less 128 times x's block sum (in integers)
      for (int i = 0; i < MR; ++i) {
        const __m512i fix = _mm512_set1_epi32(128 * xq_sum[i * blocks + b]);
        for (int j = 0; j < NR; ++j) s[i][j] = _mm512_sub_epi32(s[i][j], fix);
      }
    for (int j = 0; j < NR; ++j) {
      const int64_t c = walk.constant + j * kPanel;
      const __m512 d = q.at(q.scale, c);
      const __m512 m = INT4 ? q.at(q.offset, c) : _mm512_setzero_ps();
      for (int i = 0; i < MR; ++i) {
        const float sx = xs[i * blocks + b];
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(sx));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][j]), ds, acc[i][j]);
        if constexpr (INT4)  // the offsets meet the rounded x's block sum
          acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(sx * float(xq_sum[i * blocks + b])), m,
                                      acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(out[i][j], acc[i][j]);
}

// x's rows for the small-row kernels: fp32 (and per-block sums for int4 offsets); on the
// VNNI path also quantized (words, scales: null otherwise). parts 2 (residual rows): kernel
// rows 2r and 2r + 1 are row r of x rounded to int8 and what that rounding left, each with its
// own scales, and row r of y is the sum of their products.
struct SmallRows {
  const float* x;
  const float* xsum;
  const int32_t* words;
  const float* sx;
  const int32_t* qsum;  // the int8 form's block sums
  int64_t k, blocks;
  int parts = 1;

  SmallRows at(int64_t r) const {
    return {x + r * k, xsum != nullptr ? xsum + r * blocks : nullptr,
            words != nullptr ? words + r * (k / 4) : nullptr,
            sx != nullptr ? sx + r * blocks : nullptr,
            qsum != nullptr ? qsum + r * blocks : nullptr, k, blocks, parts};
  }
};

template <int MR, int NR>
void quant_small(const Quant& q, const SmallRows& x, int64_t p, const float* bias,
                 float (&out)[MR][NR][16]) {
  if (x.words != nullptr) {
    if (q.int4)
      quant_tile_vnni<MR, NR, true>(q, x.words, x.sx, x.qsum, p, bias, out);
    else
      quant_tile_vnni<MR, NR, false>(q, x.words, x.sx, x.qsum, p, bias, out);
  } else if (q.int4) {
    quant_tile_small<MR, NR, true>(q, x.x, x.xsum, p, bias, out);
  } else {
    quant_tile_small<MR, NR, false>(q, x.x, x.xsum, p, bias, out);
  }
}

// Panels [p0, p1) of y for mr <= 4 kernel rows of x (x, xsum and y at the tile's first row).
template <typename T, int MR>
void quant_rows_small(const Quant& q, const SmallRows& x, const float* bias, T* y, int64_t ys,
                      int64_t p, int nr) {
  constexpr int NR = MR <= 2 ? 4 : 2;
  for (int done = 0; done < nr; done += NR) {
    float out[MR][NR][16];
    const int64_t pp = p + done;
    // residual rows: the bias once, at the sum of the two parts
    const float* pair_bias = x.parts == 2 && bias != nullptr ? bias + pp * kPanel : nullptr;
    const float* bp = bias != nullptr && x.parts == 1 ? bias + pp * kPanel : nullptr;
    const int now = std::min(NR, nr - done);
    if (now == NR) {
      quant_small<MR, NR>(q, x, pp, bp, out);
    } else {  // the last panels one at a time
      for (int j = 0; j < now; ++j) {
        float one[MR][1][16];
        quant_small<MR, 1>(q, x, pp + j, bp != nullptr ? bp + j * kPanel : nullptr, one);
        for (int i = 0; i < MR; ++i) std::memcpy(out[i][j], one[i][0], sizeof one[i][0]);
      }
    }
    for (int i = 0; i < MR; i += x.parts)
      for (int j = 0; j < now; ++j)
        for (int l = 0; l < kPanel; ++l) {
          float v = out[i][j][l];
          if (x.parts == 2 && i + 1 < MR) v += out[i + 1][j][l];
          if (pair_bias != nullptr) v += pair_bias[j * kPanel + l];
          y[i / x.parts * ys + (pp + j) * kPanel + l] = T(v);
        }
  }
}

// Panels [p0, p1) of y for m <= kSmallRows kernel rows: per stored group of 4 panels, tiles of
// up to 4 rows (the group's codes stay in cache for the next tile), or 2 for int8 codes
// unpacked to fp32: at 3-4 rows that kernel runs short of vector registers and keeps its sums
// on the stack (SmolLM2's 120 int8 products at 3 / 4 / 6 rows of fp32 x: 9.4 / 11.8 / 14.6 ->
// 7.3 / 7.5 / 10.3 ms; int4's measured alike either way, 6.4-10.1 ms).
template <typename T>
void quant_panels_small(const Quant& q, int64_t m, const SmallRows& x, const float* bias, T* y,
                        int64_t p0, int64_t p1) {
  const int64_t n = q.n, tile_rows = x.words == nullptr && !q.int4 ? 2 : 4;
  stored_groups(p0, p1, [&](int64_t p, int nr) {
    for (int64_t r = 0; r < m; r += tile_rows) {
      const SmallRows xr = x.at(r);
      T* yr = y + r / x.parts * n;
      switch (std::min<int64_t>(tile_rows, m - r)) {
        case 1: quant_rows_small<T, 1>(q, xr, bias, yr, n, p, nr); break;
        case 2: quant_rows_small<T, 2>(q, xr, bias, yr, n, p, nr); break;
        case 3: quant_rows_small<T, 3>(q, xr, bias, yr, n, p, nr); break;
        default: quant_rows_small<T, 4>(q, xr, bias, yr, n, p, nr); break;
      }
    }
  });
}

// fn(p, nr, k0, k1) for each stored group of panels [p, p + nr) in [p0, p1) and each slice
// [k0, k1) of its input features, after dequantizing that slice into `scratch` (T's panel
// layout: kQuantSliceK features a panel).
template <typename T, typename F>
void dequantized_slices(const Quant& q, int64_t p0, int64_t p1, T* scratch, const F& fn) {
  stored_groups(p0, p1, [&](int64_t p, int nr) {
    for (int64_t k0 = 0; k0 < q.k; k0 += kQuantSliceK) {
      const int64_t k1 = std::min(q.k, k0 + kQuantSliceK);
      if (q.int4)
        dequant_slice<true>(q, p, nr, k0, k1, scratch);
      else
        dequant_slice<false>(q, p, nr, k0, k1, scratch);
      fn(p, nr, k0, k1);
    }
  });
}

template <typename T>
void quant_panels(const at::Tensor& x, const Quant& q, const float* bias, at::Tensor& y,
                  float* acc, bool dp, int64_t p0, int64_t p1) {
  const int64_t m = x.size(0);
  const int64_t per_step = std::is_same_v<T, float> ? 1 : 2;  // input features per step
  thread_local std::vector<T> scratch;
  scratch.resize(kMaxNR * kQuantSliceK * kPanel);
  Tile<T> t{};
  t.dp = dp;
  t.xs = x.stride(0);
  t.panel = kQuantSliceK * kPanel;  // elements per panel of the scratch, either layout
  t.ys = y.stride(0);
  t.w = scratch.data();
  int64_t requested = 0;  // lines of codes requested a slice ahead (counted once a call)
  dequantized_slices(q, p0, p1, scratch.data(), [&](int64_t p, int nr, int64_t k0, int64_t k1) {
    t.bias = bias != nullptr ? bias + p * kPanel : nullptr;
    t.k0 = 0;
    t.k1 = (k1 - k0) / per_step;
    t.first = k0 == 0;
    t.last = k1 == q.k;
    // The codes of the next slice (this group's, else the next group's first), requested a
    // share per row tile as the float products request their next panel group: its
    // dequantization otherwise waited on them from memory. The 125M model's down_proj and
    // LM head shapes in int8 codes, 12 of each in turn, bf16 x, one process taking turns: 9
    // rows 50.0 -> 37.6 ms, 16 rows 58.2 -> 46.4, 48 rows 105.8 -> 92.7 (int4: 104.4 -> 90.6),
    // 256 rows 422.8 -> 407.4; int4 at 1,024 rows 1,921 -> 1,909.
    const int64_t pn = k1 < q.k ? p : p + nr, kn = k1 < q.k ? k1 : 0;
    const int64_t tiles = (m + kMaxMR - 1) / kMaxMR;
    int64_t lines = 0;
    t.ahead = nullptr;
    if (pn < q.panels()) {
      const int64_t first = pn / kMaxNR * kMaxNR;
      const int64_t blocks = (std::min(q.k, kn + kQuantSliceK) - kn) / 32;
      t.ahead = reinterpret_cast<const T*>(q.block(first, kn / 32));
      t.ahead_nr = 1;
      lines = blocks * q.in_group(first) * (q.int4 ? 16 : 32) * kPanel / 64;
      requested += lines;
    }
    for (int64_t r = 0; r < m; r += kMaxMR) {
      const int mr = int(std::min<int64_t>(kMaxMR, m - r));
      ahead_share(t, r / kMaxMR, tiles, lines);
      t.x = x.data_ptr<T>() + r * t.xs + k0;
      point_output(t, y, r, p);
      t.acc = acc != nullptr ? acc + r * t.ys + p * kPanel : nullptr;
      tile_any<T>(mr, nr, t);
    }
  });
  if (requested > 0) ahead_line_count.fetch_add(requested, std::memory_order_relaxed);
}

// quant_panels for a bfloat16 x on AMX: each dequantized slice (bf16 pairs, the float panel
// layout) is the tiles' weight; xp has its rows padded to a multiple of 16 (amx_rows).
void quant_panels_amx(const at::Tensor& xp, int64_t m, const Quant& q, const float* bias,
                      at::Tensor& y, float* acc, int64_t p0, int64_t p1) {
  thread_local std::vector<at::BFloat16> scratch;
  scratch.resize(kMaxNR * kQuantSliceK * kPanel);
  amx_begin();
  dequantized_slices(q, p0, p1, scratch.data(), [&](int64_t p, int nr, int64_t k0, int64_t k1) {
    AmxSlice a{xp.data_ptr<at::BFloat16>() + k0, xp.stride(0), m, scratch.data(),
               kQuantSliceK * kPanel, (k1 - k0) / 2,
               bias != nullptr ? bias + p * kPanel : nullptr,
               y.data_ptr<at::BFloat16>() + p * kPanel,
               acc != nullptr ? acc + p * kPanel : nullptr, y.stride(0), k0 == 0, k1 == q.k};
    amx_slice(a, nr);
  });
  amx_end();
}

#endif  // PAGEDLLM_X86 && __GNUC__

// y [M, N] in x's dtype, and the bias [N] in fp32 for the kernels (undefined when absent).
std::pair<at::Tensor, at::Tensor> output_and_bias(const at::Tensor& x, int64_t n,
                                                  const c10::optional<at::Tensor>& bias,
                                                  const char* op) {
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == n), op, ": bias [",
              n, "]");
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  return {at::empty({x.size(0), n}, x.options()), b};
}

Isa isa_from_name(const std::string& name) {
  if (name == "amx_bf16") return Isa::kAmxBf16;
  if (name == "avx512_bf16") return Isa::kAvx512Bf16;
  if (name == "avx512") return Isa::kAvx512;
  if (name == "avx2") return Isa::kAvx2;
  TORCH_CHECK(false, "panel_linear: isa is amx_bf16, avx512_bf16, avx512 or avx2, not ", name);
}

const char* isa_needs(Isa isa) {
  switch (isa) {
    case Isa::kAmxBf16: return "AMX-BF16 (or the tile state from the kernel)";
    case Isa::kAvx512Bf16: return "AVX512-BF16";
    case Isa::kAvx512: return "AVX-512F";
    default: return "AVX2 and FMA";
  }
}

// isa: the instruction set to run (tests of the path a CPU without AVX512-BF16 takes);
// default: the best this CPU has.
Isa isa_to_run(const c10::optional<std::string>& isa, const char* op) {
  const Isa use = isa.has_value() ? isa_from_name(*isa) : cpu_isa();
  TORCH_CHECK(cpu_isa() != Isa::kNone && use <= cpu_isa(), op, ": this CPU lacks ",
              isa_needs(use));
  return use;
}

// out_dtype float32 for bfloat16 x: y holds the bf16 results widened to fp32, what
// Tensor.float() of the bfloat16 y would hold, without that second pass over a fresh buffer
// (an LM head's logits for sampling: the 125M model's at 64 rows 8.53 -> 8.37 ms); the AMX
// tiles store bf16, so beyond 6 rows on them y is still widened after.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias,
                        const c10::optional<std::string>& isa,
                        const c10::optional<at::ScalarType>& out_dtype) {
  const Isa use = isa_to_run(isa, "panel_linear");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(2) * w.element_size() == 64,
              "panel_linear: weight panels [N / 16, K (/ 2), 16 (* 2)]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "panel_linear: x and the panels in float32 or bfloat16 alike");
  const int64_t n = w.size(0) * kPanel, k = w.size(1) * w.size(2) / kPanel;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1, "panel_linear: x [M, ", k,
              "] with unit stride");
  TORCH_CHECK(!out_dtype.has_value() || *out_dtype == x.scalar_type() ||
                  *out_dtype == at::kFloat,
              "panel_linear: out_dtype is x's dtype or float32");
  auto [y, b] = output_and_bias(x, n, bias, "panel_linear");
  const int64_t m = x.size(0);
  const bool widen = out_dtype.has_value() && *out_dtype != x.scalar_type();
  // bfloat16 beyond kMaxMR rows on AMX: whole K per panel group, blocks of 16 rows
  const bool amx = use == Isa::kAmxBf16 && x.scalar_type() == at::kBFloat16 && m > kMaxMR &&
                   k % 32 == 0;
  if (widen && !amx) y = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0) return y;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t row_bytes = k * x.element_size();
  const bool sliced =
      !amx && w.size(1) > slice_steps(m, w.size(1), w.size(2), w.element_size());
  // bfloat16 keeps fp32 partial sums between K slices (float32 keeps them in y)
  at::Tensor acc;
  if (sliced && x.scalar_type() == at::kBFloat16)
    acc = at::empty({m, n}, x.options().dtype(at::kFloat));
  float* ap = acc.defined() ? acc.data_ptr<float>() : nullptr;
  // Chunks of whole panel groups streaming at least ~32 KiB of weight, or of work at many rows.
  const int64_t panel_bytes = k * kPanel * x.element_size();
  const int64_t work = panel_bytes * std::max<int64_t>(1, m / kMaxMR) + row_bytes;
  const int64_t chunk = whole_groups((32 << 10) / work);
#if PAGEDLLM_X86 && defined(__GNUC__)
  if (amx) {
    const at::Tensor xp = amx_rows(x);
    balanced_for(w.size(0), chunk, [&](int64_t p0, int64_t p1) {
      amx_panels(xp, m, w, bp, y, p0, p1);
    });
    return widen ? y.to(at::kFloat) : y;
  }
  const bool avx2 = use == Isa::kAvx2;
  // AVX2 reads a bfloat16 x widened to fp32, made once here (every panel group reads it) in a
  // buffer of this thread: a one-user step makes over a hundred of these calls, and a new
  // tensor a call (x.to) cost 2.1-2.6 us of each (BENCHMARKS.md round forty-four)
  const bool widened = avx2 && x.scalar_type() == at::kBFloat16;
  thread_local std::vector<float> xf;
  if (widened) {
    xf.resize(m * k);
    float* const dst = xf.data();
    const at::BFloat16* const src = x.data_ptr<at::BFloat16>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, m, std::max<int64_t>(1, (64 << 10) / k), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < k; ++i) dst[r * k + i] = float(src[r * stride + i]);
    });
  }
  const float* xfp = widened ? xf.data() : nullptr;
  const auto run = [&](int64_t p0, int64_t p1, int64_t r0, int64_t r1, int64_t after) {
    if (x.scalar_type() == at::kFloat)
      panels<float>(x, w, bp, y, nullptr, false, avx2, nullptr, p0, p1, r0, r1, after);
    else
      panels<at::BFloat16>(x, w, bp, y, ap, use >= Isa::kAvx512Bf16, avx2, xfp, p0, p1, r0, r1,
                           after);
  };
  const int64_t rows = block_rows(m, w.size(0), sliced), blocks = (m + rows - 1) / rows;
  if (blocks == 1) {
    balanced_for(w.size(0), chunk, [&](int64_t p0, int64_t p1) { run(p0, p1, 0, m, p1); });
    return y;
  }
  // items (panel group, block of rows), a group's blocks one after another: a thread that
  // takes several keeps the group's weight in L2 while their rows pass
  balanced_for(whole_groups(w.size(0)) / kMaxNR * blocks, 1, [&](int64_t i0, int64_t i1) {
    row_block_count.fetch_add(i1 - i0, std::memory_order_relaxed);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / blocks * kMaxNR, r = i % blocks * rows;
      const int64_t after = (i + 1) / blocks != i / blocks ? (i + 1) / blocks * kMaxNR : -1;
      run(p, std::min(w.size(0), p + kMaxNR), r, std::min(m, r + rows), after);
    }
  });
#endif
  return y;
}

// y = x W^T + bias with W quantized in panels (see "quantized panels" above); x float32 or
// bfloat16 [M, K], y in x's dtype.
at::Tensor quant_panel_linear(const at::Tensor& x, const at::Tensor& codes,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                              int64_t bits, const c10::optional<at::Tensor>& bias,
                              const c10::optional<std::string>& isa) {
  // isa "avx512_vnni": int8 activations up to kVnniRows rows (the float path beyond);
  // "avx512_vnni_all": int8 activations at every row count (a decode step's rows: see
  // kVnniRows); "avx512_vnni_residual": up to kResidualRows rows, each as two int8 rows (x
  // rounded, then what the rounding left), for a product that must keep fp32 x's accuracy
  // (all but GGUF linears, quantization.x_form);
  // "avx512_bf16" / "avx512" / default: x in fp32 throughout.
  const bool residual = isa.has_value() && *isa == "avx512_vnni_residual";
  const bool every_row = isa.has_value() && *isa == "avx512_vnni_all";
  const bool want_vnni = residual || every_row || (isa.has_value() && *isa == "avx512_vnni");
#if PAGEDLLM_X86 && defined(__GNUC__)
  TORCH_CHECK(!want_vnni || cpu_has_vnni(),
              "quant_panel_linear: this CPU lacks AVX512-VNNI / VBMI");
  const Isa use = want_vnni ? cpu_isa() : isa_to_run(isa, "quant_panel_linear");
  TORCH_CHECK(use >= Isa::kAvx512, "quant_panel_linear: quantized panels need AVX-512F");
  const int parts = residual ? 2 : 1;
  const bool vnni =
      every_row || (want_vnni && x.size(0) <= (residual ? kResidualRows : kVnniRows));
  const Quant q = quant_operands(codes, scale, offset, bits, "quant_panel_linear");
  const int64_t n = q.n, k = q.k;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_panel_linear: x float32 / bfloat16 [M, ", k, "] with unit stride");
  auto [y, b] = output_and_bias(x, n, bias, "quant_panel_linear");
  const int64_t m = x.size(0);
  if (m == 0) return y;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor acc;  // bfloat16 keeps fp32 partial sums between K slices
  if (bf16 && k > kQuantSliceK) acc = at::empty({m, n}, x.options().dtype(at::kFloat));
  float* ap = acc.defined() ? acc.data_ptr<float>() : nullptr;
  const int64_t panel_bytes = k * kPanel * bits / 8;
  if (m <= kSmallRows || vnni) {
    // x in fp32, its per-block sums and (VNNI) its int8 form, in buffers of this thread: a
    // decode step makes hundreds of these calls on small layers, where tensor set-up showed.
    thread_local std::vector<float> xf, xsum, sx;
    thread_local std::vector<int32_t> words, qsum;
    // The int4 offsets take per-block sums of x: exact ones on the fp32 path, the rounded
    // x's (quantize_row) on the VNNI path; int8 has no offsets.
    const int64_t blocks = k / 32;
    const bool exact_sums = bits == 4 && !vnni;
    const int64_t kernel_rows = vnni ? m * parts : m;
    xf.resize(m * k), xsum.resize(exact_sums ? m * blocks : 0);
    if (vnni) {
      words.resize(kernel_rows * k / 4), sx.resize(kernel_rows * blocks);
      qsum.resize(kernel_rows * blocks);
    }
    // (pointers, not the thread_local vectors: in a worker thread those names are its own)
    float *const xp = xf.data(), *const sums = xsum.data(), *const scales = sx.data();
    int32_t *const wp = words.data(), *const qs = qsum.data();
    // Rows [r0, r1) of x in fp32 (with their sums, or rounded to int8); residual rows (one
    // at most, kResidualRows) round what their first part left, in `rest`.
    const auto prepare = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* dst = xp + r * k;
        if (bf16) {
          const at::BFloat16* src = x.data_ptr<at::BFloat16>() + r * x.stride(0);
          for (int64_t i = 0; i < k; ++i) dst[i] = float(src[i]);
        } else {
          std::memcpy(dst, x.data_ptr<float>() + r * x.stride(0), k * sizeof(float));
        }
        for (int64_t b = 0; exact_sums && b < blocks; ++b) {
          float sum = 0.0f;
          for (int i = 0; i < 32; ++i) sum += dst[b * 32 + i];
          sums[r * blocks + b] = sum;
        }
        if (!vnni) continue;
        thread_local std::vector<float> rest;
        rest.resize(k);
        for (int64_t kr = r * parts; kr < (r + 1) * parts; ++kr) {
          // residual: the second kernel row rounds what the first left
          const float* src = parts == 2 && kr % 2 == 1 ? rest.data() : dst;
          quantize_row(src, k, bits == 4, wp + kr * k / 4, scales + kr * blocks, qs + kr * blocks,
                       parts == 2 && kr % 2 == 0 ? rest.data() : nullptr);
        }
      }
    };
    // A decode step's many rows (every_row) are prepared on every thread: one thread's pass
    // over 48 rows before each of a step's products left the other waiting.
    if (m > kSmallRows) at::parallel_for(0, m, 16, prepare);
    else prepare(0, m);
    SmallRows rows{xp, exact_sums ? sums : nullptr, nullptr, nullptr, nullptr, k, blocks};
    if (vnni) {
      rows.words = wp, rows.sx = scales, rows.qsum = qs, rows.parts = parts;
      int8_row_count.fetch_add(m, std::memory_order_relaxed);
    }
    const int64_t chunk = whole_groups((16 << 10) / panel_bytes);
    balanced_for(codes.size(0), chunk, [&](int64_t p0, int64_t p1) {
      if (bf16)
        quant_panels_small<at::BFloat16>(q, kernel_rows, rows, bp, y.data_ptr<at::BFloat16>(),
                                         p0, p1);
      else
        quant_panels_small<float>(q, kernel_rows, rows, bp, y.data_ptr<float>(), p0, p1);
    });
    return y;
  }
  const int64_t chunk = whole_groups((16 << 10) / (panel_bytes * (m / kMaxMR)));
  if (bf16 && use == Isa::kAmxBf16) {
    const at::Tensor xp = amx_rows(x);
    balanced_for(codes.size(0), chunk, [&](int64_t p0, int64_t p1) {
      quant_panels_amx(xp, m, q, bp, y, ap, p0, p1);
    });
    return y;
  }
  balanced_for(codes.size(0), chunk, [&](int64_t p0, int64_t p1) {
    if (bf16)
      quant_panels<at::BFloat16>(x, q, bp, y, ap, use >= Isa::kAvx512Bf16, p0, p1);
    else
      quant_panels<float>(x, q, bp, y, nullptr, false, p0, p1);
  });
  return y;
#else
  TORCH_CHECK(false, "quant_panel_linear: panels need an x86-64 build");
#endif
}

// balanced_for's split made visible (tests): `chunks` chunks over two threads, thread 0
// held in its first claim until thread 1 has run every other chunk (each wait gives up after
// 10 s). Returns, per chunk, the thread that ran it and its place in that thread's order.
at::Tensor balanced_split_trace(int64_t chunks) {
  TORCH_CHECK(chunks >= 2, "balanced_split_trace: at least 2 chunks");
  at::Tensor out = at::full({chunks, 2}, -1, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  std::atomic<int64_t> done{0};
  std::atomic<bool> held{false};
  int64_t order[2] = {0, 0};
  const auto wait_for = [](const auto& ready) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!ready() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  };
  const int threads_before = at::get_num_threads();
  at::set_num_threads(2);
  balanced_for(chunks, 1, [&](int64_t c0, int64_t c1) {
    const int t = at::get_thread_num();
    for (int64_t c = c0; c < c1; ++c) o[2 * c] = t, o[2 * c + 1] = order[t]++;
    if (t == 0 && c0 == 0) {
      held.store(true);
      wait_for([&] { return done.load() == chunks - (c1 - c0); });
    } else {
      wait_for([&] { return held.load(); });  // the first claim stays thread 0's
      done.fetch_add(c1 - c0);
    }
  });
  at::set_num_threads(threads_before);
  return out;
}

bool available() { return cpu_isa() != Isa::kNone; }

// (panel group, block of rows) items the products of many rows have run in this process.
int64_t row_blocks() { return row_block_count.load(); }
int64_t ahead_lines() { return ahead_line_count.load(); }
int64_t int8_rows() { return int8_row_count.load(); }

// Bytes ahead a row tile streaming one row against a float weight of `dtype` (default
// float32) requests each panel (0: none; several rows take bfloat16's distance): this CPU's
// choice, or `bytes` (0, 1,024 or 2,048) for every stream from now on where given
// (benchmarks/stream_ahead.py).
int64_t stream_ahead_bytes(c10::optional<int64_t> bytes, c10::optional<at::ScalarType> dtype) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  if (bytes.has_value()) {
    TORCH_CHECK(*bytes == 0 || *bytes == kPanelAheadShort || *bytes == kPanelAheadLong,
                "stream_ahead_bytes: 0, ", kPanelAheadShort, " or ", kPanelAheadLong);
    panel_ahead().store(*bytes, std::memory_order_relaxed);
  }
  return panel_ahead_bytes(!dtype.has_value() || *dtype != at::kBFloat16);
#else
  return 0;
#endif
}

int64_t amx_blocks() {
#if PAGEDLLM_X86 && defined(__GNUC__)
  return amx_block_count.load();
#else
  return 0;
#endif
}

// Whether this CPU runs int8 activations (isa "avx512_vnni"): AVX512-VNNI and VBMI.
bool vnni() {
#if PAGEDLLM_X86 && defined(__GNUC__)
  return cpu_has_vnni();
#else
  return false;
#endif
}

// The process's switch for int8 activations, which callers read before asking for them
// (isa "avx512_vnni"): -1 asks, 0 / 1 set; on only where vnni().
bool int8_activations(int64_t enable) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  if (enable >= 0) vnni_flag() = enable > 0 && cpu_has_vnni();
  return vnni_flag().load();
#else
  return false;
#endif
}

std::string isa() {
  switch (cpu_isa()) {
    case Isa::kAmxBf16: return "amx_bf16";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "none";
  }
}

// ids [T] as a contiguous int64 tensor, each checked to name one of the n output rows.
at::Tensor checked_ids(const at::Tensor& ids, int64_t n, const char* op) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, op, ": int64 ids");
  at::Tensor index = ids.contiguous();
  const int64_t* row = index.data_ptr<int64_t>();
  for (int64_t t = 0; t < index.numel(); ++t)
    TORCH_CHECK(row[t] >= 0 && row[t] < n, op, ": id ", row[t], " outside [0, ", n, ")");
  return index;
}

// Output rows `ids` of a float weight in panels, [T, K] in its dtype: an embedding tied to (or
// kept as) panels looks its tokens up here. Each row is a gather of one lane (bfloat16: one
// pair of features) every 64 bytes; torch's advanced indexing on the panels' view took 6.4 ms
// for a 2,048-token prefill of the 125M model's vocabulary, 0.2 ms for a 64-row decode step.
at::Tensor panel_rows(const at::Tensor& w, const at::Tensor& ids) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(2) * w.element_size() == 64 &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "panel_rows: float32 / bfloat16 panels [N / 16, K (/ 2), 16 (* 2)]");
  const int64_t steps = w.size(1);
  const at::Tensor index = checked_ids(ids, w.size(0) * kPanel, "panel_rows");
  const int64_t* row = index.data_ptr<int64_t>();
  // a lane is 4 bytes either way: one fp32 feature, or a pair of bf16 ones
  at::Tensor out = at::empty({index.numel(), steps * (w.size(2) / kPanel)}, w.options());
  const uint32_t* src = static_cast<const uint32_t*>(w.data_ptr());
  uint32_t* dst = static_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, index.numel(), 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint32_t* lane = src + (row[t] / kPanel) * steps * kPanel + row[t] % kPanel;
      uint32_t* to = dst + t * steps;
      for (int64_t k = 0; k < steps; ++k) to[k] = lane[k * kPanel];
    }
  });
  return out;
}

// Output rows `ids` of a quantized weight in panels, dequantized: fp32 [T, K], w = scale * q
// (+ offset), a product and then a sum as PackedWeight.dequantize rounds them. An embedding tied
// to an LM head in panels looks its tokens up here (a gather in torch would first have to undo
// the group order).
at::Tensor quant_panel_rows(const at::Tensor& codes, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& offset, int64_t bits,
                            const at::Tensor& ids) {
#if PAGEDLLM_X86 && defined(__GNUC__)
  const Quant q = quant_operands(codes, scale, offset, bits, "quant_panel_rows");
  const at::Tensor index = checked_ids(ids, q.n, "quant_panel_rows");
  const int64_t* row = index.data_ptr<int64_t>();
  const int64_t k = q.k;
  at::Tensor out = at::empty({index.numel(), k}, scale.options().dtype(at::kFloat));
  auto constant = [&](const void* base, int64_t i) {
    return q.half ? float(static_cast<const at::Half*>(base)[i])
                  : static_cast<const float*>(base)[i];
  };
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, index.numel(), 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = row[t] / kPanel, lane = row[t] % kPanel;
      float* w = dst + t * k;
      for (int64_t b = 0; b < q.blocks(); ++b) {
        const uint8_t* block = q.block(p, b);
        const int64_t c = q.constant(p, b * 32 / q.group) + lane;
        const float d = constant(q.scale, c), m = q.int4 ? constant(q.offset, c) : 0.0f;
        for (int f = 0; f < 32; ++f) {
          float code;
          if (q.int4) {
            const uint8_t byte = block[(f / 2) * kPanel + lane];
            code = float(f % 2 == 0 ? byte & 15 : byte >> 4);
          } else {
            code = float(reinterpret_cast<const int8_t*>(block)[f * kPanel + lane]);
          }
          const float scaled = code * d;
          w[b * 32 + f] = q.int4 ? scaled + m : scaled;
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "quant_panel_rows: panels need an x86-64 build");
#endif
}

}  // namespace

TORCH_LIBRARY(pagedllm_panel, m) {
  m.def("panel_linear(Tensor x, Tensor w, Tensor? bias, str? isa=None, "
        "ScalarType? out_dtype=None) -> Tensor",
        &panel_linear);
  m.def(
      "quant_panel_linear(Tensor x, Tensor codes, Tensor scale, Tensor? offset, int bits, "
      "Tensor? bias, str? isa=None) -> Tensor",
      &quant_panel_linear);
  m.def("panel_rows(Tensor w, Tensor ids) -> Tensor", &panel_rows);
  m.def("quant_panel_rows(Tensor codes, Tensor scale, Tensor? offset, int bits, Tensor ids) -> "
        "Tensor",
        &quant_panel_rows);
  m.def("available() -> bool", &available);
  m.def("amx_blocks() -> int", &amx_blocks);
  m.def("vnni() -> bool", &vnni);
  m.def("int8_activations(int enable) -> bool", &int8_activations);
  m.def("isa() -> str", &isa);
  m.def("balanced_split_trace(int chunks) -> Tensor", &balanced_split_trace);
  m.def("row_blocks() -> int", &row_blocks);
  m.def("ahead_lines() -> int", &ahead_lines);
  m.def("int8_rows() -> int", &int8_rows);
  m.def("stream_ahead_bytes(int? bytes=None, ScalarType? dtype=None) -> int", &stream_ahead_bytes);
}
