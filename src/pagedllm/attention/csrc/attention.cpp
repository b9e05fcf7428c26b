// Varlen / paged attention for CPU: tiled online softmax (FlashAttention-2 style), fp32
// accumulation, K/V rows read in place (through the block table when paged: no gather copy).
//
// Work item = (sequence, query tile, one or all kv heads). A tile's rows are its query tokens
// times the query heads sharing a kv head (GQA), so every K/V row loaded serves the group.
// Too few items for the threads (decode of a few sequences) and each one's keys are split into
// chunks, merged by the chunk that finishes last (flash-decoding).
// Scores of a few rows (decode: a GQA group): dot products of up to 4 rows x 2-8 keys whose
// 8-12 partial vectors are reduced together (hadd tree), K rows read in place. Many rows
// (prefill): the tile's keys transposed into fp32 once, then a 6-row x 16-key GEMM micro-kernel.
// P @ V: an outer-product micro-kernel of up to 6 rows x 16-64 features. bf16 / fp16 rows are
// widened on the fly. Written with GCC/Clang vector extensions: AVX2 registers here, NEON pairs
// elsewhere, no intrinsics.
//
// bf16 K/V on a CPU with AVX512-BF16 (checked at run time) take a path of their own, with
// both products on vdpbf16ps (two bf16 products summed into an fp32 lane): scores as 16 dot
// products of one query row with 16 keys, reduced together (a transpose-add tree); P @ V with
// the probabilities in two bf16 parts (rounded, then what the rounding left: about 16 bits,
// where flash-attn's bf16 P on GPUs keeps 8), each in pairs of keys, times V rows of two keys
// interleaved.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "bf16_round.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

