// fp32 -> bf16 on vectors, as c10::BFloat16 converts one value: rounded to nearest even at
// bit 16, a NaN made the quiet 0x7fc0 (included by the products, the fused decoder ops and
// the attention kernel's bf16 stores).
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace pagedllm_cpu {

// fp32 bits rounded to nearest even at bit 16: the bf16 is the upper half (finite v).
__attribute__((target("avx512f"))) inline __m512i bf16_rounded_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
}

// 16 floats to 16 bf16, each in the low half of its 32-bit lane.
__attribute__((target("avx512f"))) inline __m512i bf16_round_words16(__m512 v) {
  __m512i r = bf16_rounded_bits(v);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7fc00000));
  return _mm512_srli_epi32(r, 16);
}

// 16 floats to 16 bf16.
__attribute__((target("avx512f"))) inline __m256i bf16_round16(__m512 v) {
  return _mm512_cvtepi32_epi16(bf16_round_words16(v));
}

// The same on 8 lanes (AVX2): each lane's bf16 bits in its low half.
__attribute__((target("avx2"))) inline __m256i bf16_round_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

// 8 floats to 8 bf16 (AVX2).
__attribute__((target("avx2"))) inline __m128i bf16_round8(__m256 v) {
  const __m256i r = bf16_round_bits8(v);  // values below 2^16: packus keeps them
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

}  // namespace pagedllm_cpu

#endif
