// fused/vec8.h: V, the 8-lane float vector every chain runs on: AVX2 + FMA + F16C, else portable C++;
// the exact decoders of 8 weights and finish(), the reduction tree.
// Part of fused.cpp's one translation unit (included there, in order, after the headers before it); gguf.cpp
// and probes.cpp include it too (after fused/contract.h) for tree8, half_to_float and V.
#pragma once

namespace {

// ---- one definition each, in every build, for every kernel of the library ----------------------------
// The fixed reduction of 8 lanes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) (vhsum's order, as scalars).
inline float tree8(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// An fp16 number as float32: exact for every value, subnormals, inf and NaN (its sign and payload) included, so
// the value F16C's conversion gives.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float f = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2**-24, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// ---- 8-lane float vectors ---------------------------------------------------------------------
#if TRTVOCAB_AVX2
struct V {
  __m256 v;
};
inline V vzero() { return {_mm256_setzero_ps()}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a.v); }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline float vhsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));  // l_j + l_{j+4}
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                     // s0 + s2, s1 + s3
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));                           // t0 + t1
}

// 8 e4m3 bytes -> q * 2**-8, exactly: sign-extended to int16 and shifted left by 7, the byte
// s eeee mmm becomes the fp16 number s 0eeee mmm0000000 (bit 14, a sign copy, masked off);
// e4m3 subnormals become fp16 subnormals, and F16C converts them to normal float32 numbers.
inline V fp8_decode8(const uint8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m128i h = _mm_cvtepi8_epi16(b);
  h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
  return {_mm256_cvtph_ps(h)};
}

// 8 bytes of packed E2M1 -> the low and the high nibbles' values (code 8 is -0.0).
inline void fp4_decode8(const uint8_t* p, V& lo, V& hi) {
  const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  // permutevar8x32 reads the low 3 bits of each index: the magnitude code.
  __m256i lo_sign = _mm256_and_si256(_mm256_slli_epi32(v, 28), sign);  // bit 3 -> bit 31
  __m256i hi_sign = _mm256_and_si256(_mm256_slli_epi32(v, 24), sign);  // bit 7 -> bit 31
  lo.v = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, v), _mm256_castsi256_ps(lo_sign));
  hi.v = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, _mm256_srli_epi32(v, 4)), _mm256_castsi256_ps(hi_sign));
}
// The vpshufb table of the decoders below: nibble (e2m1 code) -> the high byte of its value in fp16
// (every e2m1 value, -0 included, is an fp16 number with a zero low byte).
inline __m128i e2m1_fp16_high_bytes() {
  return _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, char(0x80), char(0xB8), char(0xBC),
                       char(0xBE), char(0xC0), char(0xC2), char(0xC4), char(0xC6));
}

// 32 bytes of block-major packed E2M1 (byte k of 4 consecutive 8-block groups) -> lo[j] / hi[j]:
// the low / high nibbles' values of group j. The table maps each nibble to its fp16 high byte, an
// unpack with zero makes the fp16 words, F16C widens them: exact, 64 values from one load.
inline void fp4_decode32(const uint8_t* p, V* lo, V* hi) {
  const __m256i table = _mm256_broadcastsi128_si256(e2m1_fp16_high_bytes());  // the same table in both halves
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i zero = _mm256_setzero_si256();
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i tl = _mm256_shuffle_epi8(table, _mm256_and_si256(b, mask));
  __m256i th = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(b, 4), mask));
  // unpack*_epi8 works within 128-bit halves: lo half = bytes 0-15 (groups 0, 1), hi = 16-31 (2, 3).
  __m256i l02 = _mm256_unpacklo_epi8(zero, tl), l13 = _mm256_unpackhi_epi8(zero, tl);
  __m256i h02 = _mm256_unpacklo_epi8(zero, th), h13 = _mm256_unpackhi_epi8(zero, th);
  lo[0].v = _mm256_cvtph_ps(_mm256_castsi256_si128(l02));
  lo[1].v = _mm256_cvtph_ps(_mm256_castsi256_si128(l13));
  lo[2].v = _mm256_cvtph_ps(_mm256_extracti128_si256(l02, 1));
  lo[3].v = _mm256_cvtph_ps(_mm256_extracti128_si256(l13, 1));
  hi[0].v = _mm256_cvtph_ps(_mm256_castsi256_si128(h02));
  hi[1].v = _mm256_cvtph_ps(_mm256_castsi256_si128(h13));
  hi[2].v = _mm256_cvtph_ps(_mm256_extracti128_si256(h02, 1));
  hi[3].v = _mm256_cvtph_ps(_mm256_extracti128_si256(h13, 1));
}