namespace {

#if HAVE_BF16_DOT
using pagedllm_cpu::bf16_round_words16;
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

// GCC 12+ and Clang: __builtin_shufflevector and _Float16 vectors; older GCC: __builtin_shuffle
// and a scalar fp16 conversion.
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define HAVE_FLOAT16_VECTORS 1
typedef _Float16 v8f16 __attribute__((vector_size(16)));
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#define HAVE_FLOAT16_VECTORS 0
#endif

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define ALWAYS_INLINE inline __attribute__((always_inline))

ALWAYS_INLINE v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

ALWAYS_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 16 elements as two fp32 vectors in the type's lane order. fp32 / fp16: natural order. bf16:
// the even elements, then the odd ones, so that a 32-bit lane holding two bf16 values becomes
// two floats with one shift and one mask. Q, O and fp32 copies of K/V in scratch use the same
// order, so only loading queries and storing outputs see it (lane_pos).
ALWAYS_INLINE void load16(const float* p, v8f& a, v8f& b) {
  std::memcpy(&a, p, sizeof(a));
  std::memcpy(&b, p + 8, sizeof(b));
}

ALWAYS_INLINE void load16(const c10::BFloat16* p, v8f& a, v8f& b) {
  v8u w;
  std::memcpy(&w, p, sizeof(w));
  a = (v8f)(w << 16);
  b = (v8f)(w & 0xFFFF0000u);
}

ALWAYS_INLINE void load16(const c10::Half* p, v8f& a, v8f& b) {
#if defined(__F16C__)  // GCC 12 converts a _Float16 vector one element at a time (8 vcvtph2ps)
  a = (v8f)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  b = (v8f)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
#elif HAVE_FLOAT16_VECTORS
  v8f16 h0, h1;
  std::memcpy(&h0, p, sizeof(h0));
  std::memcpy(&h1, p + 8, sizeof(h1));
  a = __builtin_convertvector(h0, v8f);
  b = __builtin_convertvector(h1, v8f);
#else
  for (int i = 0; i < 8; ++i) a[i] = static_cast<float>(p[i]), b[i] = static_cast<float>(p[i + 8]);
#endif
}

template <typename T>
inline int lane_pos(int d) {  // where element d of a row sits in scratch
  if (!std::is_same<T, c10::BFloat16>::value) return d;
  return (d & ~15) + (d & 1) * 8 + ((d & 15) >> 1);
}

ALWAYS_INLINE void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

ALWAYS_INLINE v8f vmax(v8f a, v8f b) { return a > b ? a : b; }

ALWAYS_INLINE float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

ALWAYS_INLINE float hsum(v8f v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

ALWAYS_INLINE v8f hadd(v8f a, v8f b) {  // lanes: a01 a23 b01 b23 | a45 a67 b45 b67
  return SHUFFLE(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         SHUFFLE(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// Lane i of the result is the horizontal sum of a[i]: 8 dot products finished at once.
ALWAYS_INLINE v8f reduce8(const v8f* a) {
  v8f u0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));
  v8f u1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return SHUFFLE(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
         SHUFFLE(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp(x) = 2^n * p(r), n = round(x log2 e), |r| <= ln2 / 2; degree-6 Taylor (rel. err ~2e-7).
// x <= -88 (masked scores are -inf) gives exactly 0.
ALWAYS_INLINE v8f exp8(v8f x) {
  x = vmax(x, splat(-88.0f));
  x = x < splat(88.0f) ? x : splat(88.0f);
  v8f n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  v8f r = x - n * 0.693145752f - n * 1.42860677e-6f;
  v8f p = splat(1.0f / 720);
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  e = e > 0 ? e : v8i{};
  return p * (v8f)e;
}

// A row in scratch (lane order), times scale.
template <typename T>
inline void to_scratch(const T* src, float* dst, int n, float scale) {
  for (int i = 0; i < n; i += 16) {
    v8f a, b;
    load16(src + i, a, b);
    store8(dst + i, a * scale);
    store8(dst + i + 8, b * scale);
  }
}

struct SplitGroup;
struct SharedSet;

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;                      // [heads, total_q] or null
  int64_t q_tok, q_head;           // strides in elements
  int64_t o_tok, o_head;
  int64_t k_blk, k_slot, k_head;   // paged: block / slot / head strides; varlen: slot = token
  int64_t v_blk, v_slot, v_head;
  int64_t lse_head;
  const int32_t* cu_q;             // [B + 1]
  const int32_t* seq_lens_k;       // [B]
  const int32_t* cu_k;             // [B + 1] when K/V are varlen-contiguous, else null
  const int32_t* table;            // [B, table_stride] when paged, else null
  int64_t table_stride;
  int block_size;
  int heads, kv_heads, dim;
  float scale;
  int window_left, window_right;   // -1: unbounded (causal is window_right == 0)
  int block_m, block_n;
  int tail_keys;                   // the last tile takes up to this many keys past block_n
  int kv_per_item;                 // kv heads handled by one work item (divides kv_heads)
  bool bf16_dot;                   // bf16 with AVX512-BF16 and dim % 32 == 0: the dot path
  const SplitGroup* groups;        // split keys (make_items): each group's chunks
  float* partials;                 // per chunk: o [H][rows][D], m [H][rows], l [H][rows]
  int64_t part_floats;             // floats per chunk's record
  const SharedSet* shared;         // shared prefixes (make_items): each set's members
  const int* member_seq;           // members' sequences
  const int* member_group;         // [member][kv group]: the member's split group

  // Keys of the tile that starts `left` keys before its item's end: block_n, or all of them
  // where no more than tail_keys would be left for a tile of their own. A short tile costs
  // about what a whole one does (its scratch, its rescale of the sums, its slots' offsets): a
  // decoding sequence of 70 keys is one tile, not 64 + 6. One process taking turns, two
  // threads, 12 layers of the 125M model's heads, bf16: a 64-sequence decode behind a shared
  // 256-key prefix (56-81 keys of its own) 7.55 -> 6.99 ms, 48 sequences of 96-480 keys 8.73
  // -> 8.55 ms; one sequence, eight of 400-600 keys and a 2,048-token prefill unchanged.
  int tile_length(int64_t left) const {
    return (int)(left <= block_n + tail_keys ? left : block_n);
  }
  int max_tile() const { return block_n + tail_keys; }
};

struct Item {
  int seq, tile, kv0;
  int64_t cost;
  int64_t key_lo = 0, key_hi = INT64_MAX;  // the chunk of keys this item sees
  int group = -1, chunk = 0;       // group >= 0: chunk `chunk` of that split group
  int shared = -1;                 // >= 0: the prefix of that shared set, for all its members
};

// Sequences of one query tile whose block tables begin with the same blocks (a prompt prefix
// that prefix caching shares): one item attends over those `keys` for every member's rows at
// once (many rows: the GEMM-style tile path, each key read once for all of them) and leaves
// each member's chunk 0 of its split group; the member's own item does the rest of its keys
// (chunk 1), and the later of the two merges them. Cascade attention, as FlashInfer calls it.
struct SharedSet {
  int first, count;                // members [first, first + count)
  int64_t keys;
  int rows;                        // the members' query rows a kv head
};

// The chunks of one (sequence, query tile, kv heads) whose keys were split between items: each
// leaves its unnormalized output, running maximum and sum in `partials` [first, first +
// chunks), and the item that finishes last merges them.
struct SplitGroup {
  int seq, tile, kv0, chunks;
  int64_t first;
  std::atomic<int>* pending;
};

struct Scratch {
  std::vector<float> q, o, m, l;       // per kv head of the item: [rows][dim], [rows]
  std::vector<float> mo, mm, ml;       // a split group's merge: its o, m and l, the same way
  std::vector<float> s, alpha;         // one head's scores / probabilities [rows][n_pad]
  std::vector<float> kf;               // many rows: one head's key tile transposed [dim][n_pad]
  std::vector<float> vf;               // many rows: one head's value tile in fp32 [n_pad][dim]
  std::vector<int64_t> koff, voff;     // element offsets of the tile's keys (kv head 0)
  std::vector<int64_t> dense;          // offsets of the rows of vf
  std::vector<const void*> krow, vrow;  // bf16-dot path: the tile's rows of each head
  std::vector<int64_t> pos;            // query position of each row
  std::vector<uint16_t> qb;            // bf16-dot path: the rows' queries as stored (bf16)
  std::vector<uint32_t> pb;            // bf16-dot path: probabilities, bf16 pairs of keys
  std::vector<uint32_t> pr;            // and what their rounding to bf16 left, the same way
  std::vector<uint32_t> kt, vt;        // bf16-dot path, many rows: one head's K, V rearranged
  bool first = true;                   // no item done yet (none prefetched the next one)
};

// The last block of row_blocks: n (< RMax) rows from r as one block of n.
template <int R, typename F>
inline void rest_block(int r, int n, F& f) {
  if constexpr (R >= 1) {
    if (n == R) return f(r, std::integral_constant<int, R>{});
    rest_block<R - 1>(r, n, f);
  }
}

// f(first_row, integral_constant<int, R>) over rows in blocks of RMax, then one of the rest.
template <int RMax = 4, typename F>
inline void row_blocks(int rows, F&& f) {
  int r = 0;
  for (; r + RMax <= rows; r += RMax) f(r, std::integral_constant<int, RMax>{});
  rest_block<RMax - 1>(r, rows - r, f);
}

// The rows of one kv head in a key tile: row c at base + off[c] (the cache's slots in place, or
// the tile's fp32 copy in scratch).
template <typename T>
struct TileRows {
  const T* base;
  const int64_t* off;
  ALWAYS_INLINE const T* operator[](int c) const { return base + off[c]; }
};

// Keys a score block takes for R rows: at least 8 partial vectors, so that 8 FMA chains hide
// the FMA's latency (4 cycles, 2 a cycle), and at most 12, so that they stay in registers
// beside a key's two vectors (the queries are memory operands).
template <int R>
constexpr int score_keys() {
  return R == 1 ? 8 : R == 4 ? 2 : 4;
}

// s[r][c] = <q[r], k[c0 + c]> for R rows and NK keys: R x NK partial vectors, reduced 8 at a
// time (hadd tree).
template <int R, int NK, typename T>
ALWAYS_INLINE void qk_block(const float* q, int dim, const TileRows<T>& k, int c0, float* s,
                            int s_stride) {
  constexpr int A = R * NK, A8 = (A + 7) / 8 * 8;
  v8f acc[A8] = {};
  const T* key[NK];
  for (int c = 0; c < NK; ++c) key[c] = k[c0 + c];
  for (int d = 0; d < dim; d += 16) {
    for (int c = 0; c < NK; ++c) {
      v8f a, b;
      load16(key[c] + d, a, b);
      for (int r = 0; r < R; ++r) {
        acc[r * NK + c] += load8(q + r * dim + d) * a;  // two separate fused multiply-adds
        acc[r * NK + c] += load8(q + r * dim + d + 8) * b;
      }
    }
  }
  for (int g = 0; g < A8; g += 8) {
    const v8f sums = reduce8(acc + g);
    for (int i = 0; i < 8 && g + i < A; ++i) s[(g + i) / NK * s_stride + (g + i) % NK] = sums[i];
  }
}

// o[r][d, d + 16 NC) = o[r][...] * alpha[r] + sum_j p[r][j] v[j][...] for R rows. Fewer
// than 8 accumulators (3 rows of 16 features: a GQA group of 3 decoding) take alternate keys in
// two sets, summed at the end: 6 FMA chains of 4 cycles left half the FMA units idle.
template <int R, int NC, typename T>
ALWAYS_INLINE void pv_chunk(const float* p, int p_stride, const TileRows<T>& v, int n,
                            const float* alpha, float* o, int dim, int d) {
  constexpr int S = 2 * R * NC < 8 ? 2 : 1;
  v8f acc[S][R][2 * NC];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * NC; ++i) {
      acc[0][r][i] = load8(o + r * dim + d + 8 * i) * alpha[r];
      if constexpr (S == 2) acc[1][r][i] = splat(0.0f);
    }
  auto key = [&](int j, v8f(&a)[R][2 * NC]) __attribute__((always_inline)) {
    const T* row = v[j] + d;
    for (int c = 0; c < NC; ++c) {
      v8f x, y;
      load16(row + 16 * c, x, y);
      for (int r = 0; r < R; ++r) {
        const v8f w = splat(p[r * p_stride + j]);
        a[r][2 * c] += w * x;
        a[r][2 * c + 1] += w * y;
      }
    }
  };
  int j = 0;
  for (; j + S <= n; j += S)
    for (int s = 0; s < S; ++s) key(j + s, acc[s]);
  for (; j < n; ++j) key(j, acc[0]);
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * NC; ++i) {
      v8f sum = acc[0][r][i];
      if constexpr (S == 2) sum += acc[1][r][i];
      store8(o + r * dim + d + 8 * i, sum);
    }
}

// o[r][:] = o[r][:] * alpha[r] + sum_j p[r][j] v[j][:] for R rows (up to 6), in chunks of
// features that give 6-12 accumulators: a key's R broadcast probabilities, its two vectors and
// the mask that widens bf16 must fit beside them (3 rows of 32 features spill an accumulator
// and take 1.65x as long as 3 rows of 16). before_chunk(d) runs before the chunk from feature d.
template <int R, typename T, typename F>
inline void pv_block(const float* p, int p_stride, const TileRows<T>& v, int n, const float* alpha,
                     float* o, int dim, F&& before_chunk) {
  constexpr int NC = R == 1 ? 4 : R == 2 ? 2 : 1;  // 16-feature pieces a chunk
  int d = 0;
  for (; d + 16 * NC <= dim; d += 16 * NC) {
    before_chunk(d);
    pv_chunk<R, NC>(p, p_stride, v, n, alpha, o, dim, d);
  }
  for (; d < dim; d += 16) {
    before_chunk(d);
    pv_chunk<R, 1>(p, p_stride, v, n, alpha, o, dim, d);
  }
}

// ---- many rows (prefill): the scores as a small GEMM ----------------------------------------
// A tile's keys are transposed into fp32 once, kt[d][c] (d in the rows' lane order), so that one
// query feature broadcast meets 16 keys in two vectors and no reduction follows: 6 rows x 16
// keys accumulate in 12 registers, a GEMM's micro-kernel. The values go to fp32 rows (bf16 /
// fp16 widened, fp32 read in place) for pv_block's 6 rows x 16 features.

// out[j][i] = in[i][j] for 8 x 8 floats (rows `ld` apart in out).
ALWAYS_INLINE void transpose8(const v8f* in, float* out, int64_t ld) {
  v8f t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = SHUFFLE(in[i], in[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = SHUFFLE(in[i], in[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = SHUFFLE(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 1] = SHUFFLE(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[i + 2] = SHUFFLE(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 3] = SHUFFLE(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {
    store8(out + i * ld, SHUFFLE(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11));
    store8(out + (i + 4) * ld, SHUFFLE(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15));
  }
}

// kt[d][c] = key c's feature at lane position d, keys [0, n_pad) (a multiple of 8).
template <typename T>
void keys_by_feature(const TileRows<T>& k, int n_pad, int dim, float* kt) {
  for (int c = 0; c < n_pad; c += 8)
    for (int d = 0; d < dim; d += 16) {
      v8f a[8], b[8];
      for (int i = 0; i < 8; ++i) load16(k[c + i] + d, a[i], b[i]);
      transpose8(a, kt + (int64_t)d * n_pad + c, n_pad);
      transpose8(b, kt + (int64_t)(d + 8) * n_pad + c, n_pad);
    }
}

// s[r][c0, c0 + 8 NV) = <q[r], k[c]> for R rows: each row's broadcast feature times NV vectors
// of keys.
template <int R, int NV>
ALWAYS_INLINE void gemm_scores(const float* q, int dim, const float* kt, int n_pad, int c0,
                               float* s) {
  v8f acc[R][NV] = {};
  for (int d = 0; d < dim; ++d) {
    v8f key[NV];
    for (int i = 0; i < NV; ++i) key[i] = load8(kt + (int64_t)d * n_pad + c0 + 8 * i);
    for (int r = 0; r < R; ++r) {
      const v8f x = splat(q[r * dim + d]);
      for (int i = 0; i < NV; ++i) acc[r][i] += x * key[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) store8(s + r * n_pad + c0 + 8 * i, acc[r][i]);
}

// The scores of R rows against all n_pad keys of kt.
template <int R>
inline void gemm_score_rows(const float* q, int dim, const float* kt, int n_pad, float* s) {
  int c = 0;
  for (; c + 16 <= n_pad; c += 16) gemm_scores<R, 2>(q, dim, kt, n_pad, c, s);
  if (c < n_pad) gemm_scores<R, 1>(q, dim, kt, n_pad, c, s);
}

// Element offsets of keys [j0, j0 + n) of sequence b (kv head 0); up to n_pad the last repeats.
void key_offsets(const Problem& p, int b, int64_t j0, int n, int n_pad, int64_t* koff,
                 int64_t* voff) {
  if (p.table == nullptr) {
    for (int c = 0; c < n_pad; ++c) {
      const int64_t tok = p.cu_k[b] + j0 + std::min(c, n - 1);
      koff[c] = tok * p.k_slot;
      voff[c] = tok * p.v_slot;
    }
    return;
  }
  // A block's slots at a time, the strides in locals: stores through koff could otherwise
  // change p's strides as far as the compiler knows, which kept this loop scalar.
  const int32_t* table = p.table + b * p.table_stride;
  const int64_t k_blk = p.k_blk, k_slot = p.k_slot, v_blk = p.v_blk, v_slot = p.v_slot;
  const int64_t block_size = p.block_size;
  for (int64_t c = 0, block = j0 / block_size, slot = j0 % block_size; c < n; ++block, slot = 0) {
    const int64_t count = std::min<int64_t>(block_size - slot, n - c);
    const int64_t k0 = table[block] * k_blk, v0 = table[block] * v_blk;
    for (int64_t i = 0; i < count; ++i) {
      koff[c + i] = k0 + (slot + i) * k_slot;
      voff[c + i] = v0 + (slot + i) * v_slot;
    }
    c += count;
  }
  for (int c = n; c < n_pad; ++c) koff[c] = koff[n - 1], voff[c] = voff[n - 1];
}

// Software pipelining: the next tile's rows are requested while this one computes (paged
// blocks sit at random addresses, which the hardware prefetcher cannot guess).
template <typename T>
void prefetch_rows(const T* base, const int64_t* off, int n, int64_t bytes) {
  for (int c = 0; c < n; ++c) {
    const char* row = reinterpret_cast<const char*>(base + off[c]);
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(row + i);
  }
}

// The next tile's slots (the item's heads of each: `bytes` from `k` / `v` plus the offsets;
// on the last tile, the first tile of the item this thread takes next), requested a few slots
// per score call while this tile computes, into L2 (prefetcht1). A whole tile at once (tens of
// KB) is more than the core keeps in flight, and into L1 it evicts what is being read: both
// measured no faster than no prefetch, this a third faster (30 layers of a 48-sequence decode,
// docs/architecture/attention.md).
template <typename T>
struct NextSlots {
  const T* k = nullptr;
  const T* v = nullptr;
  const int64_t* koff = nullptr;
  const int64_t* voff = nullptr;
  int n = 0;  // slots of the next tile (0: none)
  int64_t bytes = 0;

  void prefetch(int c0, int c1) const {
    for (int c = c0; c < std::min(n, c1); ++c) {
      const char* kr = reinterpret_cast<const char*>(k + koff[c]);
      const char* vr = reinterpret_cast<const char*>(v + voff[c]);
      for (int64_t i = 0; i < bytes; i += 64) to_l2(kr + i), to_l2(vr + i);
    }
  }

  // The share of the slots that work step [at, at + step) of `of` steps requests.
  void prefetch_share(int64_t at, int64_t step, int64_t of) const {
    prefetch((int)(at * n / of), (int)((at + step) * n / of));
  }

  // The slots from c on (none where there are no more than c).
  NextSlots past(int c) const {
    NextSlots rest = *this;
    rest.n = std::max(0, n - c);
    rest.koff += std::min(n, c);
    rest.voff += std::min(n, c);
    return rest;
  }

  // prefetcht1 as an asm statement: GCC 12's dead-code elimination drops __builtin_prefetch
  // in this loop (it has no result), and the tile then waits on memory (measured 1.5x slower).
  // The address in a register, not a memory operand the compiler must keep stores ahead of.
  static void to_l2(const char* line) {
#if HAVE_BF16_DOT
    asm volatile("prefetcht1 (%0)" : : "r"(line));
#else
    __builtin_prefetch(line, 0, 2);
#endif
  }
};

// Online-softmax update of rows [0, rows) with the scores of one key tile (n valid keys).
// Turns the scores into probabilities and writes each row's rescale factor into alpha.
// Lanes: the two vector steps of a row of n_pad scores, max(s) and, in place, s = exp(s - m)
// with the sum of the results (Lanes8 here; the bf16-dot path's 16-lane Lanes16).
template <typename Lanes>
void softmax_rows(float* scores, int rows, int n, int n_pad, float* m, float* l, float* alpha) {
  for (int r = 0; r < rows; ++r) {
    float* s = scores + (int64_t)r * n_pad;
    for (int c = n; c < n_pad; ++c) s[c] = kNegInf;
    const float m_new = std::max(m[r], Lanes::row_max(s, n_pad));
    if (m_new == kNegInf) {  // nothing visible yet in this row
      std::fill(s, s + n_pad, 0.0f);
      alpha[r] = 1.0f;
      continue;
    }
    const float sum = Lanes::exp_sum(s, n_pad, m_new);
    alpha[r] = m[r] == kNegInf ? 0.0f : std::exp(m[r] - m_new);
    l[r] = l[r] * alpha[r] + sum;
    m[r] = m_new;
  }
}

struct Lanes8 {
  static float row_max(const float* s, int n_pad) {
    v8f mx = splat(kNegInf);
    for (int c = 0; c < n_pad; c += 8) mx = vmax(mx, load8(s + c));
    return hmax(mx);
  }
  static float exp_sum(float* s, int n_pad, float m) {
    v8f sum = {};
    for (int c = 0; c < n_pad; c += 8) {
      v8f e = exp8(load8(s + c) - m);
      store8(s + c, e);
      sum += e;
    }
    return hsum(sum);
  }
};

void softmax_update(float* scores, int rows, int n, int n_pad, float* m, float* l, float* alpha) {
  softmax_rows<Lanes8>(scores, rows, n, n_pad, m, l, alpha);
}

// Causal / window edges: -inf for the keys of tile [j0, j0 + n) that a row may not see.
void mask_tile(const Problem& p, const int64_t* pos, int rows, int64_t j0, int n, int n_pad,
               float* scores) {
  for (int r = 0; r < rows; ++r) {
    // the tile's keys [lo, hi) are in the row's window, the rest two runs to fill (a test of
    // each key's position was 13% of a bf16 prefill tile's work outside its products)
    const int64_t lo =
        p.window_left >= 0 ? std::clamp<int64_t>(pos[r] - p.window_left - j0, 0, n) : 0;
    const int64_t hi =
        p.window_right >= 0 ? std::clamp<int64_t>(pos[r] + p.window_right + 1 - j0, lo, n) : n;
    if (lo == 0 && hi == n) continue;
    float* s = scores + (int64_t)r * n_pad;
    std::fill(s, s + lo, kNegInf);
    std::fill(s + hi, s + n, kNegInf);
  }
}

// Rows from which a tile's scores take the GEMM form (its keys transposed once serve them all).
constexpr int kGemmRows = 8;
inline bool many_rows(int rows) { return rows > kGemmRows; }

// One kv head's update with one key tile: scores, mask, online softmax, P @ V. Head `part` of
// the item's `parts` requests its share of the next tile's slots: with a few rows half of it a
// few slots per score block, half a few per chunk of P @ V (all of it while scoring asked for
// more lines than the core keeps in flight: 48 decoding sequences of 100-600 keys over 30
// layers' caches, 1.1-1.3x slower); with many rows a few per block of rows scored.
template <typename T, typename KV>
void tile_step(const Problem& p, Scratch& w, int rows, int64_t j0, int n, int n_pad, float* q,
               float* o, float* m, float* l, const TileRows<T>& k, const TileRows<KV>& v,
               const NextSlots<T>& next, int part, int parts) {
  const int D = p.dim;
  float* s = w.s.data();
  const bool many = many_rows(rows);
  if (many) {  // the GEMM form: the keys transposed once for all rows
    keys_by_feature(k, n_pad, D, w.kf.data());
    row_blocks<6>(rows, [&](int r, auto R) {
      next.prefetch_share((int64_t)part * rows + r, R, (int64_t)parts * rows);
      gemm_score_rows<decltype(R)::value>(q + (int64_t)r * D, D, w.kf.data(), n_pad,
                                          s + r * n_pad);
    });
  } else {
    row_blocks(rows, [&](int r, auto R) {
      constexpr int NK = score_keys<decltype(R)::value>();
      for (int c = 0; c < n_pad; c += NK) {
        if (r == 0) next.prefetch_share((int64_t)2 * part * n_pad + c, NK, 2 * parts * n_pad);
        qk_block<decltype(R)::value, NK>(q + (int64_t)r * D, D, k, c, s + r * n_pad + c, n_pad);
      }
    });
  }
  mask_tile(p, w.pos.data(), rows, j0, n, n_pad, s);
  softmax_update(s, rows, n, n_pad, m, l, w.alpha.data());
  const int64_t pv_share = (2 * part + 1) * (int64_t)D, pv_shares = 2 * parts * D;
  row_blocks<6>(rows, [&](int r, auto R) {
    pv_block<decltype(R)::value>(
        s + r * n_pad, n_pad, v, n, w.alpha.data() + r, o + (int64_t)r * D, D, [&](int d) {
          if (!many && r == 0) next.prefetch_share(pv_share + d, 16, pv_shares);
        });
  });
}

// Rows of the tile in fp32, pre-scaled: row r is token t0 + r / G, query head kv * G + r % G.
template <typename T>
void load_queries(const Problem& p, int q_start, int t0, int rows, int kv, float* dst) {
  const int G = p.heads / p.kv_heads;
  const T* q = static_cast<const T*>(p.q);
  for (int r = 0; r < rows; ++r) {
    const int t = t0 + r / G, h = kv * G + r % G;
    to_scratch(q + (q_start + t) * p.q_tok + h * p.q_head, dst + (int64_t)r * p.dim, p.dim,
               p.scale);
  }
}

// Where element d of an output row sits in the bf16-dot path's accumulators: per 32 features,
// the unpacklo lanes (features 0-3 of each group of 8), then the unpackhi lanes (4-7).
constexpr int dot_pos(int d) {
  const int e = d & 31, group = e >> 3, i = e & 7;
  return (d & ~31) + (i < 4 ? group * 4 + i : 16 + group * 4 + i - 4);
}

#if HAVE_BF16_DOT
// Word d of a row's 32 bf16 outputs in a two-source word permute of the rounded accumulators
// (each in the low half of its lane): lane dot_pos(d) of the first source, or of the second.
struct DotOrder {
  alignas(64) uint16_t words[32];
  constexpr DotOrder() : words() {
    for (int d = 0; d < 32; ++d) {
      const int at = dot_pos(d);
      words[d] = (uint16_t)(at < 16 ? 2 * at : 32 + 2 * (at - 16));
    }
  }
};
constexpr DotOrder kDotOrder;

// One output row of the bf16-dot path (dot_pos order, dim a multiple of 32), 32 features a
// pass: scaled, rounded as c10::BFloat16 rounds one value (bf16_round.h, as the products
// round theirs) and put in feature order by one word permute; the same bits as the scalar
// loop of store_features, which converts and places one element at a time.
__attribute__((target("avx512f,avx512bw"))) void store_features_dot(const float* src, float inv,
                                                                    int dim,
                                                                    c10::BFloat16* dst) {
  const __m512i idx = _mm512_load_si512(kDotOrder.words);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int d = 0; d < dim; d += 32) {
    const __m512i lo = bf16_round_words16(_mm512_mul_ps(_mm512_loadu_ps(src + d), scale));
    const __m512i hi = bf16_round_words16(_mm512_mul_ps(_mm512_loadu_ps(src + d + 16), scale));
    _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(lo, idx, hi));
  }
}
#endif

// One output row: src (in Pos order) times inv, in feature order, converted to T.
template <typename T, int (*Pos)(int)>
inline void store_features(const float* src, float inv, int dim, T* dst) {
#if HAVE_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16> && Pos == &dot_pos)
    return store_features_dot(src, inv, dim, dst);
#endif
  for (int d = 0; d < dim; ++d) dst[d] = static_cast<T>(src[Pos(d)] * inv);
}

template <typename T, int (*Pos)(int) = lane_pos<T>>
void store_rows(const Problem& p, int q_start, int t0, int rows, int kv, const float* o,
                const float* m, const float* l) {
  const int G = p.heads / p.kv_heads;
  T* out = static_cast<T*>(p.out);
  for (int r = 0; r < rows; ++r) {
    const int t = t0 + r / G, h = kv * G + r % G;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    store_features<T, Pos>(o + (int64_t)r * p.dim, inv, p.dim,
                           out + (q_start + t) * p.o_tok + h * p.o_head);
    if (p.lse != nullptr)  // flash-attn reports +inf for a row that sees no key
      p.lse[h * p.lse_head + q_start + t] =
          l[r] > 0.0f ? m[r] + std::log(l[r]) : std::numeric_limits<float>::infinity();
  }
}

// The keys [lo, hi) that an item's rows may see (causal / window edges; queries are
// aligned to the end of the keys, flash-attn's bottom-right convention).
void key_range(const Problem& p, const Item& item, int64_t* lo, int64_t* hi) {
  const int b = item.seq, len_q = p.cu_q[b + 1] - p.cu_q[b], len_k = p.seq_lens_k[b];
  const int t0 = item.tile * p.block_m, t1 = std::min(len_q, t0 + p.block_m);
  const int64_t first = t0 + (int64_t)len_k - len_q, last = (t1 - 1) + (int64_t)len_k - len_q;
  *lo = p.window_left >= 0 ? std::max<int64_t>(0, first - p.window_left) : 0;
  *hi = p.window_right >= 0 ? std::min<int64_t>(len_k, last + p.window_right + 1) : len_k;
  *lo = std::max(*lo, item.key_lo);
  *hi = std::min(*hi, item.key_hi);
}

// What to prefetch while tile [j0, j0 + n) of `item` (its keys end at hi) computes: the next
// tile, or during the last one the first tile of `after` (the item this thread claimed next);
// the slots' offsets go to koff / voff.
template <typename T>
NextSlots<T> next_slots(const Problem& p, const Item& item, const Item* after, int64_t j0, int n,
                        int64_t hi, int n_pad, int64_t* koff, int64_t* voff, int64_t bytes) {
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  NextSlots<T> next;
  if (j0 + n < hi) {
    next = {k + item.kv0 * p.k_head, v + item.kv0 * p.v_head, koff, voff,
            p.tile_length(hi - j0 - n), bytes};
    key_offsets(p, item.seq, j0 + n, next.n, n_pad, koff, voff);
  } else if (after != nullptr) {
    int64_t lo, end;
    key_range(p, *after, &lo, &end);
    if (lo < end) {
      next = {k + after->kv0 * p.k_head, v + after->kv0 * p.v_head, koff, voff,
              p.tile_length(end - lo), bytes};
      key_offsets(p, after->seq, lo, next.n, n_pad, koff, voff);
    }
  }
  return next;
}

// Rows of kv heads [kv0, kv0 + kv_per_item) (o [H][rows][D], m and l [H][rows]), normalized
// into out (and lse).
template <typename T, int (*Pos)(int)>
void store_heads(const Problem& p, int q_start, int t0, int rows, int kv0, const float* o,
                 const float* m, const float* l) {
  for (int h = 0; h < p.kv_per_item; ++h) {
    const int64_t off = (int64_t)h * rows;
    store_rows<T, Pos>(p, q_start, t0, rows, kv0 + h, o + off * p.dim, m + off, l + off);
  }
}

// The offsets of the first tile of an item's keys [lo, hi) into koff / voff; a thread's first
// item also requests its slots (`bytes` each: the item's heads), later items had them
// prefetched while the one before computed.
template <typename T>
void first_tile(const Problem& p, const Item& item, int64_t lo, int64_t hi, int n_pad,
                int64_t* koff, int64_t* voff, int64_t bytes, Scratch& w) {
  if (lo < hi) {
    const int n = p.tile_length(hi - lo);
    key_offsets(p, item.seq, lo, n, n_pad, koff, voff);
    if (w.first) {
      prefetch_rows(static_cast<const T*>(p.k) + item.kv0 * p.k_head, koff, n, bytes);
      prefetch_rows(static_cast<const T*>(p.v) + item.kv0 * p.v_head, voff, n, bytes);
    }
  }
  w.first = false;
}

// Split groups merged by this process (split_merges(): what the tests read), key tiles that
// took the many-rows products (gemm_tiles()), shared-prefix items (shared_prefix_items())
// and the key tiles run (key_tiles()) and the keys they computed, padded (tile_keys()).
std::atomic<int64_t> merged_groups{0}, many_row_tiles{0}, shared_items{0}, padded_keys{0};
std::atomic<int64_t> key_tile_count{0};
std::atomic<int64_t> amx_key_tiles{0};  // key tiles multiplied on AMX (amx_tiles())

// The query rows of query tile `tile` of sequence `seq`: its queries times the heads sharing a
// kv head.
inline int tile_rows(const Problem& p, int seq, int tile) {
  const int len_q = p.cu_q[seq + 1] - p.cu_q[seq], t0 = tile * p.block_m;
  return (std::min(len_q, t0 + p.block_m) - t0) * (p.heads / p.kv_heads);
}

// The chunks of a split group into one output: the maximum of their maxima, each chunk's sums
// and output weighted by exp(m - max) (0 for a chunk that saw no key of a row), then stored.
// Chunk `own` is read from the scratch's o, m and l, where the merging item left it, the
// others from their records.
template <typename T, int (*Pos)(int)>
void merge_chunks(const Problem& p, const SplitGroup& g, Scratch& w, int own) {
  const int D = p.dim, H = p.kv_per_item, q_start = p.cu_q[g.seq];
  const int t0 = g.tile * p.block_m, rows = tile_rows(p, g.seq, g.tile);
  const int64_t n = (int64_t)H * rows;
  const auto record = [&](int c) {  // chunk c's o; its m and l follow (n D and n D + n)
    return p.partials + (g.first + c) * p.part_floats;
  };
  const auto m_of = [&](int c) { return c == own ? w.m.data() : record(c) + n * D; };
  const auto l_of = [&](int c) { return c == own ? w.l.data() : record(c) + n * D + n; };
  const auto o_of = [&](int c) { return c == own ? w.o.data() : record(c); };
  w.mo.assign(n * D, 0.0f);
  w.mm.assign(n, kNegInf);
  w.ml.assign(n, 0.0f);
  for (int c = 0; c < g.chunks; ++c) {
    const float* m = m_of(c);
    for (int64_t i = 0; i < n; ++i) w.mm[i] = std::max(w.mm[i], m[i]);
  }
  for (int c = 0; c < g.chunks; ++c) {
    const float *o = o_of(c), *m = m_of(c), *l = l_of(c);
    for (int64_t i = 0; i < n; ++i) {
      if (m[i] == kNegInf) continue;
      const float weight = std::exp(m[i] - w.mm[i]);
      w.ml[i] += weight * l[i];
      float* dst = w.mo.data() + i * D;
      for (int d = 0; d < D; ++d) dst[d] += weight * o[i * D + d];
    }
  }
  store_heads<T, Pos>(p, q_start, t0, rows, g.kv0, w.mo.data(), w.mm.data(), w.ml.data());
  merged_groups.fetch_add(1, std::memory_order_relaxed);
}

// An item's result: its rows normalized into out (and lse); for one chunk of a split group,
// merged with the others where they are all done (each wrote its record before its release
// below), else kept in its record for the merge, which the group's last chunk to finish does.
// Decode behind a shared prefix ends most members' groups that way: the set's item ran first.
template <typename T, int (*Pos)(int)>
void finish(const Problem& p, const Item& item, int q_start, int t0, int rows, Scratch& w) {
  const int D = p.dim, H = p.kv_per_item;
  if (item.group < 0)
    return store_heads<T, Pos>(p, q_start, t0, rows, item.kv0, w.o.data(), w.m.data(),
                               w.l.data());
  const SplitGroup& g = p.groups[item.group];
  if (g.pending->load(std::memory_order_acquire) == 1)
    return merge_chunks<T, Pos>(p, g, w, item.chunk);
  const int64_t n = (int64_t)H * rows;
  float* part = p.partials + (g.first + item.chunk) * p.part_floats;
  std::memcpy(part, w.o.data(), n * D * sizeof(float));
  std::memcpy(part + n * D, w.m.data(), n * sizeof(float));
  std::memcpy(part + n * D + n, w.l.data(), n * sizeof(float));
  if (g.pending->fetch_sub(1, std::memory_order_acq_rel) == 1)
    merge_chunks<T, Pos>(p, g, w, item.chunk);
}

// A shared item's result: each member's rows (`rows` in all, member after member) as chunk 0
// of that member's split group, all of them before any merge (merging reuses the scratch).
template <typename T, int (*Pos)(int)>
void finish_shared(const Problem& p, const Item& item, const SharedSet& set, int rows,
                   Scratch& w) {
  const int D = p.dim, H = p.kv_per_item, G = p.heads / p.kv_heads;
  const int kv_groups = p.kv_heads / H, kvg = item.kv0 / H;
  for (int i = 0, r0 = 0; i < set.count; ++i) {
    const int seq = p.member_seq[set.first + i];
    const int mine = (p.cu_q[seq + 1] - p.cu_q[seq]) * G;
    const SplitGroup& g = p.groups[p.member_group[(set.first + i) * kv_groups + kvg]];
    const int64_t n = (int64_t)H * mine;
    float* part = p.partials + g.first * p.part_floats;  // chunk 0
    for (int h = 0; h < H; ++h) {
      const int64_t from = (int64_t)h * rows + r0, to = (int64_t)h * mine;
      std::memcpy(part + to * D, w.o.data() + from * D, mine * D * sizeof(float));
      std::memcpy(part + n * D + to, w.m.data() + from, mine * sizeof(float));
      std::memcpy(part + n * D + n + to, w.l.data() + from, mine * sizeof(float));
    }
    r0 += mine;
  }
  shared_items.fetch_add(1, std::memory_order_relaxed);
  for (int i = 0; i < set.count; ++i) {
    const SplitGroup& g = p.groups[p.member_group[(set.first + i) * kv_groups + kvg]];
    if (g.pending->fetch_sub(1, std::memory_order_acq_rel) == 1)
      merge_chunks<T, Pos>(p, g, w, -1);
  }
}

// ---- bf16 K/V with AVX512-BF16: both products on vdpbf16ps ----------------------------------

#if HAVE_BF16_DOT
#define BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool cpu_has_bf16_dot() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

// The folds of a horizontal sum of 16 vectors (lane i of the last: the sum of vector i's
// lanes): pairs folded within 128-bit lanes (unpack, shuffle), then across them
// (shuffle_f32x4); 45 operations for 16 sums.
BF16_DOT ALWAYS_INLINE __m512 fold_pairs(__m512 a, __m512 b) {  // per 128-bit lane: a02 b02 a13 b13
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
BF16_DOT ALWAYS_INLINE __m512 fold_quads(__m512 x0, __m512 x1) {  // per 128-bit lane: a b c d
  return _mm512_add_ps(_mm512_shuffle_ps(x0, x1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 2, 3, 2)));
}
BF16_DOT ALWAYS_INLINE __m512 fold_halves(__m512 y0, __m512 y1) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 2, 3, 2)));
}
BF16_DOT ALWAYS_INLINE __m512 fold_last(__m512 z0, __m512 z1) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The dot products of q with 4 keys from key c, folded to one vector (fold_quads of their
// fold_pairs): 32 input features (16 pairs) per vdpbf16ps.
BF16_DOT ALWAYS_INLINE __m512 dot_keys4(const uint16_t* q, int dim,
                                        const c10::BFloat16* const* krow, int c) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int d = 0; d < dim; d += 32) {
    const __m512bh x = (__m512bh)_mm512_loadu_si512(q + d);
    a0 = _mm512_dpbf16_ps(a0, x, (__m512bh)_mm512_loadu_si512(krow[c] + d));
    a1 = _mm512_dpbf16_ps(a1, x, (__m512bh)_mm512_loadu_si512(krow[c + 1] + d));
    a2 = _mm512_dpbf16_ps(a2, x, (__m512bh)_mm512_loadu_si512(krow[c + 2] + d));
    a3 = _mm512_dpbf16_ps(a3, x, (__m512bh)_mm512_loadu_si512(krow[c + 3] + d));
  }
  return fold_quads(fold_pairs(a0, a1), fold_pairs(a2, a3));
}

// s[c] = scale * <q, k[c]> for 16 keys, four at a time, each four folded as soon as it is done:
// the 16 sums of all keys at once, folded at the end, went through the stack (zeroed, stored,
// loaded again) in a call GCC did not inline. The same folds of the same sums, so the same bits.
BF16_DOT ALWAYS_INLINE void dot_scores16(const uint16_t* q, int dim,
                                         const c10::BFloat16* const* krow, float scale, float* s) {
  const __m512 y0 = dot_keys4(q, dim, krow, 0), y1 = dot_keys4(q, dim, krow, 4);
  const __m512 y2 = dot_keys4(q, dim, krow, 8), y3 = dot_keys4(q, dim, krow, 12);
  const __m512 sums = fold_last(fold_halves(y0, y1), fold_halves(y2, y3));
  _mm512_storeu_ps(s, _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
}

// exp8 on 16 lanes, for softmax_rows<Lanes16> (the same steps: clamp, n = round(x log2 e), r
// in two parts, degree-6 Taylor, 2^n from the exponent bits, exactly 0 at x <= -88).
BF16_DOT ALWAYS_INLINE __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
  const __m512 big = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), big), big);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  __m512i e = _mm512_slli_epi32(biased, 23);
  e = _mm512_max_epi32(e, _mm512_setzero_si512());
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

struct Lanes16 {
  BF16_DOT static float row_max(const float* s, int n_pad) {
    __m512 mx = _mm512_set1_ps(kNegInf);
    for (int c = 0; c < n_pad; c += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + c));
    return _mm512_reduce_max_ps(mx);
  }
  BF16_DOT static float exp_sum(float* s, int n_pad, float m) {
    const __m512 shift = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < n_pad; c += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + c), shift));
      _mm512_storeu_ps(s + c, e);
      sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
  }
};

