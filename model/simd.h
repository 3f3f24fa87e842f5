// The small SIMD layer the native kernels (train_kernels.cc, decode_kernel.cc) are written against: one
// source, one body per ISA level, chosen by the flags the file is compiled with (model/kernels.py builds
// each level it needs with fixed -march flags and picks one at load from what the CPU reports):
//
//   level     built with                        vf (kVW floats)   exp
//   avx512    -march=x86-64-v4                  __m512 (16)       exp_v below
//   avx2      -march=x86-64-v3 (AVX2 + FMA)     __m256 (8)        exp_v below
//   neon      -march=armv8.2-a                  float32x4_t (4)   exp_v below
//   scalar    -DMSLLM_SCALAR (any -march)       none (kVW 0)      std::exp per element
//
// vf is the compiler's own vector type (GCC/Clang vector extensions): + - * / work on it directly and
// v[i] reads a lane, so the kernels' arithmetic is written once. What the operators cannot say portably
// (unaligned load/store, fused multiply-add, min/max, sqrt, widening binary16) is one intrinsic per level here, and the exp
// polynomial is written once on top of them. With MSLLM_SCALAR the kernels compile only their scalar
// loops: that body is the reference every other body is tested against (tests/test_kernels.py,
// tests/native/kernel_harness.cc, also under qemu-aarch64).

#pragma once

#include <cmath>
#include <cstdint>

#if !defined(MSLLM_SCALAR) && defined(__AVX512F__)
#include <immintrin.h>
#define MSLLM_VW 16
#define MSLLM_ISA "avx512"
#elif !defined(MSLLM_SCALAR) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MSLLM_VW 8
#define MSLLM_ISA "avx2"
#elif !defined(MSLLM_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define MSLLM_VW 4
#define MSLLM_ISA "neon"
#else
#define MSLLM_VW 0
#define MSLLM_ISA "scalar"
#endif

namespace simd {

constexpr int64_t kVW = MSLLM_VW;  // floats per vector; 0: the scalar body only

#if MSLLM_VW == 16
using vf = __m512;
inline vf loadu(const float *p) { return _mm512_loadu_ps(p); }
inline void storeu(float *p, vf v) { _mm512_storeu_ps(p, v); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf sqrt(vf a) { return _mm512_sqrt_ps(a); }
#elif MSLLM_VW == 8
using vf = __m256;
inline vf loadu(const float *p) { return _mm256_loadu_ps(p); }
inline void storeu(float *p, vf v) { _mm256_storeu_ps(p, v); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf sqrt(vf a) { return _mm256_sqrt_ps(a); }
#elif MSLLM_VW == 4
using vf = float32x4_t;
inline vf loadu(const float *p) { return vld1q_f32(p); }
inline void storeu(float *p, vf v) { vst1q_f32(p, v); }
inline vf set1(float x) { return vdupq_n_f32(x); }
inline vf fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
inline vf vmax(vf a, vf b) { return vmaxq_f32(a, b); }
inline vf vmin(vf a, vf b) { return vminq_f32(a, b); }
inline vf sqrt(vf a) { return vsqrtq_f32(a); }
#endif

// IEEE binary16 weights (GGUF's F16): kVW halves widened to floats exactly (F16C on x86-64-v3/v4, NEON's vcvt)
#if MSLLM_VW == 16
inline vf load_h(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))); }
#elif MSLLM_VW == 8
inline vf load_h(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
#elif MSLLM_VW == 4
inline vf load_h(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
#endif

// One binary16 value as a float, exactly (normals, subnormals, zeros, infinities, NaN): the scalar body's conversion
// and every body's tail (x86-64-v3 and v4 have it in one instruction, F16C's vcvtph2ps).
#if MSLLM_VW == 16 || MSLLM_VW == 8
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {  // subnormal: man * 2^-24, exact in float
    const float f = static_cast<float>(man) * 5.9604644775390625e-08f;
    uint32_t fb;
    __builtin_memcpy(&fb, &f, 4);
    bits = sign | fb;
  }
  float out;
  __builtin_memcpy(&out, &bits, 4);
  return out;
}
#endif

// A float as the nearest binary16 (ties to even; overflow to infinity, NaN kept a NaN): the scale of a Q8_0 block.
#if MSLLM_VW == 16 || MSLLM_VW == 8
inline uint16_t float_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
inline uint16_t float_to_half(float f) {
  uint32_t x;
  __builtin_memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: infinity
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half, f * 2^24 rounded to an integer (ties to even)
    float v;
    __builtin_memcpy(&v, &ax, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(v * 16777216.0f)));
  }
  // normal: rebias 127 -> 15 and round the 13 dropped mantissa bits to nearest, ties to even
  return static_cast<uint16_t>(sign | ((ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u)) >> 13));
}
#endif

#if MSLLM_VW > 0
inline vf zero() { return set1(0.0f); }

// lane sums / maxima in a fixed order (lane 0 first): the same bits at every call
inline float hsum(vf v) {
  float s = v[0];
  for (int i = 1; i < MSLLM_VW; ++i) s += v[i];
  return s;
}
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < MSLLM_VW; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// e^x, written once for every level. x is clamped to [-87.3, 88.3] (below, ~0; above, e^88.3 ~ 2.1e38):
// n = round(x / ln2) by the 1.5 * 2^23 trick (exact round-to-nearest for |x / ln2| < 2^22), Cody-Waite
// reduction r = x - n ln2 in two parts (|r| <= ln2 / 2), degree-6 Taylor polynomial by FMA (relative
// error ~1e-7, about 1 ulp), times 2^n built in the exponent field (n in [-126, 127]: a normal float).
using vi = int32_t __attribute__((vector_size(sizeof(vf))));
inline vf exp_v(vf x) {
  x = vmax(vmin(x, set1(88.3f)), set1(-87.3f));
  const vf magic = set1(12582912.0f);  // 1.5 * 2^23
  const vf n = fma(x, set1(1.44269504088896341f), magic) - magic;
  vf r = fma(n, set1(-0.693145751953125f), x);
  r = fma(n, set1(-1.428606765330187e-06f), r);
  vf p = set1(1.0f / 720);
  p = fma(p, r, set1(1.0f / 120));
  p = fma(p, r, set1(1.0f / 24));
  p = fma(p, r, set1(1.0f / 6));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.0f));
  p = fma(p, r, set1(1.0f));
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * (vf)e;
}
#endif

// The spin-wait hint every waiting thread of the kernels' pools and of model/spin_wait.cc gives the CPU between
// polls (x86 PAUSE, Arm YIELD; elsewhere a compiler barrier only): one definition for all three sources.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield" ::: "memory");
#else
  __asm__ __volatile__("" ::: "memory");
#endif
}

}  // namespace simd