// 16 bytes (byte k of 2 groups) -> lo[0..1], hi[0..1]: fp4_decode32's steps on one 128-bit half.
inline void fp4_decode16(const uint8_t* p, V* lo, V* hi) {
  const __m128i table = e2m1_fp16_high_bytes();
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i zero = _mm_setzero_si128();
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i tl = _mm_shuffle_epi8(table, _mm_and_si128(b, mask));
  __m128i th = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), mask));
  lo[0].v = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, tl));
  lo[1].v = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, tl));
  hi[0].v = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, th));
  hi[1].v = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, th));
}

// 8 bf16 / fp16 values -> float32, exactly (bf16: a 16-bit shift; fp16: F16C).
inline V bf16_decode8(const uint16_t* p) {
  __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(h, 16))};
}
inline V fp16_decode8(const uint16_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline V f32_load8(const float* p) { return {_mm256_loadu_ps(p)}; }
#else
// Portable lanes: the same chains and the same reduction tree; built with -ffp-contract=off,
// so a * b + c is fused only where written (hardware fmaf), identically in both kernels.
struct V {
  float v[LANES];
};
inline float fmadd(float a, float b, float c) {
#ifdef __FP_FAST_FMAF
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
inline V vzero() {
  V r;
  for (int i = 0; i < LANES; ++i) r.v[i] = 0.0f;
  return r;
}
inline V vload(const float* p) {
  V r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void vstore(float* p, V a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline V vmul(V a, V b) {
  V r;
  for (int i = 0; i < LANES; ++i) r.v[i] = a.v[i] * b.v[i];
  return r;
}
inline V vfma(V a, V b, V c) {
  V r;
  for (int i = 0; i < LANES; ++i) r.v[i] = fmadd(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline float vhsum(V a) { return tree8(a.v); }

struct Tables {
  float fp8[256];  // q * 2**-8 (NaN codes unused: refused at load)
  float fp4[16];
  Tables() {
    for (int b = 0; b < 256; ++b) {
      int e = (b >> 3) & 0xF, m = b & 7;
      double mag = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
      fp8[b] = static_cast<float>((b & 0x80) ? -mag * (1.0 / 256) : mag * (1.0 / 256));
    }
    const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int c = 0; c < 16; ++c) fp4[c] = (c & 8) ? -mags[c & 7] : mags[c & 7];
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}
inline V fp8_decode8(const uint8_t* p) {
  const float* t = tables().fp8;
  V r;
  for (int i = 0; i < LANES; ++i) r.v[i] = t[p[i]];
  return r;
}
inline void fp4_decode8(const uint8_t* p, V& lo, V& hi) {
  const float* t = tables().fp4;
  for (int i = 0; i < LANES; ++i) {
    lo.v[i] = t[p[i] & 0xF];
    hi.v[i] = t[p[i] >> 4];
  }
}
inline void fp4_decode32(const uint8_t* p, V* lo, V* hi) {
  for (int j = 0; j < 4; ++j) fp4_decode8(p + j * LANES, lo[j], hi[j]);
}
inline void fp4_decode16(const uint8_t* p, V* lo, V* hi) {
  for (int j = 0; j < 2; ++j) fp4_decode8(p + j * LANES, lo[j], hi[j]);
}
inline V bf16_decode8(const uint16_t* p) {
  V r;
  for (int i = 0; i < LANES; ++i) {
    uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    std::memcpy(&r.v[i], &bits, 4);
  }
  return r;
}
inline V fp16_decode8(const uint16_t* p) {
  V r;
  for (int i = 0; i < LANES; ++i) r.v[i] = half_to_float(p[i]);
  return r;
}
inline V f32_load8(const float* p) {
  V r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
#endif

inline float finish(V acc, float scale, float unbias = UNBIAS) {
  // * 256 is exact; then one rounding for the scale; + 0 makes a -0 logit +0.
  return (vhsum(acc) * unbias) * scale + 0.0f;
}

}  // namespace