// Many rows (prefill): scores as a small GEMM. The tile's keys are transposed once into pairs
// of features, kt[f][c] = features 2f, 2f + 1 of key c, so that one vdpbf16ps multiplies a
// row's broadcast pair of query features with 16 keys and no reduction follows: R rows x NK
// groups of 16 keys accumulate in R * NK registers. Worth it from kManyRows rows on, where
// the transpose (one pass over the tile) serves enough rows; below, dot_scores16.
constexpr int kManyRows = 16;

// out[j][i] = rows[i][j] for 16 rows of 16 dwords (out rows `stride` dwords apart): pairs of
// rows interleaved by dwords, then by quadwords (each 128-bit lane then holds 4 rows of one
// column), then the lanes of 4 such vectors gathered into whole columns.
BF16_DOT inline void transpose16(const uint32_t* const* rows, uint32_t* out, int64_t stride) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i]);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k], lane L: rows 4i..4i+3 of column 4L + k
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  for (int k = 0; k < 4; ++k) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[k], r[4 + k], kEven);
    const __m512i x1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], kEven);
    const __m512i x2 = _mm512_shuffle_i32x4(r[k], r[4 + k], kOdd);
    const __m512i x3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], kOdd);
    _mm512_storeu_si512(out + (int64_t)k * stride, _mm512_shuffle_i32x4(x0, x1, kEven));
    _mm512_storeu_si512(out + (int64_t)(4 + k) * stride, _mm512_shuffle_i32x4(x2, x3, kEven));
    _mm512_storeu_si512(out + (int64_t)(8 + k) * stride, _mm512_shuffle_i32x4(x0, x1, kOdd));
    _mm512_storeu_si512(out + (int64_t)(12 + k) * stride, _mm512_shuffle_i32x4(x2, x3, kOdd));
  }
}

