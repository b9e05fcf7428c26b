// Work split shared by the C++ product libraries (included, not built alone: every library
// compiles with this folder on its include path, and its build name hashes the folder's
// headers, cpp_build.build_name).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace pagedllm_cpu {

// fn(p0, p1) over [0, n) in chunks of `chunk`, spread over the threads as they finish: each
// thread walks its own equal share of the chunks in order (its prefetches run ahead into its
// next chunk), then takes chunks from the far end of a share another thread has not finished.
// The products (panel_gemm.cpp, int8_gemm.cpp) run on it. A product ends when its slower
// thread does, and the two cores of a shared guest run at different rates from call to call:
// SmolLM2's one-row Q4_1 products with equal shares, a 2-core Xeon guest in a slow phase,
// timed per thread in a development build: the thread that finished first waited 28-31% of
// the products' time for the other (14% with this split). Alternating rounds in one process,
// equal shares / this: SmolLM2 at batch 1 0.97-1.03x (above 1 in the slow phases, below in
// the quiet ones); int4 codes at 16 rows of fp32 x 1.07-1.09x, the 125M model's int8 x int8
// products at 16 / 64 rows 1.08x / 1.05x, bf16 on AMX at 8-64 rows 0.98-1.08x.
struct alignas(64) Share {
  std::atomic<uint64_t> ends;  // (next chunk from the front) << 32 | (one past the last)
};

// Claims chunks [first, first + count) of `share`: its owner the front quarter of what is
// left (fewer lock-prefixed exchanges than one a chunk, and chunks left to give away to the
// end), another thread the back one.
inline bool claim(Share& share, bool owner, int64_t& first, int64_t& count) {
  uint64_t ends = share.ends.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t front = ends >> 32, back = ends & 0xffffffffu;
    if (front >= back) return false;
    const uint64_t take = owner ? std::max<uint64_t>(1, (back - front) / 4) : 1;
    const uint64_t next = owner ? ends + (take << 32) : ends - 1;
    if (share.ends.compare_exchange_weak(ends, next, std::memory_order_relaxed)) {
      first = int64_t(owner ? front : back - 1);
      count = int64_t(take);
      return true;
    }
  }
}

template <typename F>
inline void balanced_for(int64_t n, int64_t chunk, const F& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) fn(int64_t(0), n);
    return;
  }
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t)
    shares[t].ends.store(uint64_t(chunks * t / threads) << 32 |
                             uint64_t(chunks * (t + 1) / threads),
                         std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < threads; ++i) {
        Share& share = shares[(t + i) % threads];
        for (int64_t c, count; claim(share, i == 0, c, count);)
          fn(c * chunk, std::min(n, (c + count) * chunk));
      }
  });
}

}  // namespace pagedllm_cpu
