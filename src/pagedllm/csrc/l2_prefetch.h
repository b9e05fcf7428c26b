// Requests for one cache line (into L2; for writing), shared by the C++ product libraries.
#pragma once

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
namespace pagedllm_cpu {

// prefetcht1 as an asm statement: GCC 12 drops _mm_prefetch / __builtin_prefetch (they have no
// result) from inline helpers like the kernels', and the kernels then ran with no software
// prefetch at all. The address goes in a register: as a memory operand ("m") the compiler
// took the asm for a read of memory that might be a tile's sums and stored all of them on
// every step of K (fp32 panels at 32-64 rows ran at half of oneDNN's rate). The panel tests
// check the built library for both.
inline void to_l2(const void* line) {
  asm volatile("prefetcht1 (%0)" : : "r"(line));
}

// prefetchw: the line requested for writing, owned by this core when the store comes (an
// asm statement for the same reasons as to_l2).
inline void to_write(const void* line) {
  asm volatile("prefetchw (%0)" : : "r"(line));
}

}  // namespace pagedllm_cpu
#endif