// kt[f][c] = pair f of key c, in blocks of 16 keys x 16 pairs (dim is a multiple of 32).
BF16_DOT inline void transpose_keys(const c10::BFloat16* const* krow, int n_pad, int dim,
                                    uint32_t* kt) {
  const uint32_t* rows[16];
  for (int c = 0; c < n_pad; c += 16)
    for (int f = 0; f < dim / 2; f += 16) {
      for (int i = 0; i < 16; ++i) rows[i] = reinterpret_cast<const uint32_t*>(krow[c + i]) + f;
      transpose16(rows, kt + (int64_t)f * n_pad + c, n_pad);
    }
}

template <int R, int NK>
BF16_DOT inline void gemm_scores(const uint16_t* q, int dim, const uint32_t* kt, int n_pad,
                                 int c, float scale, float* s, int s_stride) {
  __m512 acc[R][NK];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NK; ++k) acc[r][k] = _mm512_setzero_ps();
  for (int f = 0; f < dim / 2; ++f) {
    __m512bh kv[NK];
    for (int k = 0; k < NK; ++k)
      kv[k] = (__m512bh)_mm512_loadu_si512(kt + (int64_t)f * n_pad + c + 16 * k);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, q + (int64_t)r * dim + 2 * f, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);
      for (int k = 0; k < NK; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], x, kv[k]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NK; ++k)
      _mm512_storeu_ps(s + (int64_t)r * s_stride + c + 16 * k, _mm512_mul_ps(acc[r][k], sc));
}

// Scores of `rows` query rows (bf16, [rows][dim]) against the n_pad keys of kt, in blocks of
// up to 6 rows x 32 keys (16 for the last group of an odd count).
BF16_DOT void gemm_score_rows(const uint16_t* q, int rows, int dim, const uint32_t* kt,
                              int n_pad, float scale, float* s) {
  for (int c = 0; c < n_pad; c += 32)
    row_blocks<6>(rows, [&](int r, auto R) {
      constexpr int RB = decltype(R)::value;
      const uint16_t* qr = q + (int64_t)r * dim;
      float* sr = s + (int64_t)r * n_pad;
      if (c + 32 <= n_pad) gemm_scores<RB, 2>(qr, dim, kt, n_pad, c, scale, sr, n_pad);
      else gemm_scores<RB, 1>(qr, dim, kt, n_pad, c, scale, sr, n_pad);
    });
}

// 16 bf16 as fp32 (each the high half of its fp32).
BF16_DOT ALWAYS_INLINE __m512 widen_bf16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// A row's probabilities as bf16 pairs of keys (pair j / 2 holds keys j (low half), j + 1), and
// in `rest` the same for what that rounding left: P = pairs + rest to about 16 bits, where
// pairs alone carry 8 (P rounded to bf16 turned SmolLM2's first token of a chat answer).
BF16_DOT inline void to_pairs(const float* s, int n_pad, uint32_t* pairs, uint32_t* rest) {
  int c = 0;
  for (; c + 32 <= n_pad; c += 32) {
    const __m512 a = _mm512_loadu_ps(s + c), b = _mm512_loadu_ps(s + c + 16);
    const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    _mm512_storeu_si512(pairs + c / 2, hi);
    const __m512 ra = _mm512_sub_ps(a, widen_bf16(_mm512_castsi512_si256(hi)));
    const __m512 rb = _mm512_sub_ps(b, widen_bf16(_mm512_extracti64x4_epi64(hi, 1)));
    _mm512_storeu_si512(rest + c / 2, (__m512i)_mm512_cvtne2ps_pbh(rb, ra));
  }
  if (c < n_pad) {  // 16 left (n_pad is a multiple of 16)
    const __m512 a = _mm512_loadu_ps(s + c);
    const __m256i hi = (__m256i)_mm512_cvtneps_pbh(a);
    _mm256_storeu_si256((__m256i*)(pairs + c / 2), hi);
    _mm256_storeu_si256((__m256i*)(rest + c / 2),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(a, widen_bf16(hi))));
  }
}

// o[r] = o[r] * alpha[r] + sum_j p[r][j] v[j] over keys [j0, j1) for R rows, NC chunks of 32
// features from d (alpha null: no rescale): the V rows of keys j and j + 1 interleaved
// (unpack) meet the broadcast pair of their probabilities in one vdpbf16ps per 16 outputs
// and part of P (to_pairs).
template <int R, int NC>
BF16_DOT inline void dot_pv(const uint32_t* pairs, const uint32_t* rest, int pair_stride,
                            const c10::BFloat16* const* vrow, int j0, int j1, const float* alpha,
                            float* o, int dim, int d) {
  __m512 acc[R][2 * NC];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 2 * NC; ++k) {
      acc[r][k] = _mm512_loadu_ps(o + r * dim + d + 16 * k);
      if (alpha != nullptr) acc[r][k] = _mm512_mul_ps(acc[r][k], _mm512_set1_ps(alpha[r]));
    }
  for (int j = j0; j < j1; j += 2) {
    __m512i v[2 * NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i a = _mm512_loadu_si512(vrow[j] + d + 32 * c);
      const __m512i b = _mm512_loadu_si512(vrow[j + 1] + d + 32 * c);
      v[2 * c] = _mm512_unpacklo_epi16(a, b);
      v[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pairs[r * pair_stride + j / 2]);
      const __m512bh y = (__m512bh)_mm512_set1_epi32((int)rest[r * pair_stride + j / 2]);
      for (int k = 0; k < 2 * NC; ++k) {
        acc[r][k] = _mm512_dpbf16_ps(acc[r][k], x, (__m512bh)v[k]);
        acc[r][k] = _mm512_dpbf16_ps(acc[r][k], y, (__m512bh)v[k]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 2 * NC; ++k) _mm512_storeu_ps(o + r * dim + d + 16 * k, acc[r][k]);
}

template <int R>
BF16_DOT void dot_pv_rows(const uint32_t* pairs, const uint32_t* rest, int pair_stride,
                          const c10::BFloat16* const* vrow, int j0, int j1, const float* alpha,
                          float* o, int dim) {
  int d = 0;
  for (; d + 64 <= dim; d += 64)
    dot_pv<R, 2>(pairs, rest, pair_stride, vrow, j0, j1, alpha, o, dim, d);
  if (d < dim) dot_pv<R, 1>(pairs, rest, pair_stride, vrow, j0, j1, alpha, o, dim, d);
}

// Many rows: the V rows of each pair of keys interleaved once per tile, as dot_pv's unpack
// makes them (vt holds dim dwords a pair), then R rows x NZ vectors of outputs per pass.
BF16_DOT inline void interleave_values(const c10::BFloat16* const* vrow, int n_pad, int dim,
                                       uint32_t* vt) {
  for (int j = 0; j < n_pad; j += 2)
    for (int c = 0; c < dim / 32; ++c) {
      const __m512i a = _mm512_loadu_si512(vrow[j] + 32 * c);
      const __m512i b = _mm512_loadu_si512(vrow[j + 1] + 32 * c);
      uint32_t* out = vt + (int64_t)(j / 2) * dim + 32 * c;
      _mm512_storeu_si512(out, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(out + 16, _mm512_unpackhi_epi16(a, b));
    }
}

template <int R, int NZ>
BF16_DOT inline void gemm_pv(const uint32_t* pairs, const uint32_t* rest, int pair_stride,
                             const uint32_t* vt, int n_pad, const float* alpha, float* o, int dim,
                             int d) {
  __m512 acc[R][NZ];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NZ; ++k)
      acc[r][k] = _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)r * dim + d + 16 * k),
                                _mm512_set1_ps(alpha[r]));
  for (int j = 0; j < n_pad; j += 2) {
    __m512bh v[NZ];
    for (int k = 0; k < NZ; ++k)
      v[k] = (__m512bh)_mm512_loadu_si512(vt + (int64_t)(j / 2) * dim + d + 16 * k);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pairs[r * pair_stride + j / 2]);
      const __m512bh y = (__m512bh)_mm512_set1_epi32((int)rest[r * pair_stride + j / 2]);
      for (int k = 0; k < NZ; ++k) {
        acc[r][k] = _mm512_dpbf16_ps(acc[r][k], x, v[k]);
        acc[r][k] = _mm512_dpbf16_ps(acc[r][k], y, v[k]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NZ; ++k) _mm512_storeu_ps(o + (int64_t)r * dim + d + 16 * k, acc[r][k]);
}

// o[r] = o[r] * alpha[r] + P[r] V for `rows` rows over the n_pad keys of vt, in blocks of up
// to 6 rows x 64 features (32 for the last of a dim that is an odd multiple of 32).
BF16_DOT void gemm_pv_rows(const uint32_t* pairs, const uint32_t* rest, int pair_stride,
                           int rows, const uint32_t* vt, int n_pad, const float* alpha, float* o,
                           int dim) {
  for (int d = 0; d < dim; d += 64)
    row_blocks<6>(rows, [&](int r, auto R) {
      constexpr int RB = decltype(R)::value;
      const uint32_t* pr = pairs + (int64_t)r * pair_stride;
      const uint32_t* rr = rest + (int64_t)r * pair_stride;
      float* orow = o + (int64_t)r * dim;
      if (d + 64 <= dim) gemm_pv<RB, 4>(pr, rr, pair_stride, vt, n_pad, alpha + r, orow, dim, d);
      else gemm_pv<RB, 2>(pr, rr, pair_stride, vt, n_pad, alpha + r, orow, dim, d);
    });
}

// ---- AMX tiles for the many-row products ----------------------------------------------------
// Where the CPU has AMX-BF16 (and Linux grants this process the tile state), the many-row
// products run on tiles: one tdpbf16ps multiplies 16 rows x 32 bf16 features of A by 32
// features x 16 columns of B stored in pairs (16 rows of 64 bytes), adding into 16 x 16 fp32
// sums, a 16th of what 16 rows x 64 keys cost in vdpbf16ps. Both operands are already laid
// out so: scores take the queries as A and the transposed keys (kt) as B, P @ V the
// probabilities' pairs as A and the interleaved values (vt) as B, so the sums come out in the
// vector path's orders. Rows go in blocks of 16, the last block shifted back to end at the
// last row (its first rows computed twice and stored once); tiles 0-3 hold sums, 4 A, 5-7 B.
#define AMX_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), and the tile data state granted to
// this process (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool cpu_has_amx() {
  unsigned a, b, c, d;
  if (!cpu_has_bf16_dot() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes. GCC 12's tile intrinsics do not name the memory they read
// or write: the configuration goes in as a whole operand, and the callers fence the
// compiler's memory order around the tiles (memory_order_for_tiles).
AMX_BF16 void amx_configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  asm volatile("ldtilecfg %0" : : "m"(config));
}

AMX_BF16 void amx_release() { _tile_release(); }

inline void memory_order_for_tiles() { asm volatile("" : : : "memory"); }

bool amx_enabled();

// The next block of 16 rows after `done` of `rows` (>= 16): starts at min(done, rows - 16).
inline int block_start(int done, int rows) { return std::min(done, rows - 16); }

// Up to 4 tiles of sums (NT of them) as fp32 [16][64] in `c`.
template <int NT>
AMX_BF16 inline void store_sums(float (*c)[64]) {
  _tile_stored(0, &c[0][0], 64 * sizeof(float));
  if constexpr (NT > 1) _tile_stored(1, &c[0][16], 64 * sizeof(float));
  if constexpr (NT > 2) _tile_stored(2, &c[0][32], 64 * sizeof(float));
  if constexpr (NT > 3) _tile_stored(3, &c[0][48], 64 * sizeof(float));
}

template <int NT>
AMX_BF16 inline void zero_sums() {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  if constexpr (NT > 3) _tile_zero(3);
}

// c[16][16 * NT] = A (16 rows of `a_bytes`, `steps` x 32 features from a) x B (step i's tile
// at b + i * b_step, column tile t at + 16 t dwords, rows b_bytes apart).
template <int NT>
AMX_BF16 void amx_block(const void* a, int64_t a_bytes, const uint32_t* b, int64_t b_step,
                        int64_t b_bytes, int steps, float (*c)[64]) {
  memory_order_for_tiles();
  zero_sums<NT>();
  for (int i = 0; i < steps; ++i) {
    const uint32_t* bs = b + i * b_step;
    _tile_loadd(4, static_cast<const char*>(a) + i * 64, a_bytes);
    _tile_loadd(5, bs, b_bytes);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NT > 1) {
      _tile_loadd(6, bs + 16, b_bytes);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NT > 2) {
      _tile_loadd(7, bs + 32, b_bytes);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NT > 3) {
      _tile_loadd(5, bs + 48, b_bytes);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  store_sums<NT>(c);
  memory_order_for_tiles();
}

AMX_BF16 void amx_block_nt(int nt, const void* a, int64_t a_bytes, const uint32_t* b,
                           int64_t b_step, int64_t b_bytes, int steps, float (*c)[64]) {
  switch (nt) {
    case 1: return amx_block<1>(a, a_bytes, b, b_step, b_bytes, steps, c);
    case 2: return amx_block<2>(a, a_bytes, b, b_step, b_bytes, steps, c);
    case 3: return amx_block<3>(a, a_bytes, b, b_step, b_bytes, steps, c);
    default: return amx_block<4>(a, a_bytes, b, b_step, b_bytes, steps, c);
  }
}

// gemm_score_rows on tiles: s[r][c] = scale * <q[r], k[c]> for rows >= 16.
AMX_BF16 void amx_score_rows(const uint16_t* q, int rows, int dim, const uint32_t* kt,
                             int n_pad, float scale, float* s) {
  alignas(64) float c[16][64];
  const __m512 sc = _mm512_set1_ps(scale);
  for (int done = 0; done < rows;) {
    const int r0 = block_start(done, rows);
    for (int c0 = 0; c0 < n_pad; c0 += 64) {
      const int nt = std::min(4, (n_pad - c0) / 16);
      // A: 32 features of 16 queries a step; B: 16 pairs of features x 16 keys, from kt[16 i]
      amx_block_nt(nt, q + (int64_t)r0 * dim, dim * 2, kt + c0, 16 * (int64_t)n_pad, n_pad * 4,
                   dim / 32, c);
      for (int i = done - r0; i < 16; ++i)
        for (int t = 0; t < nt; ++t)
          _mm512_storeu_ps(s + (int64_t)(r0 + i) * n_pad + c0 + 16 * t,
                           _mm512_mul_ps(_mm512_load_ps(&c[i][16 * t]), sc));
    }
    done = r0 + 16;
  }
}

// gemm_pv_rows on tiles: o[r] = o[r] * alpha[r] + P[r] V for rows >= 16 (alpha null: o[r] +
// P[r] V, for P's second part). A step takes 32 keys (16 pairs); a tile of an odd number of 16
// keys has vt's pairs beyond it zero and pairs' rows readable beyond their last (finite
// values: they meet the zeros).
AMX_BF16 void amx_pv_rows(const uint32_t* pairs, int pair_stride, int rows, const uint32_t* vt,
                          int n_pad, const float* alpha, float* o, int dim) {
  alignas(64) float c[16][64];
  for (int done = 0; done < rows;) {
    const int r0 = block_start(done, rows);
    for (int d = 0; d < dim; d += 64) {
      const int nt = std::min(4, (dim - d) / 16);
      // A: 16 pairs of keys of 16 rows a step; B: 16 pairs of V rows x 16 outputs
      amx_block_nt(nt, pairs + (int64_t)r0 * pair_stride, pair_stride * 4, vt + d,
                   16 * (int64_t)dim, dim * 4, (n_pad + 31) / 32, c);
      for (int i = done - r0; i < 16; ++i) {
        const __m512 a = _mm512_set1_ps(alpha != nullptr ? alpha[r0 + i] : 1.0f);
        float* orow = o + (int64_t)(r0 + i) * dim + d;
        for (int t = 0; t < nt; ++t)
          _mm512_storeu_ps(orow + 16 * t, _mm512_fmadd_ps(_mm512_loadu_ps(orow + 16 * t), a,
                                                          _mm512_load_ps(&c[i][16 * t])));
      }
    }
    done = r0 + 16;
  }
}

// One key tile (n valid keys of n_pad, a multiple of 16) for the item's H kv heads. Memory is
// walked in slot order: each group of 16 keys is scored for every head before the next group
// (a slot's heads are adjacent), and P @ V goes over groups of 32 keys the same way, so the
// lines of a block are read together rather than once per head pass. A few rows request the
// next tile's slots while scoring (slot c + i of the next tile with key group c of this one),
// and those past this tile's n_pad while multiplying P @ V: an item's short last tile (a
// decode sequence's keys past its last whole tile) meets a whole tile of the next item, whose
// slots past the short one's n_pad were otherwise not requested at all.
BF16_DOT void dot_tile(const Problem& p, Scratch& w, int H, int rows, int64_t j0, int n,
                       int n_pad, const NextSlots<c10::BFloat16>& next) {
  const int D = p.dim, pair_stride = n_pad / 2;
  const auto* krow = reinterpret_cast<const c10::BFloat16* const*>(w.krow.data());
  const auto* vrow = reinterpret_cast<const c10::BFloat16* const*>(w.vrow.data());
  const int64_t head_s = (int64_t)rows * n_pad, head_q = (int64_t)rows * D;
  const bool tiles = rows >= kManyRows && amx_enabled();
  if (tiles) {
    amx_key_tiles.fetch_add(1, std::memory_order_relaxed);
    amx_configure();
  }
  if (rows >= kManyRows) {
    many_row_tiles.fetch_add(1, std::memory_order_relaxed);
    w.kt.resize((size_t)D / 2 * n_pad);
    for (int h = 0; h < H; ++h) {
      next.prefetch_share(h, 1, H);
      transpose_keys(krow + h * n_pad, n_pad, D, w.kt.data());
      const uint16_t* q = w.qb.data() + h * head_q;
      float* s = w.s.data() + h * head_s;
      if (tiles) amx_score_rows(q, rows, D, w.kt.data(), n_pad, p.scale, s);
      else gemm_score_rows(q, rows, D, w.kt.data(), n_pad, p.scale, s);
    }
  } else {
    for (int c = 0; c < n_pad; c += 16) {
      for (int h = 0; h < H; ++h)
        for (int r = 0; r < rows; ++r) {
          const int part = h * rows + r, parts = H * rows;
          next.prefetch(c + 16 * part / parts, c + 16 * (part + 1) / parts);
          dot_scores16(w.qb.data() + h * head_q + (int64_t)r * D, D, krow + h * n_pad + c,
                       p.scale, w.s.data() + h * head_s + (int64_t)r * n_pad + c);
        }
    }
  }
  for (int h = 0; h < H; ++h) {
    float* s = w.s.data() + h * head_s;
    float* alpha = w.alpha.data() + (int64_t)h * rows;
    mask_tile(p, w.pos.data(), rows, j0, n, n_pad, s);
    softmax_rows<Lanes16>(s, rows, n, n_pad, w.m.data() + (int64_t)h * rows,
                          w.l.data() + (int64_t)h * rows, alpha);
    for (int r = 0; r < rows; ++r) {
      const int64_t at = (h * rows + r) * (int64_t)pair_stride;
      to_pairs(s + (int64_t)r * n_pad, n_pad, w.pb.data() + at, w.pr.data() + at);
    }
  }
  if (rows >= kManyRows) {
    // tiles step 32 keys: an odd 16 meets zero pairs of V
    const int v_pairs = tiles ? (n_pad + 31) / 32 * 16 : n_pad / 2;
    w.vt.resize((size_t)v_pairs * D);
    std::fill(w.vt.begin() + (int64_t)n_pad / 2 * D, w.vt.begin() + (int64_t)v_pairs * D, 0u);
    for (int h = 0; h < H; ++h) {
      const int64_t row = (int64_t)h * rows;
      interleave_values(vrow + h * n_pad, n_pad, D, w.vt.data());
      const uint32_t* pairs = w.pb.data() + row * pair_stride;
      const uint32_t* rest = w.pr.data() + row * pair_stride;
      float *alpha = w.alpha.data() + row, *o = w.o.data() + row * D;
      if (tiles) {  // P's two parts one after the other
        amx_pv_rows(pairs, pair_stride, rows, w.vt.data(), n_pad, alpha, o, D);
        amx_pv_rows(rest, pair_stride, rows, w.vt.data(), n_pad, nullptr, o, D);
      } else {
        gemm_pv_rows(pairs, rest, pair_stride, rows, w.vt.data(), n_pad, alpha, o, D);
      }
    }
    if (tiles) amx_release();
    return;
  }
  const NextSlots<c10::BFloat16> beyond = next.past(n_pad);
  for (int c = 0; c < n_pad; c += 32) {
    const int c1 = std::min(n_pad, c + 32);
    for (int h = 0; h < H; ++h) {
      beyond.prefetch_share(c / 32 * H + h, 1, (n_pad + 31) / 32 * H);
      row_blocks(rows, [&](int r, auto R) {
        const int64_t row = (int64_t)h * rows + r;
        dot_pv_rows<decltype(R)::value>(w.pb.data() + row * pair_stride,
                                        w.pr.data() + row * pair_stride, pair_stride,
                                        vrow + h * n_pad, c, c1,
                                        c == 0 ? w.alpha.data() + row : nullptr,
                                        w.o.data() + row * D, D);
      });
    }
  }
}

// attend() for bf16 K/V on the dot path: the same items, tiles and online softmax. `after`:
// the item this thread takes next (its first tile is prefetched during this one's last).
void attend_bf16_tiles(const Problem& p, const Item& item, const Item* after, Scratch& w) {
  using T = c10::BFloat16;
  const int b = item.seq, D = p.dim, G = p.heads / p.kv_heads, H = p.kv_per_item;
  const int q_start = p.cu_q[b], len_q = p.cu_q[b + 1] - q_start;
  const int t0 = item.tile * p.block_m, t1 = std::min(len_q, t0 + p.block_m);
  const SharedSet* set = item.shared >= 0 ? &p.shared[item.shared] : nullptr;
  const int rows = set != nullptr ? set->rows : (t1 - t0) * G;  // a set: member after member
  const int n_pad = (p.max_tile() + 15) / 16 * 16;
  w.qb.resize((size_t)H * rows * D);
  w.o.assign((size_t)H * rows * D, 0.0f);
  w.m.assign((size_t)H * rows, kNegInf);
  w.l.assign((size_t)H * rows, 0.0f);
  w.s.resize((size_t)H * rows * n_pad);
  w.pb.resize((size_t)H * rows * n_pad / 2 + 16);  // + what AMX tiles read past the last row
  w.pr.resize(w.pb.size());
  w.alpha.resize((size_t)H * rows);
  w.pos.resize(rows);
  w.koff.resize(2 * n_pad), w.voff.resize(2 * n_pad);
  w.krow.resize((size_t)H * n_pad), w.vrow.resize((size_t)H * n_pad);
  const T* qbase = static_cast<const T*>(p.q);
  // rows from r0 on: tokens [tok0, tok1) of sequence `seq`, G query heads each
  auto load_rows = [&](int seq, int tok0, int tok1, int r0) {
    const int start = p.cu_q[seq], lq = p.cu_q[seq + 1] - start, lk = p.seq_lens_k[seq];
    for (int r = 0; r < (tok1 - tok0) * G; ++r) {
      const int t = tok0 + r / G;
      for (int h = 0; h < H; ++h)
        std::memcpy(w.qb.data() + ((int64_t)h * rows + r0 + r) * D,
                    qbase + (start + t) * p.q_tok + ((item.kv0 + h) * G + r % G) * p.q_head,
                    D * sizeof(T));
      w.pos[r0 + r] = t + (int64_t)lk - lq;
    }
  };
  if (set == nullptr) {
    load_rows(b, t0, t1, 0);
  } else {
    for (int i = 0, r0 = 0; i < set->count; ++i) {
      const int m = p.member_seq[set->first + i], lq = p.cu_q[m + 1] - p.cu_q[m];
      load_rows(m, 0, lq, r0);
      r0 += lq * G;
    }
  }
  int64_t lo, hi;
  key_range(p, item, &lo, &hi);
  const T* kbase = static_cast<const T*>(p.k) + item.kv0 * p.k_head;
  const T* vbase = static_cast<const T*>(p.v) + item.kv0 * p.v_head;
  int64_t *koff = w.koff.data(), *voff = w.voff.data();
  int64_t *koff_next = koff + n_pad, *voff_next = voff + n_pad;
  const int64_t slot_bytes = (int64_t)H * p.k_head * sizeof(T);  // this item's heads of a slot
  first_tile<T>(p, item, lo, hi, n_pad, koff, voff, slot_bytes, w);
  for (int64_t j0 = lo, n = 0; j0 < hi; j0 += n) {
    n = p.tile_length(hi - j0);
    const NextSlots<T> next =
        next_slots<T>(p, item, after, j0, n, hi, n_pad, koff_next, voff_next, slot_bytes);
    // A short tile (an item's last) is padded to 16 keys, not to a whole tile: decode items
    // end on one most of the time, and a 64-key tile for a few keys was most of their work.
    const int tile_pad = (n + 15) / 16 * 16;
    padded_keys.fetch_add(tile_pad, std::memory_order_relaxed);
    key_tile_count.fetch_add(1, std::memory_order_relaxed);
    for (int h = 0; h < H; ++h) {  // through locals: a pointer stored may alias w's vectors
      const T* const kh = kbase + h * p.k_head;
      const T* const vh = vbase + h * p.v_head;
      const void** __restrict kr = w.krow.data() + (size_t)h * tile_pad;
      const void** __restrict vr = w.vrow.data() + (size_t)h * tile_pad;
      const int64_t* __restrict ko = koff;
      const int64_t* __restrict vo = voff;
      for (int c = 0; c < tile_pad; ++c) kr[c] = kh + ko[c], vr[c] = vh + vo[c];
    }
    dot_tile(p, w, H, rows, j0, n, tile_pad, next);
    std::swap(koff, koff_next);
    std::swap(voff, voff_next);
  }
  if (set != nullptr) return finish_shared<T, dot_pos>(p, item, *set, rows, w);
  finish<T, dot_pos>(p, item, q_start, t0, rows, w);
}

// An item on the dot path. Many rows (a prefill tile, a shared prefix's set) take key tiles
// of twice the L1 rule's block_n: the rule counts fp32 keys, and this path's transposed keys
// and interleaved values are bf16, so the doubled tile is the rule's bytes. One process taking
// turns, two threads, 12 layers of the 125M model's heads: a 2,048-token prefill 456 -> 418 ms,
// 53 chunks of 40-50 tokens behind a 240-key prefix 132 -> 127 ms, a 64-sequence decode behind
// a shared 256-key prefix 6.73 -> 6.62 ms; a few rows keep the rule's tile (a 48-sequence decode
// of 96-480 keys took 4-6% longer at twice the keys).
void attend_bf16_dot(const Problem& p, const Item& item, const Item* after, Scratch& w) {
  const int rows = item.shared >= 0 ? p.shared[item.shared].rows
                                    : tile_rows(p, item.seq, item.tile);
  if (rows < kManyRows) return attend_bf16_tiles(p, item, after, w);
  Problem wide = p;
  wide.block_n = 2 * p.block_n;
  wide.tail_keys = 2 * p.tail_keys;
  attend_bf16_tiles(wide, item, after, w);
}
#else
bool cpu_has_bf16_dot() { return false; }
bool cpu_has_amx() { return false; }
void attend_bf16_dot(const Problem&, const Item&, const Item*, Scratch&) {}
#endif

template <typename T>
void attend_tiles(const Problem& p, const Item& item, const Item* after, Scratch& w);

// An item on its path. fp32 K and V of a few rows' tile (decode: dot products, P @ V passing
// over V once per chunk of features) take key tiles of half the L1 rule's block_n: at its
// block_n one head's K and V tiles fill the L1 on their own, so P @ V's passes met V in the
// L2 (SmolLM2's decode, 64 -> 32 keys: 1.15-1.18x, one sequence or 48; a prefill's GEMM
// tiles keep the larger tile, 0.92x at the smaller).
template <typename T>
void attend(const Problem& p, const Item& item, const Item* after, Scratch& w) {
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    if (p.bf16_dot) return attend_bf16_dot(p, item, after, w);
  }
  if constexpr (sizeof(T) == 4) {
    if (!many_rows(tile_rows(p, item.seq, item.tile)) && p.block_n >= 32) {
      Problem half = p;
      half.block_n = p.block_n / 2;
      half.tail_keys = p.tail_keys / 2;
      return attend_tiles<T>(half, item, after, w);
    }
  }
  attend_tiles<T>(p, item, after, w);
}

// attend()'s key tiles on the vector path.
template <typename T>
void attend_tiles(const Problem& p, const Item& item, const Item* after, Scratch& w) {
  const int b = item.seq, D = p.dim, G = p.heads / p.kv_heads, H = p.kv_per_item;
  const int q_start = p.cu_q[b], len_q = p.cu_q[b + 1] - q_start, len_k = p.seq_lens_k[b];
  const int t0 = item.tile * p.block_m, rows = tile_rows(p, item.seq, item.tile);
  const int n_pad = (p.max_tile() + 7) / 8 * 8;
  // Many rows: the keys transposed into fp32 once a tile, the values widened to fp32 rows.
  const bool many = many_rows(rows), widen = many && !std::is_same<T, float>::value;
  w.q.resize((size_t)H * rows * D);
  w.o.assign((size_t)H * rows * D, 0.0f);
  w.m.assign((size_t)H * rows, kNegInf);
  w.l.assign((size_t)H * rows, 0.0f);
  w.s.resize((size_t)rows * n_pad);
  w.alpha.resize(rows);
  w.pos.resize(rows);
  w.koff.resize(2 * n_pad), w.voff.resize(2 * n_pad);
  if (many) w.kf.resize((size_t)n_pad * D);
  if (widen) {
    w.vf.resize((size_t)n_pad * D), w.dense.resize(n_pad);
    for (int c = 0; c < n_pad; ++c) w.dense[c] = (int64_t)c * D;
  }
  for (int h = 0; h < H; ++h)
    load_queries<T>(p, q_start, t0, rows, item.kv0 + h, w.q.data() + (int64_t)h * rows * D);
  // Queries are aligned to the end of the keys (flash-attn's bottom-right causal convention).
  for (int r = 0; r < rows; ++r) w.pos[r] = t0 + r / G + (int64_t)len_k - len_q;
  int64_t lo, hi;
  key_range(p, item, &lo, &hi);
  const T* kbase = static_cast<const T*>(p.k);
  const T* vbase = static_cast<const T*>(p.v);
  // Two offset buffers: the current tile's and the next one's (being prefetched).
  int64_t *koff = w.koff.data(), *voff = w.voff.data();
  int64_t *koff_next = koff + n_pad, *voff_next = voff + n_pad;
  const int64_t row_bytes = (int64_t)H * p.k_head * sizeof(T);  // this item's heads of a slot
  float* vf = w.vf.data();
  const int64_t* dense = w.dense.data();
  first_tile<T>(p, item, lo, hi, n_pad, koff, voff, row_bytes, w);
  for (int64_t j0 = lo, n = 0; j0 < hi; j0 += n) {
    n = p.tile_length(hi - j0);
    const NextSlots<T> next =
        next_slots<T>(p, item, after, j0, n, hi, n_pad, koff_next, voff_next, row_bytes);
    // A short tile (an item's last) is scored padded to 8 keys, not to a whole tile.
    const int tile_pad = (n + 7) / 8 * 8;
    padded_keys.fetch_add(tile_pad, std::memory_order_relaxed);
    key_tile_count.fetch_add(1, std::memory_order_relaxed);
    if (many) many_row_tiles.fetch_add(1, std::memory_order_relaxed);
    for (int h = 0; h < H; ++h) {
      const int kv = item.kv0 + h;
      const TileRows<T> k{kbase + kv * p.k_head, koff}, v{vbase + kv * p.v_head, voff};
      const int64_t off = (int64_t)h * rows;
      float* q = w.q.data() + off * D;
      float* o = w.o.data() + off * D;
      float *m = w.m.data() + off, *l = w.l.data() + off;
      if (widen) {
        for (int c = 0; c < tile_pad; ++c) to_scratch(v[c], vf + dense[c], D, 1.0f);
        tile_step<T, float>(p, w, rows, j0, n, tile_pad, q, o, m, l, k, TileRows<float>{vf, dense},
                            next, h, H);
      } else {
        tile_step<T, T>(p, w, rows, j0, n, tile_pad, q, o, m, l, k, v, next, h, H);
      }
    }
    std::swap(koff, koff_next);
    std::swap(voff, voff_next);
  }
  finish<T, lane_pos<T>>(p, item, q_start, t0, rows, w);
}

// The next item of `items` from `next` on, claimed ahead of the one a thread starts, where it
// is small beside a thread's share (`small`); else none (total).
int64_t claim_small(const std::vector<Item>& items, std::atomic<int64_t>& next, int64_t small) {
  const int64_t total = (int64_t)items.size();
  int64_t k = next.load(std::memory_order_relaxed);
  while (k < total && items[k].cost <= small)
    if (next.compare_exchange_weak(k, k + 1, std::memory_order_relaxed)) return k;
  return total;
}

// Items sorted by cost, heaviest first, handed out through an atomic counter: causal tiles and
// ragged sequences differ in cost by orders of magnitude, so a static split would idle threads.
template <typename T>
void run(const Problem& p, const std::vector<Item>& items) {
  const int64_t total = (int64_t)items.size();
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), total);
  // With many items, each thread claims its next item before it starts one, so that the
  // current item can prefetch the next one's first keys (with few items, holding one back
  // could idle a thread at the end). Only an item of at most an eighth of a thread's share
  // is claimed so: the heaviest come first, and a thread that took the next of them beside its
  // own (a shared prefix's sets) left the other with the light ones. 12 layers, one process
  // taking turns: a 64-sequence decode behind a 256-key prefix 8.94 -> 8.73 ms, 16 sequences
  // 2.19 -> 2.06 ms, 40 behind 256 keys 5.65 -> 5.48 ms; without a prefix unchanged.
  const bool ahead = total >= 4 * threads;
  int64_t work = 0;
  for (const Item& item : items) work += item.cost;
  const int64_t small = work / (8 * threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local Scratch w;  // a thread's buffers, kept from call to call (30 a decode step)
    w.first = true;
    for (int64_t i = next++; i < total;) {
      const int64_t j = ahead ? claim_small(items, next, small) : total;
      attend<T>(p, items[i], j < total ? &items[j] : nullptr, w);
      i = j < total ? j : next++;
    }
  });
}

// Split items keep chunks of at least this many keys (an item's set-up costs about a tile).
constexpr int64_t kMinChunkKeys = 64;

struct Splits {
  std::vector<SplitGroup> groups;
  std::unique_ptr<std::atomic<int>[]> pending;
  std::vector<SharedSet> sets;
  std::vector<int> member_seq, member_group;
};

// Room for `floats` floats of the split chunks' records, kept by the calling thread from call
// to call and never cleared: each chunk writes its whole record (finish, finish_shared)
// before the merge reads it. A vector sized per call zeroed it on the calling thread alone
// while the others waited, 400 KB for a 64-sequence decode behind a shared prefix (perf: 7.6%
// of that thread's time in memset against 1.5% on the other).
float* partial_records(int64_t floats) {
  thread_local std::vector<float> records;
  if ((int64_t)records.size() < floats) records.resize(floats);
  return records.data();
}

// A shared prefix is worth its own items from this many sequences and keys on; a set holds
// up to kSharedRows query rows a kv head (tiles of the GEMM path, sets enough for the threads).
constexpr int kMinSharedSeqs = 4;
constexpr int64_t kMinSharedKeys = 64;
constexpr int kSharedRows = 48;

// Each sequence's shared prefix keys (0: none): sequences of one query tile and at most
// kSharedRows rows a kv head (decode, short chunks) grouped by their first block, each group's
// prefix the blocks all its members' tables start with, ending before every member's first
// query (so all their rows see all of it). Only the paged bf16-dot path, without a window to
// the left. `members`: the sequences with a prefix, those of one prefix (one first block) next
// to each other. A chunk of more rows would fill a set alone, and its keys split between two
// items cost more than in one: 53 chunks of 30-50 tokens behind a 240-key prefix (a prefill
// step of the 125M model's shared-prefix workload), 12 layers, 157-160 -> 135-136 ms.
std::vector<int64_t> shared_prefixes(const Problem& p, int64_t batch, std::vector<int>& members) {
  std::vector<int64_t> keys(batch, 0);
  if (p.table == nullptr || !p.bf16_dot || p.window_left >= 0 || batch < kMinSharedSeqs)
    return keys;
  std::vector<int> order;
  const int G = p.heads / p.kv_heads;
  for (int b = 0; b < batch; ++b) {
    const int len_q = p.cu_q[b + 1] - p.cu_q[b];
    if (len_q >= 1 && len_q <= p.block_m && len_q * G <= kSharedRows &&
        p.seq_lens_k[b] - len_q >= kMinSharedKeys)
      order.push_back(b);
  }
  auto first_block = [&](int b) { return p.table[b * p.table_stride]; };
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return first_block(a) < first_block(b); });
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j < order.size() && first_block(order[j]) == first_block(order[i])) ++j;
    if (j - i >= (size_t)kMinSharedSeqs) {
      const int32_t* lead = p.table + order[i] * p.table_stride;
      int64_t blocks = INT64_MAX;
      for (size_t k = i; k < j; ++k) {
        const int b = order[k];
        const int32_t* row = p.table + b * p.table_stride;
        const int64_t before = (p.seq_lens_k[b] - (p.cu_q[b + 1] - p.cu_q[b])) / p.block_size;
        int64_t same = 0;
        while (same < std::min(before, blocks) && row[same] == lead[same]) ++same;
        blocks = same;
      }
      if (blocks * p.block_size >= kMinSharedKeys)
        for (size_t k = i; k < j; ++k) {
          keys[order[k]] = blocks * p.block_size;
          members.push_back(order[k]);
        }
    }
    i = j;
  }
  return keys;
}

// Work items: (sequence, query tile, group of kv heads). Whole-head groups read each cached
// slot's K/V (all heads adjacent) in one pass; one head per item when items would be too few
// to keep every thread busy. Fewer than 4 items a thread even so and each item's keys are
// split into chunks, flash-decoding's way, merged by the chunk that finishes last. Fewer query
// tiles than threads (decoding a few sequences): whole-head items again, each sequence's keys
// in about threads / tiles chunks. One head an item there read each slot in as many passes as
// kv heads, and a decoding sequence's K/V come from memory: SmolLM2's attention in the
// engine 21 -> 18 us a layer.
std::vector<Item> make_items(Problem& p, int64_t batch, Splits& splits) {
  const int64_t threads = at::get_num_threads(), G = p.heads / p.kv_heads;
  int64_t tiles = 0;
  for (int b = 0; b < batch; ++b) tiles += (p.cu_q[b + 1] - p.cu_q[b] + p.block_m - 1) / p.block_m;
  const bool few_tiles = tiles < threads;
  p.kv_per_item = tiles >= 4 * threads || few_tiles ? p.kv_heads : 1;
  const int kv_groups = p.kv_heads / p.kv_per_item;
  const int64_t base = tiles * kv_groups, items_wanted = few_tiles ? threads : 4 * threads;
  const int64_t want = base > 0 && base < items_wanted ? (items_wanted + base - 1) / base : 1;
  const std::vector<int64_t> prefix = shared_prefixes(p, batch, splits.member_seq);
  std::vector<Item> items;
  int64_t parts = 0, max_rows = 0;
  auto add_group = [&](int b, int t, int kv, int chunks, int64_t rows) {
    splits.groups.push_back({b, t, kv, chunks, parts, nullptr});
    parts += chunks;
    max_rows = std::max(max_rows, rows * G);
    return (int)splits.groups.size() - 1;
  };
  // Members of shared prefixes: one query tile each, chunk 0 of its split groups from its
  // set's items, chunk 1 (the rest of its keys) its own.
  for (const int b : splits.member_seq) {
    const int len_q = p.cu_q[b + 1] - p.cu_q[b];
    const int64_t len_k = p.seq_lens_k[b];
    for (int kv = 0; kv < p.kv_heads; kv += p.kv_per_item) {
      const int group = add_group(b, 0, kv, 2, len_q);
      splits.member_group.push_back(group);
      items.push_back({b, 0, kv, len_q * (len_k - prefix[b]), prefix[b], len_k, group, 1});
    }
  }
  for (int b = 0; b < batch; ++b) {
    if (prefix[b] > 0) continue;
    const int len_q = p.cu_q[b + 1] - p.cu_q[b];
    const int64_t len_k = p.seq_lens_k[b];
    int64_t chunk = len_k, chunks = std::min<int64_t>(want, len_k / kMinChunkKeys);
    if (chunks > 1) {
      chunk = ((len_k + chunks - 1) / chunks + 15) / 16 * 16;
      chunks = (len_k + chunk - 1) / chunk;
    }
    for (int t = 0; t * p.block_m < len_q; ++t) {
      const int64_t rows = std::min(p.block_m, len_q - t * p.block_m);
      for (int kv = 0; kv < p.kv_heads; kv += p.kv_per_item) {
        if (chunks <= 1) {
          items.push_back({b, t, kv, rows * len_k});
          continue;
        }
        const int group = add_group(b, t, kv, (int)chunks, rows);
        for (int c = 0; c < chunks; ++c) {
          const int64_t lo = c * chunk, hi = std::min(len_k, lo + chunk);
          items.push_back({b, t, kv, rows * (hi - lo), lo, hi, group, c});
        }
      }
    }
  }
  // The shared sets: consecutive members of one prefix, an item per set and kv group. A
  // prefix's rows go in as many sets as kSharedRows rows a kv head need, made a multiple of
  // the threads where each set keeps 16 rows (a tile), members added to a set until it has
  // its share: 40 sequences of 3 rows in 3 sets of 48 left one thread two sets' work while
  // the other had one.
  const std::vector<int>& member = splits.member_seq;
  const int members = (int)member.size();
  auto member_rows = [&](int i) { return (p.cu_q[member[i] + 1] - p.cu_q[member[i]]) * G; };
  for (int i = 0; i < members;) {
    const int lead = member[i];
    int end = i, total = 0;
    while (end < members &&
           p.table[member[end] * p.table_stride] == p.table[lead * p.table_stride])
      total += member_rows(end++);
    int64_t sets = (total + kSharedRows - 1) / kSharedRows;
    const int64_t balanced = (sets + threads - 1) / threads * threads;
    if (total >= 16 * balanced) sets = balanced;
    const int cap = (int)((total + sets - 1) / sets);
    for (int j = i; i < end; i = j) {
      int rows = 0;
      for (; j < end && rows < cap; ++j) rows += member_rows(j);
      splits.sets.push_back({i, j - i, prefix[lead], rows});
      for (int kv = 0; kv < p.kv_heads; kv += p.kv_per_item) {
        Item item{lead, 0, kv, rows / G * prefix[lead], 0, prefix[lead]};
        item.shared = (int)splits.sets.size() - 1;
        items.push_back(item);
      }
    }
  }
  if (!splits.groups.empty()) {
    splits.pending = std::make_unique<std::atomic<int>[]>(splits.groups.size());
    for (size_t g = 0; g < splits.groups.size(); ++g) {
      splits.pending[g].store(splits.groups[g].chunks, std::memory_order_relaxed);
      splits.groups[g].pending = &splits.pending[g];
    }
    p.part_floats = p.kv_per_item * max_rows * (p.dim + 2);
    p.groups = splits.groups.data();
    p.partials = partial_records(parts * p.part_floats);
    p.shared = splits.sets.data();
    p.member_seq = splits.member_seq.data();
    p.member_group = splits.member_group.data();
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

// A path that runs where the CPU has it (Has), on by default there: set(-1) asks, set(0) /
// set(1) turn it off / on (on only where Has says so).
template <bool (*Has)()>
struct CpuPath {
  static std::atomic<bool>& flag() {
    static std::atomic<bool> on{Has()};
    return on;
  }
  static bool enabled() { return flag().load(std::memory_order_relaxed); }
  static bool set(int64_t enable) {
    if (enable >= 0) flag() = enable > 0 && Has();
    return enabled();
  }
};

// The bf16-dot path, and AMX tiles for its many-row products (where this process may use them).
bool bf16_dot_enabled() { return CpuPath<cpu_has_bf16_dot>::enabled(); }
bool bf16_dot(int64_t enable) { return CpuPath<cpu_has_bf16_dot>::set(enable); }
bool amx_enabled() { return CpuPath<cpu_has_amx>::enabled(); }
bool amx(int64_t enable) { return CpuPath<cpu_has_amx>::set(enable); }

int64_t amx_tiles() { return amx_key_tiles.load(); }

int64_t split_merges() { return merged_groups.load(); }
int64_t gemm_tiles() { return many_row_tiles.load(); }
int64_t shared_prefix_items() { return shared_items.load(); }
int64_t tile_keys() { return padded_keys.load(); }
int64_t key_tiles() { return key_tile_count.load(); }

void varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& out, const at::Tensor& cu_seqlens_q,
                      const at::Tensor& seq_lens_k, const c10::optional<at::Tensor>& cu_seqlens_k,
                      const c10::optional<at::Tensor>& block_table,
                      const c10::optional<at::Tensor>& lse, double scale, int64_t window_left,
                      int64_t window_right, int64_t block_m, int64_t block_n) {
  const bool paged = block_table.has_value();
  TORCH_CHECK(paged || cu_seqlens_k.has_value(), "need cu_seqlens_k or block_table");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k.dim() == (paged ? 4 : 3) && v.dim() == k.dim(),
              "bad q/k/v ranks");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "q, k, v and out must share a dtype");
  TORCH_CHECK(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1 && out.stride(-1) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && seq_lens_k.scalar_type() == at::kInt &&
                  cu_seqlens_q.is_contiguous() && seq_lens_k.is_contiguous(),
              "sequence lengths must be contiguous int32");
  Problem p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.heads = (int)q.size(1);
  p.dim = (int)q.size(2);
  p.kv_heads = (int)k.size(-2);
  TORCH_CHECK(p.dim % 16 == 0 && k.size(-1) == p.dim && v.size(-1) == p.dim,
              "head_dim must be a multiple of 16 and equal for q, k, v");
  TORCH_CHECK(p.heads % p.kv_heads == 0, "heads must be a multiple of kv heads");
  p.q_tok = q.stride(0);
  p.q_head = q.stride(1);
  p.o_tok = out.stride(0);
  p.o_head = out.stride(1);
  p.k_blk = paged ? k.stride(0) : 0;
  p.v_blk = paged ? v.stride(0) : 0;
  p.k_slot = k.stride(paged ? 1 : 0);
  p.v_slot = v.stride(paged ? 1 : 0);
  p.k_head = k.stride(-2);
  p.v_head = v.stride(-2);
  p.cu_q = cu_seqlens_q.data_ptr<int32_t>();
  p.seq_lens_k = seq_lens_k.data_ptr<int32_t>();
  if (paged) {
    TORCH_CHECK(block_table->scalar_type() == at::kInt && block_table->stride(1) == 1,
                "block_table must be int32 with contiguous rows");
    p.table = block_table->data_ptr<int32_t>();
    p.table_stride = block_table->stride(0);
    p.block_size = (int)k.size(1);
  } else {
    TORCH_CHECK(cu_seqlens_k->scalar_type() == at::kInt && cu_seqlens_k->is_contiguous(),
                "cu_seqlens_k must be contiguous int32");
    p.cu_k = cu_seqlens_k->data_ptr<int32_t>();
  }
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->stride(1) == 1, "lse must be fp32");
    p.lse = lse->data_ptr<float>();
    p.lse_head = lse->stride(0);
  }
  p.scale = (float)scale;
  p.window_left = (int)window_left;
  p.window_right = (int)window_right;
  p.block_n = (int)std::max<int64_t>(2, block_n);
  p.tail_keys = p.block_n / 2;
  p.block_m = (int)std::max<int64_t>(1, block_m);
  p.bf16_dot = q.scalar_type() == at::kBFloat16 && p.dim % 32 == 0 && bf16_dot_enabled();
  Splits splits;
  const std::vector<Item> items = make_items(p, seq_lens_k.size(0), splits);
  switch (q.scalar_type()) {
    case at::kFloat: return run<float>(p, items);
    case at::kBFloat16: return run<c10::BFloat16>(p, items);
    case at::kHalf: return run<c10::Half>(p, items);
    default: TORCH_CHECK(false, "dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY(pagedllm_attention, m) {
  m.def(
      "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor cu_seqlens_q, "
      "Tensor seq_lens_k, Tensor? cu_seqlens_k, Tensor? block_table, Tensor(b!)? lse, "
      "float scale, int window_left, int window_right, int block_m, int block_n) -> ()",
      &varlen_attention);
  m.def("bf16_dot(int enable) -> bool", &bf16_dot);
  m.def("amx(int enable) -> bool", &amx);
  m.def("amx_tiles() -> int", &amx_tiles);
  m.def("split_merges() -> int", &split_merges);
  m.def("gemm_tiles() -> int", &gemm_tiles);
  m.def("shared_prefix_items() -> int", &shared_prefix_items);
  m.def("tile_keys() -> int", &tile_keys);
  m.def("key_tiles() -> int", &key_tiles);
}
