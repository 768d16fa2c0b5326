// Fused dequantize-multiply CPU kernels of trtvocab's FP8 and NVFP4 LM heads.
//
// The C++ half of trtvocab/kernels/ (gemm.py documents the design and the numerics contract,
// build.py builds this file: torch.utils.cpp_extension, -O3 -march=native -fopenmp) called
// through ctypes.
// Threads: at::parallel_for (torch's own intra-op pool and OpenMP runtime).
//
// Every logit (x row n, weight row v) is one chain, computed the same way whatever the
// batch, the row range or the tile that holds it:
//   FP8    acc[8] = 0;  for step s = 0 .. S-1 (fixed order along H):  acc = fma(w_s, x_s, acc)
//   NVFP4  acc[8] = 0;  for group g:  part = 0;  for its 16 steps: part = fma(e2m1_s, x_s, part);
//                       acc = fma(part, block scales_g * 2**-8, acc)   (lane = block)
//   logit  = ((((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))) * 256) * scale + 0
// where a step is 8 weights decoded exactly to float32 (FP8: q * 2**-8, see below) and the 8
// matching inputs. Dense bf16 / fp16 / float32 rows run the FP8 chain with scale 1 and no 256 (DenseRows).
// The batch-1 kernel runs the chains of 8 (FP8, dense) or 1 (NVFP4, 4 lane groups per load)
// rows in registers; the direct kernel (batch 2..8) decodes each weight step once into registers
// for the chains of all x rows; the batched kernel (batch >= 9) decodes a tile of rows to float32
// once per K-chunk, keeps every chain's 8 lanes in memory between chunks (a float32 store is
// exact) and reuses the tile for all x rows.
// AVX-512 builds run 512-bit versions of these kernels with the same chains: a zmm holds two
// independent 8-lane chains (two weight rows, two NVFP4 lane groups, or, batch >= 9 (wide_batched),
// two x rows against one weight row's step broadcast to both halves), never one 16-lane chain. With
// AVX512-BF16 on AMD (dpbf16_pays_here), FP8 / NVFP4 at every batch and dense bf16 at batch 1..8 run two
// steps of each chain per vdpbf16ps, bitwise the two FMAs, wherever x and the weights fit (see "AVX-512
// BF16" below).

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>
#include <unistd.h>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <cpuid.h>
#include <immintrin.h>
#define TRTVOCAB_AVX2 1
#else
#define TRTVOCAB_AVX2 0
#endif
// The 512-bit kernels (batch 1..8: wide; batch >= 9: wide_batched): two independent 8-lane chains per
// zmm register (two weight rows, two NVFP4 lane groups, or two x rows), never one 16-lane chain.
#if TRTVOCAB_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define TRTVOCAB_AVX512 1
#else
#define TRTVOCAB_AVX512 0
#endif
// The vdpbf16ps kernels (FP8 / NVFP4 at every batch, where x fits): see "AVX-512 BF16" below.
#if TRTVOCAB_AVX512 && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define TRTVOCAB_DPBF16 1
#else
#define TRTVOCAB_DPBF16 0
#endif

namespace {

// std::vector storage on 64-byte lines, so that no vector load of a re-laid-out x or a decoded tile spans
// two lines (malloc's 16-byte alignment split every other zmm load of x's pairs: on Zen 5, V = 129280, H =
// 5120, FP8 B = 8 29.8 -> 20.8 ms, NVFP4 B = 3 14.2 -> 10.6, B = 4 21.1 -> 17.5, where malloc's address
// fell that way).
template <class T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
using Words = std::vector<uint32_t, LineAligned<uint32_t>>;
using Floats = std::vector<float, LineAligned<float>>;

constexpr int64_t LANES = 8;
constexpr int64_t BATCH_BLOCK = 64;   // x rows per pass over a decoded tile
constexpr float UNBIAS = 256.0f;      // decoded weights (FP8) and block scales (NVFP4) are q * 2**-8
constexpr int64_t PREFETCH_BYTES = 1024;  // how far ahead in a row the NVFP4 decoder prefetches

// A weight line the kernel reads soon (FP8 and dense rows: one stream per row): into L1, or into L2 only
// where it is read more than half an L1 of data later (`far`: fetched into L1 that early, it is evicted
// before use; measured on Zen 4, 32 KiB L1D, V = 129280, H = 5120, 2 threads, FP8 batch 1, rows read
// whole: best of 21 interleaved 20.7 -> 16.4 ms).
inline void prefetch(const void* p, bool far = false) {
#if defined(__GNUC__) || defined(__clang__)
  if (far) {
    __builtin_prefetch(p, 0, 2);
  } else {
    __builtin_prefetch(p, 0, 3);
  }
#else
  (void)p;
  (void)far;
#endif
}

// This CPU's L1D in bytes (sysconf; 32 KiB where unknown).
inline int64_t l1d_bytes() {
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL1_DCACHE_SIZE  // glibc
    const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
#else
    const long l1 = 0;
#endif
    return static_cast<int64_t>(l1 >= 16 * 1024 && l1 <= 1024 * 1024 ? l1 : 32 * 1024);
  }();
  return bytes;
}
// The bytes of x a pass keeps in L1: this CPU's L1D less 8 KiB for the weight lines in flight (48 KiB
// on Zen 5 and Intel from Ice Lake on, 32 KiB on Zen 4 and Cooper Lake).
inline int64_t x_in_l1_bytes() { return l1d_bytes() - 8 * 1024; }
// The bytes of x a K-chunk of the two-pair vdpbf16ps kernels keeps in L1: 16 KiB to spare (their passes
// read twice the weight lines, and their totals wait in memory).
inline int64_t x_chunk_in_l1_bytes() { return l1d_bytes() - 16 * 1024; }

// The NVFP4 decoders read 8 runs of 8 bytes per row and group (more streams than hardware prefetchers
// follow, a row at a time at batch 1, a tile's worth batched), so they ask ahead. The 512-bit kernels on
// an L1D under 48 KiB fetch the lines into L2 only: fetched into L1 a row or a pass ahead, they evicted
// x's chunk and each other before use (measured on Zen 4, 32 KiB L1D, V = 129280, H = 5120, 2 threads:
// batch 1 28 -> 18 ms, batch 4 43 -> 35 ms, batch 9 114 -> 102 ms). The 8-lane kernels there were 10-40 %
// slower with L2 prefetches (compute bound, they want the lines in L1), and Zen 5's 48 KiB L1D ran batch 1
// at 0.88 of the measured bandwidth with L1 prefetches: both keep them.
inline bool prefetch_to_l2() { return TRTVOCAB_AVX512 && l1d_bytes() < 48 * 1024; }
// The line at p, into L2 only where to_l2 (prefetch_to_l2, asked by the caller outside its loop: the guard of
// a function-local static is a possible call, and around one the compiler spills every live vector register,
// the block sums of a kernel that keeps them across its loads).
inline void prefetch_line(const void* p, bool to_l2) {
#if defined(__GNUC__) || defined(__clang__)
  if (to_l2) {
    __builtin_prefetch(p, 0, 2);
  } else {
    __builtin_prefetch(p, 0, 3);
  }
#else
  (void)p, (void)to_l2;
#endif
}
inline void prefetch_runs(const void* p) {
  static const bool to_l2 = prefetch_to_l2();
  prefetch_line(p, to_l2);
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
inline float vhsum(V a) {
  float s0 = a.v[0] + a.v[4], s1 = a.v[1] + a.v[5], s2 = a.v[2] + a.v[6], s3 = a.v[3] + a.v[7];
  float t0 = s0 + s2, t1 = s1 + s3;
  return t0 + t1;
}

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
inline float half_to_float(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  float mag;
  if (e == 0) {
    mag = std::ldexp(static_cast<float>(m), -24);  // zero and subnormals: exact
  } else if (e == 31) {
    mag = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    mag = std::ldexp(static_cast<float>(m | 0x400), e - 25);
  }
  return (h & 0x8000) ? -mag : mag;
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

// ---- formats: how a row's steps are decoded -----------------------------------------------------

// FP8: row = H codes; step s = codes [8s, 8s + 8) (the last step zero-padded).
// Batched kernel tiles: kTileRows weight rows are decoded together, kChunkSteps steps (of 8
// values) at a time, into a kTileRows x kChunkSteps x 8 float32 tile (16 KiB) that every x row
// reuses. FP8 rows are read 256 bytes at a time (rows H bytes apart can share L1 sets: fewer
// rows, longer runs); an NVFP4 chunk is one lane group.
struct FP8Rows {
  static constexpr bool kGroupScaled = false;
  static constexpr int64_t kTileRows = 16, kChunkSteps = 32;
  static constexpr int kGemvRows = 8;  // chains in registers at batch 1
  const uint8_t* w;
  int64_t w_stride, hidden;
  const float* scale;
  int64_t scale_stride;  // 0: one scale for every row
  int64_t steps() const { return (hidden + LANES - 1) / LANES; }
  int64_t step_multiple() const { return 1; }
  float row_scale(int64_t r) const { return scale[r * scale_stride]; }
  // The codes of row r from step s: a pointer to 8 readable bytes (tail: zero-padded copy).
  const uint8_t* step_bytes(int64_t r, int64_t s, uint8_t* tmp) const {
    const uint8_t* p = w + r * w_stride + s * LANES;
    int64_t left = hidden - s * LANES;
    if (left >= LANES) return p;
    std::memset(tmp, 0, LANES);
    std::memcpy(tmp, p, static_cast<size_t>(left));
    return tmp;
  }
  static constexpr float kUnbias = UNBIAS;
  static constexpr int64_t kDirectChunk = 64;  // steps per K-chunk of the direct (B = 2..8) kernel
  int64_t full_steps() const { return hidden / LANES; }
  int64_t chunk_units() const { return steps(); }
  V step_full(int64_t r, int64_t s) const { return fp8_decode8(w + r * w_stride + s * LANES); }
  V step_tail(int64_t r, int64_t s) const {
    uint8_t tmp[LANES];
    return fp8_decode8(step_bytes(r, s, tmp));
  }
  void prefetch_row(int64_t r, int64_t s, bool far) const { prefetch(w + r * w_stride + s * LANES, far); }
  // Decode steps [s0, s0 + n) of row r into dst (8 floats per step).
  void decode(int64_t r, int64_t s0, int64_t n, float* dst, float*) const {
    uint8_t tmp[LANES];
    for (int64_t s = 0; s < n; ++s) vstore(dst + s * LANES, fp8_decode8(step_bytes(r, s0 + s, tmp)));
  }
};

// Dense bf16 / fp16 / float32 rows: row = H values; step s = values [8s, 8s + 8), the last step
// zero-padded; decoded exactly to float32 (float32: as they are); no scale (logit = the tree's sum + 0).
enum class Dense { BF16, FP16, F32 };
template <Dense K>
struct DenseRows {
  using T = std::conditional_t<K == Dense::F32, float, uint16_t>;
  static constexpr bool kGroupScaled = false;
  static constexpr int64_t kTileRows = 16, kChunkSteps = 32;
  static constexpr int kGemvRows = 8;
  static constexpr float kUnbias = 1.0f;
  static constexpr int64_t kDirectChunk = 64;
  const T* w;
  int64_t w_stride, hidden;  // in elements
  int64_t steps() const { return (hidden + LANES - 1) / LANES; }
  int64_t step_multiple() const { return 1; }
  int64_t full_steps() const { return hidden / LANES; }
  int64_t chunk_units() const { return steps(); }
  float row_scale(int64_t) const { return 1.0f; }
  static V dec(const T* p) {
    if constexpr (K == Dense::F32) {
      return f32_load8(p);
    } else {
      return K == Dense::FP16 ? fp16_decode8(p) : bf16_decode8(p);
    }
  }
  V step_full(int64_t r, int64_t s) const { return dec(w + r * w_stride + s * LANES); }
  V step_tail(int64_t r, int64_t s) const {
    T tmp[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t left = std::min<int64_t>(LANES, hidden - s * LANES);
    std::memcpy(tmp, w + r * w_stride + s * LANES, static_cast<size_t>(left) * sizeof(T));
    return dec(tmp);
  }
  void prefetch_row(int64_t r, int64_t s, bool far) const { prefetch(w + r * w_stride + s * LANES, far); }
  void decode(int64_t r, int64_t s0, int64_t n, float* dst, float*) const {
    const int64_t full = full_steps();
    for (int64_t s = s0; s < s0 + n; ++s) vstore(dst + (s - s0) * LANES, s < full ? step_full(r, s) : step_tail(r, s));
  }
};

// NVFP4 in block-major order (trtvocab.quant.nvfp4.to_block_major): byte k of 16-block b at
// k * nb + b; its low nibble is element 16b + 2k, its high nibble element 16b + 2k + 1.
// Lanes are 8 consecutive blocks (group g = blocks 8g .. 8g + 7); a group is 16 steps, in the
// order (k = 0..7, nibble h = 0, 1), of e2m1 values. Group-scaled chains: each lane sums its
// block's 16 products from zero, then total = fma(block sum, block scale * 2**-8, total).
struct NVFP4Rows {
  static constexpr bool kGroupScaled = true;
  static constexpr int64_t kTileRows = 32, kChunkSteps = 16;
  // Rows at a time at batch 1: one, two lane groups interleaved (a row's decode needs most of
  // the 16 registers; more rows spill, measured slower on AVX2).
  static constexpr int kGemvRows = 1;
  static constexpr float kUnbias = UNBIAS;
  static constexpr int64_t kDirectChunk = 4;  // groups per K-chunk of the direct (B = 2..8) kernel
  const uint8_t* packed;
  int64_t p_stride, hidden;
  const uint8_t* bscale;
  int64_t bs_stride;
  float global_scale;
  int64_t blocks() const { return hidden / 16; }
  int64_t groups() const { return (blocks() + LANES - 1) / LANES; }
  int64_t steps() const { return groups() * 16; }
  int64_t chunk_units() const { return groups(); }
  int64_t step_multiple() const { return 16; }
  float row_scale(int64_t) const { return global_scale; }
  // Group g of row r: (bytes of k = 0 at base, k stride, 8 block-scale bytes); the partial last
  // group is copied into tmp (64 bytes) and tmp_scale (8 bytes), zero-padded.
  const uint8_t* group(int64_t r, int64_t g, int64_t& stride, const uint8_t*& scales, uint8_t* tmp,
                       uint8_t* tmp_scale) const {
    const int64_t nb = blocks();
    const uint8_t* row = packed + r * p_stride;
    const uint8_t* srow = bscale + r * bs_stride;
    int64_t left = nb - g * LANES;
    if (left >= LANES) {
      stride = nb;
      scales = srow + g * LANES;
      return row + g * LANES;
    }
    std::memset(tmp, 0, LANES * LANES);
    std::memset(tmp_scale, 0, LANES);
    for (int64_t k = 0; k < LANES; ++k) std::memcpy(tmp + k * LANES, row + k * nb + g * LANES, static_cast<size_t>(left));
    std::memcpy(tmp_scale, srow + g * LANES, static_cast<size_t>(left));
    stride = LANES;
    scales = tmp_scale;
    return tmp;
  }
  // Group g's bytes are 8 runs of 8 bytes, nb apart; each 64-byte line serves 8 groups: at the
  // first group of a line, prefetch the lines PREFETCH_BYTES / 8 groups ahead.
  void prefetch_group(int64_t r, int64_t g) const {
    if (g % 8 == 0) prefetch_lines(r, g + PREFETCH_BYTES / (8 * LANES));
  }
  // The lines holding group g of row r: its 8 runs and its block scales.
  void prefetch_lines(int64_t r, int64_t g) const {
    const uint8_t* row = packed + r * p_stride + g * LANES;
    for (int64_t k = 0; k < LANES; ++k) prefetch_runs(row + k * blocks());
    prefetch_runs(bscale + r * bs_stride + g * LANES);
  }
  // Lines [8 i, 8 i + 8) of row r's packed bytes in address order, and its scale line i (the bytes of
  // groups 8 i .. 8 i + 7 in all): fetched in the order they lie rather than run after run, the row reads
  // as one sequential stream to the hardware prefetchers (measured on a Xeon, V = 129280, H = 5120, batch
  // 1 / 2 of the lane-group kernel: 19.0 -> 18.5 ms, 23.5 -> 22.1 ms; the row-pair kernels, whose passes
  // interleave 2 P rows, ran 10-20 % slower with it and keep prefetch_lines).
  void prefetch_in_order(int64_t r, int64_t i) const {
    const uint8_t* p = packed + r * p_stride + i * LANES * 64;
    for (int64_t m = 0; m < LANES; ++m) prefetch_runs(p + m * 64);
    prefetch_runs(bscale + r * bs_stride + i * 64);
  }
  // Decode steps [s0, s0 + 16) (group s0 / 16) of row r into dst, its 8 block scales into bs.
  void decode(int64_t r, int64_t s0, int64_t n, float* dst, float* bs) const {
    uint8_t tmp[LANES * LANES], tmp_scale[LANES];
    const int64_t g = s0 / 16;
    (void)n;  // always 16: kChunkSteps
    prefetch_group(r, g);
    int64_t stride;
    const uint8_t* scales;
    const uint8_t* base = group(r, g, stride, scales, tmp, tmp_scale);
    vstore(bs, fp8_decode8(scales));
    for (int64_t k = 0; k < LANES; ++k) {
      V lo, hi;
      fp4_decode8(base + k * stride, lo, hi);
      vstore(dst + (2 * k) * LANES, lo);
      vstore(dst + (2 * k + 1) * LANES, hi);
    }
  }
};

// ---- batch 1: one streaming pass, kGemvRows chains in registers ----------------------------------
template <int R, class F>
void gemv_rows(const F& f, const float* x, int64_t r0, float* out) {
  V acc[R];
  for (int i = 0; i < R; ++i) acc[i] = vzero();
  const int64_t full = f.full_steps(), steps = f.steps();
  for (int64_t s = 0; s < full; ++s) {
    V xv = vload(x + s * LANES);
    for (int i = 0; i < R; ++i) acc[i] = vfma(f.step_full(r0 + i, s), xv, acc[i]);
  }
  for (int64_t s = full; s < steps; ++s) {
    V xv = vload(x + s * LANES);
    for (int i = 0; i < R; ++i) acc[i] = vfma(f.step_tail(r0 + i, s), xv, acc[i]);
  }
  for (int i = 0; i < R; ++i) out[r0 + i] = finish(acc[i], f.row_scale(r0 + i), F::kUnbias);
}

// GI groups of row r from g0, their chains interleaved (independent partial sums: more work in
// flight), added to acc in group order: the same chain as one group at a time.
template <int GI>
inline V nvfp4_groups(const NVFP4Rows& f, const float* x, int64_t r, int64_t g0, V acc) {
  uint8_t tmp[GI][LANES * LANES], tmp_scale[GI][LANES];
  const uint8_t* base[GI];
  const uint8_t* scales[GI];
  int64_t stride[GI];
  V part[GI];
  for (int j = 0; j < GI; ++j) {
    f.prefetch_group(r, g0 + j);
    base[j] = f.group(r, g0 + j, stride[j], scales[j], tmp[j], tmp_scale[j]);
    part[j] = vzero();
  }
  for (int64_t k = 0; k < LANES; ++k) {
    for (int j = 0; j < GI; ++j) {
      const float* xg = x + (g0 + j) * 16 * LANES;
      V lo, hi;
      fp4_decode8(base[j] + k * stride[j], lo, hi);
      part[j] = vfma(lo, vload(xg + (2 * k) * LANES), part[j]);
      part[j] = vfma(hi, vload(xg + (2 * k + 1) * LANES), part[j]);
    }
  }
  for (int j = 0; j < GI; ++j) acc = vfma(part[j], fp8_decode8(scales[j]), acc);
  return acc;
}

// NVFP4 at batch 1: four full groups at a time (one 32-byte load per k decodes 64 values), their
// four chains interleaved; then pairs, then single (or partial) groups. Every group's chain and
// the group order of acc are those of nvfp4_groups<1>.
template <int GI>
inline void fp4_decode_groups(const uint8_t* p, V* lo, V* hi) {
  if constexpr (GI == 4) {
    fp4_decode32(p, lo, hi);
  } else if constexpr (GI == 2) {
    fp4_decode16(p, lo, hi);
  } else {
    fp4_decode8(p, lo[0], hi[0]);
  }
}

// Row r for N x rows (x_n = x + n * xs): GI full groups at a time (one load per k decodes them
// all), the GI * N chains in registers; the remaining groups as nvfp4_groups. Every logit's chain
// is nvfp4_groups<1>'s, group after group.
template <int N, int GI = 4>
inline void gemv_rows_nvfp4(const NVFP4Rows& f, const float* x, int64_t xs, int64_t r, float* out, int64_t os) {
  const int64_t nb = f.blocks();
  const uint8_t* row = f.packed + r * f.p_stride;
  const uint8_t* srow = f.bscale + r * f.bs_stride;
  V acc[N];
  for (int n = 0; n < N; ++n) acc[n] = vzero();
  int64_t g = 0;
  for (; (g + GI) * LANES <= nb; g += GI) {
    const uint8_t* p = row + g * LANES;
    if ((g & 7) == 0 || GI == 1) {  // a 64-byte line of each run serves 8 groups
      for (int64_t k = 0; k < LANES; ++k) prefetch_runs(p + k * nb + PREFETCH_BYTES / 4);
      prefetch_runs(srow + g * LANES + PREFETCH_BYTES / 4);
    }
    const float* xg = x + g * 16 * LANES;
    V part[GI][N];
    for (int j = 0; j < GI; ++j)
      for (int n = 0; n < N; ++n) part[j][n] = vzero();
    for (int64_t k = 0; k < LANES; ++k) {
      V lo[GI], hi[GI];
      fp4_decode_groups<GI>(p + k * nb, lo, hi);
      for (int j = 0; j < GI; ++j) {
        for (int n = 0; n < N; ++n)
          part[j][n] = vfma(lo[j], vload(xg + n * xs + j * 16 * LANES + (2 * k) * LANES), part[j][n]);
        for (int n = 0; n < N; ++n)
          part[j][n] = vfma(hi[j], vload(xg + n * xs + j * 16 * LANES + (2 * k + 1) * LANES), part[j][n]);
      }
    }
    for (int j = 0; j < GI; ++j) {
      V bs = fp8_decode8(srow + (g + j) * LANES);
      for (int n = 0; n < N; ++n) acc[n] = vfma(part[j][n], bs, acc[n]);
    }
  }
  for (int n = 0; n < N; ++n) {
    V a = acc[n];
    int64_t h = g;
    for (; (h + 2) * LANES <= nb; h += 2) a = nvfp4_groups<2>(f, x + n * xs, r, h, a);
    for (; h < f.groups(); ++h) a = nvfp4_groups<1>(f, x + n * xs, r, h, a);
    out[n * os + r] = finish(a, f.row_scale(r), NVFP4Rows::kUnbias);
  }
}

template <class F>
void gemv(const F& f, const float* x, int64_t rows, float* out) {
  constexpr int GEMV_ROWS = F::kGemvRows;
  const int64_t groups = (rows + GEMV_ROWS - 1) / GEMV_ROWS;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      int64_t r0 = g * GEMV_ROWS;
      if constexpr (F::kGroupScaled) {
        for (int64_t r = r0; r < std::min(rows, r0 + GEMV_ROWS); ++r) gemv_rows_nvfp4<1>(f, x, 0, r, out, 0);
      } else if (r0 + GEMV_ROWS <= rows) {
        gemv_rows<GEMV_ROWS>(f, x, r0, out);
      } else {
        for (int64_t r = r0; r < rows; ++r) gemv_rows<1>(f, x, r, out);
      }
    }
  });
}

// ---- batch 2..8: one pass over the weight, every x row's chains in registers ----------------------
// A weight step is decoded once into registers and multiplied into the chains of all N x rows
// (R weight rows at a time, R * N <= 8 accumulators). The x rows are read a K-chunk at a time
// (kDirectChunk steps / groups, so that N chunks stay in L1) for a tile of DIRECT_TILE weight
// rows, whose chains wait in memory between chunks (a float32 store is exact). Each logit's chain
// is the batch-1 chain.
constexpr int64_t DIRECT_TILE = 32;
#ifndef NVFP4_REG_MAX
#define NVFP4_REG_MAX 8
#endif

template <int N, int R, class F>
inline void direct_steps(const F& f, const float* x, int64_t xs, int64_t r0, int64_t s0, int64_t s1, float* acc) {
  // acc: [R][N][8]
  V a[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) a[r][n] = vload(acc + (r * N + n) * LANES);
  const int64_t full = std::min(s1, f.full_steps());
  int64_t s = s0;
  for (; s < full; ++s) {
    V w[R];
    for (int r = 0; r < R; ++r) w[r] = f.step_full(r0 + r, s);
    for (int n = 0; n < N; ++n) {
      V xv = vload(x + n * xs + s * LANES);
      for (int r = 0; r < R; ++r) a[r][n] = vfma(w[r], xv, a[r][n]);
    }
  }
  for (; s < s1; ++s) {
    V w[R];
    for (int r = 0; r < R; ++r) w[r] = f.step_tail(r0 + r, s);
    for (int n = 0; n < N; ++n) {
      V xv = vload(x + n * xs + s * LANES);
      for (int r = 0; r < R; ++r) a[r][n] = vfma(w[r], xv, a[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) vstore(acc + (r * N + n) * LANES, a[r][n]);
}

// NVFP4: groups [g0, g1) (at most kDirectChunk) of row r for N x rows. The row's groups are
// decoded once into an L1 buffer (four at a time with fp4_decode32), then each group's block
// sums run from zero in registers for all N x rows and are added as acc = fma(sum, block scales,
// acc) in memory: the batch-1 chain of every logit.
template <int N>
inline void direct_groups(const NVFP4Rows& f, const float* x, int64_t xs, int64_t r, int64_t g0, int64_t g1,
                          float* acc) {
  alignas(32) float w[NVFP4Rows::kDirectChunk * 16 * LANES];
  alignas(32) float bs[NVFP4Rows::kDirectChunk * LANES];
  const int64_t nb = f.blocks();
  const uint8_t* row = f.packed + r * f.p_stride;
  f.prefetch_group(r, g0);
  int64_t g = g0;
  for (; g + 4 <= g1 && (g + 4) * LANES <= nb; g += 4) {
    float* dst = w + (g - g0) * 16 * LANES;
    for (int64_t k = 0; k < LANES; ++k) {
      V lo[4], hi[4];
      fp4_decode32(row + k * nb + g * LANES, lo, hi);
      for (int j = 0; j < 4; ++j) {
        vstore(dst + (j * 16 + 2 * k) * LANES, lo[j]);
        vstore(dst + (j * 16 + 2 * k + 1) * LANES, hi[j]);
      }
    }
    for (int j = 0; j < 4; ++j) vstore(bs + (g - g0 + j) * LANES, fp8_decode8(f.bscale + r * f.bs_stride + (g + j) * LANES));
  }
  for (; g < g1; ++g) f.decode(r, g * 16, 16, w + (g - g0) * 16 * LANES, bs + (g - g0) * LANES);
  for (g = g0; g < g1; ++g) {
    const float* wg = w + (g - g0) * 16 * LANES;
    const float* xg = x + g * 16 * LANES;
    V part[N];
    for (int n = 0; n < N; ++n) part[n] = vzero();
    for (int64_t s = 0; s < 16; ++s) {
      V wv = vload(wg + s * LANES);
      for (int n = 0; n < N; ++n) part[n] = vfma(wv, vload(xg + n * xs + s * LANES), part[n]);
    }
    V b = vload(bs + (g - g0) * LANES);
    for (int n = 0; n < N; ++n) vstore(acc + n * LANES, vfma(part[n], b, vload(acc + n * LANES)));
  }
}

template <int N, int R, class F>
inline void direct_chunk(const F& f, const float* x, int64_t xs, int64_t r0, int64_t c0, int64_t c1, float* acc) {
  if constexpr (F::kGroupScaled) {
    for (int r = 0; r < R; ++r) direct_groups<N>(f, x, xs, r0 + r, c0, c1, acc + r * N * LANES);
  } else {
    direct_steps<N, R>(f, x, xs, r0, c0, c1, acc);
  }
}

template <int N, class F>
void direct(const F& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  if constexpr (F::kGroupScaled && N <= NVFP4_REG_MAX) {  // NVFP4: the batch-1 loop, all rows' chains in registers
    constexpr int GI = N <= 2 ? 4 : (N == 3 ? 2 : 1);
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) gemv_rows_nvfp4<N, GI>(f, x, xs, r, out, os);
    });
    return;
  }
  constexpr int R = N <= 2 ? 4 : (N <= 4 ? 2 : 1);
  const int64_t chunks = f.chunk_units();  // K-chunk units: steps (groups for NVFP4)
  constexpr int64_t KC = F::kDirectChunk;
  const int64_t tiles = (rows + DIRECT_TILE - 1) / DIRECT_TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[DIRECT_TILE * N * LANES];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t v0 = t * DIRECT_TILE, tr = std::min(DIRECT_TILE, rows - v0);
      std::fill(acc, acc + tr * N * LANES, 0.0f);
      for (int64_t c0 = 0; c0 < chunks; c0 += KC) {
        const int64_t c1 = std::min(chunks, c0 + KC);
        int64_t v = 0;
        for (; v + R <= tr; v += R) direct_chunk<N, R>(f, x, xs, v0 + v, c0, c1, acc + v * N * LANES);
        for (; v < tr; ++v) direct_chunk<N, 1>(f, x, xs, v0 + v, c0, c1, acc + v * N * LANES);
      }
      for (int64_t v = 0; v < tr; ++v) {
        const float scale = f.row_scale(v0 + v);
        for (int n = 0; n < N; ++n) out[n * os + v0 + v] = finish(vload(acc + (v * N + n) * LANES), scale, F::kUnbias);
      }
    }
  });
}

// ---- batched: decode a tile once per K-chunk, reuse it for every x row ----------------------------
// acc: the chains' lanes, [NV rows][..][8] with strides acc_v (per weight row) and acc_n (per x row).
// GS (group-scaled, NVFP4): the chunk is one group; its sums start from zero and are added to
// acc as fma(sum, bs[v], acc), bs: 8 block scales per weight row.
template <int NN, int NV, bool GS>
inline void micro(const float* x, int64_t xs, const float* w, int64_t ws, int64_t steps, float* acc, int64_t acc_v,
                  int64_t acc_n, const float* bs) {
  V a[NN][NV];
  for (int n = 0; n < NN; ++n)
    for (int v = 0; v < NV; ++v) a[n][v] = GS ? vzero() : vload(acc + v * acc_v + n * acc_n);
  for (int64_t s = 0; s < steps; ++s) {
    V xv[NN];
    for (int n = 0; n < NN; ++n) xv[n] = vload(x + n * xs + s * LANES);
    for (int v = 0; v < NV; ++v) {
      V wv = vload(w + v * ws + s * LANES);
      for (int n = 0; n < NN; ++n) a[n][v] = vfma(wv, xv[n], a[n][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    for (int n = 0; n < NN; ++n) {
      float* p = acc + v * acc_v + n * acc_n;
      vstore(p, GS ? vfma(a[n][v], vload(bs + v * LANES), vload(p)) : a[n][v]);
    }
  }
}

template <int NV, bool GS>
inline void micro_n(int64_t nn, const float* x, int64_t xs, const float* w, int64_t ws, int64_t steps, float* acc,
                    int64_t acc_v, int64_t acc_n, const float* bs) {
  switch (nn) {
    case 4: micro<4, NV, GS>(x, xs, w, ws, steps, acc, acc_v, acc_n, bs); break;
    case 3: micro<3, NV, GS>(x, xs, w, ws, steps, acc, acc_v, acc_n, bs); break;
    case 2: micro<2, NV, GS>(x, xs, w, ws, steps, acc, acc_v, acc_n, bs); break;
    default: micro<1, NV, GS>(x, xs, w, ws, steps, acc, acc_v, acc_n, bs); break;
  }
}

template <class F>
void batched(const F& f, const float* x, int64_t n_rows, int64_t x_stride, int64_t rows, float* out,
             int64_t out_stride) {
  constexpr int64_t TILE_ROWS = F::kTileRows, CHUNK_STEPS = F::kChunkSteps;
  static_assert(!F::kGroupScaled || CHUNK_STEPS == 16, "an NVFP4 chunk is one lane group");
  const int64_t steps = f.steps();
  const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const int64_t nblock = std::min(n_rows, BATCH_BLOCK);
    Floats wt(static_cast<size_t>(TILE_ROWS * CHUNK_STEPS * LANES));
    Floats acc(static_cast<size_t>(TILE_ROWS * nblock * LANES));
    Floats bs(static_cast<size_t>(TILE_ROWS * LANES));  // a group's block scales (NVFP4)
    constexpr bool GS = F::kGroupScaled;
    const int64_t ws = CHUNK_STEPS * LANES, acc_v = nblock * LANES;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t v0 = t * TILE_ROWS, tr = std::min(TILE_ROWS, rows - v0);
      for (int64_t b0 = 0; b0 < n_rows; b0 += nblock) {
        const int64_t nb = std::min(nblock, n_rows - b0);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t s0 = 0; s0 < steps; s0 += CHUNK_STEPS) {
          const int64_t ks = std::min(CHUNK_STEPS, steps - s0);
          for (int64_t v = 0; v < tr; ++v) f.decode(v0 + v, s0, ks, wt.data() + v * ws, bs.data() + v * LANES);
          for (int64_t n0 = 0; n0 < nb; n0 += 4) {
            const int64_t nn = std::min<int64_t>(4, nb - n0);
            const float* xp = x + (b0 + n0) * x_stride + s0 * LANES;
            for (int64_t v = 0; v < tr; v += 2) {
              float* ap = acc.data() + v * acc_v + n0 * LANES;
              const float* bp = bs.data() + v * LANES;
              if (v + 2 <= tr) {
                micro_n<2, GS>(nn, xp, x_stride, wt.data() + v * ws, ws, ks, ap, acc_v, LANES, bp);
              } else {
                micro_n<1, GS>(nn, xp, x_stride, wt.data() + v * ws, ws, ks, ap, acc_v, LANES, bp);
              }
            }
          }
        }
        for (int64_t v = 0; v < tr; ++v) {
          const float scale = f.row_scale(v0 + v);
          for (int64_t n = 0; n < nb; ++n)
            out[(b0 + n) * out_stride + v0 + v] =
                finish(vload(acc.data() + v * acc_v + n * LANES), scale, F::kUnbias);
        }
      }
    }
  });
}

// ---- AVX-512, batch 1..8: two independent 8-lane chains per zmm register ----------------------------
// The chains are those above (the same steps, the same FMAs, the same tree), so a logit is bitwise the
// one of the 8-lane kernels: a zmm holds the 8-lane chains of two weight rows (FP8, dense: rows r, r + 1
// at the same step) or of two lane groups of one row (NVFP4: groups 2q, 2q + 1, each summed from zero
// and added to the row's 8-lane total in group order). Only the width of the instructions changes.
#if TRTVOCAB_AVX512
inline __m512 lo_hi(V a, V b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a.v), b.v, 1); }
inline V half0(__m512 a) { return {_mm512_castps512_ps256(a)}; }
inline V half1(__m512 a) { return {_mm512_extractf32x8_ps(a, 1)}; }

// 16 e4m3 bytes (8 of row a, then 8 of row b) -> q * 2**-8, exactly (fp8_decode8 on both halves).
inline __m512 fp8_decode16(__m128i b) {
  __m256i h = _mm256_cvtepi8_epi16(b);
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  return _mm512_cvtph_ps(h);
}
inline __m128i two_steps(const uint8_t* a, const uint8_t* b) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
}
// Block scales of group g of rows a (lanes 0-7) and b (8-15), decoded exactly.
inline __m512 pair_block_scales(const NVFP4Rows& f, int64_t a, int64_t b, int64_t g) {
  return fp8_decode16(two_steps(f.bscale + a * f.bs_stride + g * LANES, f.bscale + b * f.bs_stride + g * LANES));
}
// The P x N zmm chains of a pass, kept in memory ([P][N][16] floats, a float32 store is exact) between passes.
template <int P, int N>
inline void load_chains(const float* mem, __m512 (&a)[P][N]) {
  for (int p = 0; p < P; ++p)
    for (int n = 0; n < N; ++n) a[p][n] = _mm512_loadu_ps(mem + (p * N + n) * 16);
}
template <int P, int N>
inline void store_chains(const __m512 (&a)[P][N], float* mem) {
  for (int p = 0; p < P; ++p)
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(mem + (p * N + n) * 16, a[p][n]);
}
inline __m256i two_halves(const uint16_t* a, const uint16_t* b) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}
// Step s of rows a (lanes 0-7) and b (lanes 8-15), decoded exactly.
inline __m512 pair_full(const FP8Rows& f, int64_t a, int64_t b, int64_t s) {
  return fp8_decode16(two_steps(f.w + a * f.w_stride + s * LANES, f.w + b * f.w_stride + s * LANES));
}
// Steps s and s + 1 of rows a and b (16 bytes of each) -> w0 = step s, w1 = step s + 1 (rows a | b).
// Unpacking a byte above a zero byte and shifting right by one (arithmetic) is fp8_decode8's
// sign-extend-and-shift-by-7, on 32 bytes at once.
inline void pair_full2(const FP8Rows& f, int64_t a, int64_t b, int64_t s, __m512& w0, __m512& w1) {
  const __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.w + a * f.w_stride + s * LANES))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(f.w + b * f.w_stride + s * LANES)), 1);
  const __m256i zero = _mm256_setzero_si256(), mask = _mm256_set1_epi16(static_cast<short>(0xBF80));
  w0 = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(zero, v), 1), mask));
  w1 = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(zero, v), 1), mask));
}
template <Dense K>
inline __m512 pair_full(const DenseRows<K>& f, int64_t a, int64_t b, int64_t s) {
  if constexpr (K == Dense::F32) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(f.w + a * f.w_stride + s * LANES)),
                              _mm256_loadu_ps(f.w + b * f.w_stride + s * LANES), 1);
  } else {
    __m256i h = two_halves(f.w + a * f.w_stride + s * LANES, f.w + b * f.w_stride + s * LANES);
    if constexpr (K == Dense::FP16) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

// Steps [s0, s1) of P row pairs (rows pr[2p], pr[2p + 1]) for N x rows; x: [steps][N][8] (the N
// rows of a step side by side); acc: [P][N][16] floats.
constexpr int64_t WIDE_TILE = 32;  // weight rows per tile of the AVX-512 pair kernels

// x [N, xs] re-laid out as [steps][N][8]: the N batch rows of a step side by side, so a pair kernel
// reads one step of every row with one cache line walk.
template <int N>
inline Floats rows_side_by_side(const float* x, int64_t xs, int64_t steps) {
  Floats xt(static_cast<size_t>(std::max<int64_t>(1, steps * N * LANES)));
  for (int64_t s = 0; s < steps; ++s)
    for (int n = 0; n < N; ++n)
      std::memcpy(xt.data() + (s * N + n) * LANES, x + n * xs + s * LANES, LANES * sizeof(float));
  return xt;
}

// A tile's weight rows for the pair kernels: rows v0 .. v0 + tr - 1 in pairs (an odd last row paired
// with itself), then the rows the last pass prefetches (clamped to the shard). pr holds WIDE_TILE + 4P.
template <int P>
inline void tile_row_pairs(int64_t* pr, int64_t v0, int64_t tr, int64_t rows) {
  const int64_t pairs = (tr + 1) / 2;
  for (int64_t i = 0; i < WIDE_TILE + 4 * P; ++i) pr[i] = std::min(v0 + i, rows - 1);
  for (int64_t i = tr; i < 2 * pairs; ++i) pr[i] = v0 + tr - 1;
}

// The tile loop of the AVX-512 pair kernels: tiles of WIDE_TILE weight rows on torch's threads; per
// tile, passes over [c0, c1) chunks (of `chunk`) of [0, extent), each pass calling pass(P-constant,
// row pairs, c0, c1, acc) for P pairs at a time (then single pairs), and finish(row, n, chain) per
// logit with its 8-lane chain from the pair's zmm accumulator.
template <int N, int P, class Pass, class Finish>
inline void pair_tiles(int64_t rows, int64_t extent, int64_t chunk, const Pass& pass, const Finish& finish) {
  const int64_t tiles = (rows + WIDE_TILE - 1) / WIDE_TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[WIDE_TILE / 2 * N * 16];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t v0 = t * WIDE_TILE, tr = std::min(WIDE_TILE, rows - v0);
      const int64_t pairs = (tr + 1) / 2;
      int64_t pr[WIDE_TILE + 4 * P];
      tile_row_pairs<P>(pr, v0, tr, rows);
      std::fill(acc, acc + pairs * N * 16, 0.0f);
      for (int64_t c0 = 0; c0 < extent; c0 += chunk) {
        const int64_t c1 = std::min(extent, c0 + chunk);
        int64_t q = 0;
        for (; q + P <= pairs; q += P) pass(std::integral_constant<int, P>{}, pr + 2 * q, c0, c1, acc + q * N * 16);
        for (; q < pairs; ++q) pass(std::integral_constant<int, 1>{}, pr + 2 * q, c0, c1, acc + q * N * 16);
      }
      for (int64_t i = 0; i < tr; ++i)
        for (int n = 0; n < N; ++n) {
          const __m512 a = _mm512_loadu_ps(acc + ((i / 2) * N + n) * 16);
          finish(v0 + i, n, i % 2 ? half1(a) : half0(a));
        }
    }
  });
}

template <int N, int P, class F>
inline void wide_steps(const F& f, const float* x, const int64_t* pr, int64_t s0, int64_t s1,
                       float* acc) {
  __m512 a[P][N];
  load_chains(acc, a);
  const int64_t full = std::min(s1, f.full_steps());
  // The next pass's lines, fetched a pass ahead: into L2 where a pass reads more than half an L1.
  const bool far = 2 * P * (s1 - s0) * LANES * static_cast<int64_t>(sizeof(*f.w)) > l1d_bytes() / 2;
  int64_t s = s0;
  if constexpr (std::is_same_v<F, FP8Rows>) {  // two steps per 16-byte load of each row
    for (; s + 1 < full; s += 2) {
      if ((s & 7) == 0)  // a new 64-byte line of each row: fetch it for the next P pairs (pr has 4 P rows)
        for (int i = 0; i < 2 * P; ++i) f.prefetch_row(pr[2 * P + i], s, far);
      __m512 w0[P], w1[P];
      for (int p = 0; p < P; ++p) pair_full2(f, pr[2 * p], pr[2 * p + 1], s, w0[p], w1[p]);
      for (int n = 0; n < N; ++n) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (s * N + n) * LANES));
        for (int p = 0; p < P; ++p) a[p][n] = _mm512_fmadd_ps(w0[p], xv, a[p][n]);
      }
      for (int n = 0; n < N; ++n) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + ((s + 1) * N + n) * LANES));
        for (int p = 0; p < P; ++p) a[p][n] = _mm512_fmadd_ps(w1[p], xv, a[p][n]);
      }
    }
  }
  for (; s < full; ++s) {
    if ((s * static_cast<int64_t>(sizeof(*f.w)) & 7) == 0)
      for (int i = 0; i < 2 * P; ++i) f.prefetch_row(pr[2 * P + i], s, far);
    __m512 w[P];
    for (int p = 0; p < P; ++p) w[p] = pair_full(f, pr[2 * p], pr[2 * p + 1], s);
    for (int n = 0; n < N; ++n) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (s * N + n) * LANES));
      for (int p = 0; p < P; ++p) a[p][n] = _mm512_fmadd_ps(w[p], xv, a[p][n]);
    }
  }
  for (; s < s1; ++s) {
    __m512 w[P];
    for (int p = 0; p < P; ++p) w[p] = lo_hi(f.step_tail(pr[2 * p], s), f.step_tail(pr[2 * p + 1], s));
    for (int n = 0; n < N; ++n) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (s * N + n) * LANES));
      for (int p = 0; p < P; ++p) a[p][n] = _mm512_fmadd_ps(w[p], xv, a[p][n]);
    }
  }
  store_chains(a, acc);
}

// FP8 / dense, batch N = 1..8: tiles of WIDE_TILE rows; each K-chunk of kDirectChunk steps is read
// for all the tile's rows (x's chunk stays in L1; at batch <= WHOLE_ROWS_MAX the chunk is the whole
// row: measured faster), P row pairs at a time, the next pass's rows prefetched; an odd last row is
// paired with itself (computed twice, written once).
constexpr int WHOLE_ROWS_MAX = 2;
// NVFP4 batches up to this run in lane-group pairs (wide_nvfp4), larger ones in row pairs: measured.
constexpr int NVGP_MAX = 2;
template <int N, class F>
void wide_direct(const F& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  // Row pairs per pass: P * N zmm chains and 2 P decoded steps in the 32 registers.
  constexpr int P = N == 1 ? 8 : (N == 2 ? 5 : (N == 3 ? 5 : (N == 4 ? 4 : (N <= 6 ? 3 : 2))));
  const int64_t steps = f.steps();
  const int64_t KC = N <= WHOLE_ROWS_MAX ? steps : F::kDirectChunk;
  const Floats xt = rows_side_by_side<N>(x, xs, steps);
  pair_tiles<N, P>(
      rows, steps, KC,
      [&](auto p, const int64_t* prp, int64_t c0, int64_t c1, float* acc) {
        wide_steps<N, decltype(p)::value>(f, xt.data(), prp, c0, c1, acc);
      },
      [&](int64_t v, int n, V chain) { out[n * os + v] = finish(chain, f.row_scale(v), F::kUnbias); });
}

// NVFP4, batch N = 1..8. x is re-laid out once per call into xw [pairs][16 steps][N][16]: step s of
// groups 2q (lanes 0-7) and 2q + 1 (8-15) of x row n (the N rows of a step side by side: one base
// pointer, no L1 set conflicts between x rows H floats apart). Pair q of a row is 8 runs of 16 bytes (byte k of blocks
// 16q .. 16q + 15); a vpermps over the 16 e2m1 values (sign included) decodes 16 nibbles at a time.
// Each group's block sums run from zero, then acc = fma(sum, block scales, acc) per group, in group
// order, on the row's 8-lane total: nvfp4_groups<1>'s chain. The groups past the last full pair run
// in the 8-lane code. Pairs [q0, q1) of row r, G pairs at a time; acc: the row's N totals ([N][8]).
// `ahead`: the row whose lines to prefetch at the same offsets (the row after the next, at batch 1).
template <int N, int G>
inline void wide_nvfp4_pairs(const NVFP4Rows& f, const float* xw, int64_t r, int64_t q0, int64_t q1,
                             float* acc_mem, int64_t ahead) {
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                      -2.0f, -3.0f, -4.0f, -6.0f);
  const int64_t nb = f.blocks();
  const uint8_t* row = f.packed + r * f.p_stride;
  const uint8_t* srow = f.bscale + r * f.bs_stride;
  V acc[N];
  for (int n = 0; n < N; ++n) acc[n] = vload(acc_mem + n * LANES);
  for (int64_t q = q0; q < q1; q += G) {
    const uint8_t* p = row + q * 16;
    if ((q & 3) == 0 || G > 1) f.prefetch_in_order(ahead, q / 4);  // 4 pairs (G = 4 at batch 1-2)
    __m512 part[G][N];
    for (int j = 0; j < G; ++j)
      for (int n = 0; n < N; ++n) part[j][n] = _mm512_setzero_ps();
    for (int64_t k = 0; k < LANES; ++k) {
      for (int j = 0; j < G; ++j) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k * nb + j * 16));
        const __m512i v = _mm512_cvtepu8_epi32(b);
        const __m512 lo = _mm512_permutexvar_ps(v, table);  // vpermps reads the low 4 bits: the low nibble
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        const float* xq = xw + ((q + j) * 16 + 2 * k) * N * 16;
        for (int n = 0; n < N; ++n) part[j][n] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xq + n * 16), part[j][n]);
        for (int n = 0; n < N; ++n) part[j][n] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xq + (N + n) * 16), part[j][n]);
      }
    }
    for (int j = 0; j < G; ++j) {
      const __m512 bs = fp8_decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + (q + j) * 16)));
      for (int n = 0; n < N; ++n) {
        acc[n] = vfma(half0(part[j][n]), half0(bs), acc[n]);
        acc[n] = vfma(half1(part[j][n]), half1(bs), acc[n]);
      }
    }
  }
  for (int n = 0; n < N; ++n) vstore(acc_mem + n * LANES, acc[n]);
}

// Batch 1..NVGP_MAX (larger batches run nvfp4_row_pairs, which reads half the x per FMA): a row runs
// whole, four pairs interleaved, the row after the next prefetched. Written for any N: tiles of
// WIDE_TILE rows, each K-chunk of pairs (N chunks of xw in L1, at most 16 KiB) read for all the
// tile's rows, whose totals wait in memory between chunks (a float32 store is exact).
template <int N>
void wide_nvfp4(const NVFP4Rows& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  const int64_t pairs = f.blocks() / 16;
  Floats xw(static_cast<size_t>(std::max<int64_t>(1, pairs * 16 * N * 16)));
  for (int64_t q = 0; q < pairs; ++q)
    for (int64_t s = 0; s < 16; ++s)
      for (int n = 0; n < N; ++n)
        for (int h = 0; h < 2; ++h)
          std::memcpy(xw.data() + ((q * 16 + s) * N + n) * 16 + h * LANES,
                      x + n * xs + ((2 * q + h) * 16 + s) * LANES, LANES * sizeof(float));
  // G pairs in flight: G * N >= 8 independent chains (two FMA pipes of latency 4); CP pairs per K-chunk
  // (a K-chunk of N chunks of xw in L1; batch 1 runs its rows whole, xw fits in L1).
  constexpr int G = N == 1 ? 4 : (N == 2 ? 4 : (N == 3 ? 3 : 2));
  constexpr int64_t CP = N <= NVGP_MAX ? std::numeric_limits<int64_t>::max() / 2
                                       : G * std::max(1, 16 / (N * G));
  constexpr int64_t TILE = WIDE_TILE;
  const int64_t tiles = (rows + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[TILE * N * LANES];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t v0 = t * TILE, tr = std::min(TILE, rows - v0);
      std::fill(acc, acc + tr * N * LANES, 0.0f);
      for (int64_t c0 = 0; c0 < pairs; c0 += CP) {
        const int64_t c1 = std::min(pairs, c0 + CP), whole = c0 + (c1 - c0) / G * G;
        for (int64_t i = 0; i < tr; ++i) {
          const int64_t ahead = std::min(rows - 1, v0 + i + 2);
          wide_nvfp4_pairs<N, G>(f, xw.data(), v0 + i, c0, whole, acc + i * N * LANES, ahead);
          if (whole < c1) wide_nvfp4_pairs<N, 1>(f, xw.data(), v0 + i, whole, c1, acc + i * N * LANES, ahead);
        }
      }
      for (int64_t i = 0; i < tr; ++i) {
        for (int n = 0; n < N; ++n) {
          V a = vload(acc + (i * N + n) * LANES);
          for (int64_t g = 2 * pairs; g < f.groups(); ++g) a = nvfp4_groups<1>(f, x + n * xs, v0 + i, g, a);
          out[n * os + v0 + i] = finish(a, f.row_scale(v0 + i), NVFP4Rows::kUnbias);
        }
      }
    }
  });
}

// NVFP4, batch NVGP_MAX + 1 .. 8: row pairs, like FP8. A zmm holds the 8-lane chains of rows a and b for one
// lane group (group g of a row: 8 runs of 8 bytes; byte k of rows a and b side by side decodes 16
// nibbles per vpermps), so a step of x is broadcast to both halves and shared by P row pairs: half the
// x traffic per FMA of the group pairs above. Each chain is nvfp4_groups<1>'s: 16 FMAs from zero per
// group, then acc = fma(sum, block scales, acc), group after group. x: [groups][16 steps][N][8];
// acc: [P][N][16]; groups [g0, g1), all full.
template <int N, int P>
inline void nvfp4_row_pairs(const NVFP4Rows& f, const float* xt, const int64_t* pr, int64_t g0, int64_t g1,
                            float* acc_mem) {
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                      -2.0f, -3.0f, -4.0f, -6.0f);
  const int64_t nb = f.blocks();
  const uint8_t* ra[P];
  const uint8_t* rb[P];
  for (int p = 0; p < P; ++p) {
    ra[p] = f.packed + pr[2 * p] * f.p_stride;
    rb[p] = f.packed + pr[2 * p + 1] * f.p_stride;
  }
  __m512 acc[P][N];
  load_chains(acc_mem, acc);
  for (int64_t g = g0; g < g1; ++g) {
    if ((g & 7) == 0)  // a 64-byte line of each run serves 8 groups: fetch it for the next P pairs
      for (int i = 0; i < 2 * P; ++i) f.prefetch_lines(pr[2 * P + i], g);
    __m512 part[P][N];
    for (int p = 0; p < P; ++p)
      for (int n = 0; n < N; ++n) part[p][n] = _mm512_setzero_ps();
    for (int64_t k = 0; k < LANES; ++k) {
      __m512 lo[P], hi[P];
      for (int p = 0; p < P; ++p) {
        const __m512i v = _mm512_cvtepu8_epi32(two_steps(ra[p] + k * nb + g * LANES, rb[p] + k * nb + g * LANES));
        lo[p] = _mm512_permutexvar_ps(v, table);
        hi[p] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
      }
      const float* xk = xt + (g * 16 + 2 * k) * N * LANES;
      for (int n = 0; n < N; ++n) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xk + n * LANES));
        for (int p = 0; p < P; ++p) part[p][n] = _mm512_fmadd_ps(lo[p], xv, part[p][n]);
      }
      for (int n = 0; n < N; ++n) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xk + (N + n) * LANES));
        for (int p = 0; p < P; ++p) part[p][n] = _mm512_fmadd_ps(hi[p], xv, part[p][n]);
      }
    }
    for (int p = 0; p < P; ++p) {
      const __m512 bs = pair_block_scales(f, pr[2 * p], pr[2 * p + 1], g);
      for (int n = 0; n < N; ++n) acc[p][n] = _mm512_fmadd_ps(part[p][n], bs, acc[p][n]);
    }
  }
  store_chains(acc, acc_mem);
}

template <int N>
void wide_nvfp4_pairs_of_rows(const NVFP4Rows& f, const float* x, int64_t xs, int64_t rows, float* out,
                              int64_t os) {
  constexpr int P = N <= 2 ? 4 : (N <= 4 ? 3 : 2);
  constexpr int64_t CG = 32 / N;  // groups per K-chunk: N * CG * 512 bytes (16 KiB) of x in L1
  const int64_t full = f.blocks() / LANES;  // full groups
  const Floats xt = rows_side_by_side<N>(x, xs, full * 16);
  pair_tiles<N, P>(
      rows, full, CG,
      [&](auto p, const int64_t* prp, int64_t c0, int64_t c1, float* acc) {
        nvfp4_row_pairs<N, decltype(p)::value>(f, xt.data(), prp, c0, c1, acc);
      },
      [&](int64_t v, int n, V total) {
        for (int64_t g = full; g < f.groups(); ++g) total = nvfp4_groups<1>(f, x + n * xs, v, g, total);
        out[n * os + v] = finish(total, f.row_scale(v), NVFP4Rows::kUnbias);
      });
}

// ---- AVX-512 BF16: two chain steps per vdpbf16ps ------------------------------------------------------
// vdpbf16ps(acc, a, b) computes, per 32-bit lane i, acc = fma(a[2i+1], b[2i+1], acc) and then
// acc = fma(a[2i], b[2i], acc), each rounded to float32 (measured bitwise on Zen 5; dpbf16_matches_fma
// re-checks it once per process), except that it reads subnormal inputs as zero and flushes subnormal
// results. So a chain's steps s and s + 1 in one instruction (odd slot: step s, even slot: step s + 1)
// are the two FMAs of the chain above, bit for bit, where every weight and x value is exact in bf16
// (FP8 q * 2**-8 and e2m1 values are) and no operand or partial sum can be subnormal or overflow: every
// nonzero |x| in [2**-100, 2**100] (x_fits_bf16, checked per call) makes every product and partial sum
// a multiple of 2**-124 (x's LSB >= 2**-107, FP8's 2**-17, e2m1's 2**-1) and below 2**125. Otherwise
// the FMA kernels run: the choice never changes a bit. Dense bf16 weights have any exponent, so their
// domain is checked as they are read (Bf16Pairs): with x's nonzero exponents in [ex_lo, ex_hi], every
// nonzero weight's exponent in [-110 - ex_lo, 100 - ex_hi] keeps the same two bounds; a pass that meets
// one outside reruns on FMAs from the chains it started with.
#if TRTVOCAB_DPBF16
inline __m512 dpbf16(__m512 acc, __m512 a, __m512 b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);  // vector casts: the same 64 bytes
}

// Adversarial lanes inside the domain the kernels use (weights: FP8 q * 2**-8, e2m1 values or bf16 of
// magnitude 2**-10 .. 2; x: zero or bf16 of magnitude 2**-100 .. 2**100; acc: multiples of 2**-124 below
// 2**100): signed zeros, exact cancellation, ties, the smallest and largest products, random values.
// vdpbf16ps against the two FMAs, once per process.
bool dpbf16_check() {
  alignas(64) uint16_t a[32], b[32];
  alignas(64) float acc[16], got[16], want[16];
  uint32_t seed = 12345u;
  auto rnd = [&seed]() {
    seed = seed * 1664525u + 1013904223u;
    return seed >> 8;
  };
  auto bf = [](float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<uint16_t>(u >> 16);
  };
  auto fl = [](uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  };
  auto weight = [&]() {
    const uint32_t r = rnd();
    if ((r & 7) == 7)  // a dense bf16 weight, any mantissa, exponent -10 .. 0 (x's bounds: the same domain)
      return fl(static_cast<uint16_t>(((r & 8) << 12) | ((127 - (r >> 4) % 11) << 7) | ((r >> 9) & 0x7F)));
    if (r & 1) {  // e2m1
      const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
      return (r & 16) ? -mags[(r >> 1) & 7] : mags[(r >> 1) & 7];
    }
    const int q = static_cast<int>((r >> 1) & 0xFF), e = (q >> 3) & 0xF, m = q & 7;
    if ((q & 0x7F) == 0x7F) return 0.0f;
    const float mag = e ? std::ldexp(1.0f + m / 8.0f, e - 7 - 8) : std::ldexp(m / 8.0f, -6 - 8);
    return (q & 0x80) ? -mag : mag;
  };
  auto xval = [&]() {
    const uint32_t r = rnd();
    if ((r & 15) == 0) return (r & 16) ? -0.0f : 0.0f;
    const uint32_t e = 27 + (r >> 4) % 201;  // biased exponents of 2**-100 .. 2**100
    return fl(static_cast<uint16_t>(((r & 32) << 10) | (e << 7) | ((r >> 12) & 0x7F)));
  };
  for (int round = 0; round < 4096; ++round) {
    for (int i = 0; i < 16; ++i) {
      float a1 = weight(), b1 = xval(), a0 = weight(), b0 = xval();
      const int e = static_cast<int>(rnd() % 200) - 100;
      float c = std::ldexp(static_cast<float>(static_cast<int32_t>(rnd()) - (1 << 23)), e - 24);
      switch (rnd() % 8) {
        case 0: c = -(a1 * b1); break;  // exact cancellation, then a0 b0
        case 1: a1 = (i & 1) ? -0.0f : 0.0f; c = (i & 2) ? -0.0f : 0.0f; a0 = (i & 4) ? -0.0f : 0.0f; break;
        case 2: a1 = 0x1p-8f; b1 = (i & 1) ? 0x1p-16f : -0x1p-16f; c = (i & 2) ? 1.0f : 3.0f; break;  // ties
        case 3: a1 = 0x1p-17f; b1 = -0x1p-100f; c = 0x1p-100f; a0 = -0x1p-17f; b0 = 0x1p-100f; break;  // smallest
        case 4: a1 = 6.0f; b1 = 0x1p100f; a0 = -1.75f; b0 = 0x1p100f; c = 0x1p100f; break;   // largest
        case 5: c = -(a1 * b1) - a0 * b0; break;
        default: break;
      }
      a[2 * i + 1] = bf(a1), b[2 * i + 1] = bf(b1), a[2 * i] = bf(a0), b[2 * i] = bf(b0);
      acc[i] = c;
    }
    const __m512 va = _mm512_load_ps(reinterpret_cast<const float*>(a));
    const __m512 vb = _mm512_load_ps(reinterpret_cast<const float*>(b));
    _mm512_store_ps(got, dpbf16(_mm512_load_ps(acc), va, vb));
    for (int i = 0; i < 16; ++i)
      want[i] = std::fmaf(fl(a[2 * i]), fl(b[2 * i]), std::fmaf(fl(a[2 * i + 1]), fl(b[2 * i + 1]), acc[i]));
    if (std::memcmp(got, want, sizeof(got)) != 0) return false;
  }
  return true;
}
bool dpbf16_matches_fma() {
  static const bool ok = dpbf16_check();
  return ok;
}

// Whether the vdpbf16ps kernels beat the FMA ones on this CPU: two chain steps per instruction pay only
// where a 512-bit vdpbf16ps issues about as often as a 512-bit FMA. AMD's Zen 4 and Zen 5 run it on their
// FMA pipes (Zen 4: 3.0 G/s per core against 3.5 G/s FMAs; B = 8 of NVFP4 36-38 -> 28-33 ms on Zen 5);
// Intel's Xeons do not: on a Xeon with AMX and avx512_bf16 (48 KiB L1D) it measured 1.84 G/s per core
// against 7.3 G/s 512-bit FMAs (operands in registers), and at V = 129280, H = 5120, 2 threads the FMA
// kernels ran FP8 B = 4 in 34 ms against 51, B = 8 in 47 against 73, NVFP4 B = 8 in 52 against 71. The
// AMX tdpbf16ps of those Xeons is no way out either: it is not two rounded FMAs per pair (47 % of its
// lanes differed from them, in either order). So: AMD only, unless trtvocab_fused_set_dpbf16 says otherwise.
bool dpbf16_pays_here() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return std::strcmp(vendor, "AuthenticAMD") == 0;
}
std::atomic<int> dpbf16_mode{-1};  // -1: dpbf16_pays_here; 0: never; 1: wherever dpbf16_matches_fma
bool use_dpbf16() {
  const int mode = dpbf16_mode.load(std::memory_order_relaxed);
  static const bool pays = dpbf16_pays_here();
  return mode != 0 && dpbf16_matches_fma() && (mode == 1 || pays);
}

// Whether every value of x [n][len] (row stride xs) is exact in bf16 (the low 16 bits zero) and zero or
// of magnitude in [2**-100, 2**100] (so finite).
inline bool x_fits_bf16(const float* x, int64_t n, int64_t xs, int64_t len) {
  const __m512i low = _mm512_set1_epi32(0xFFFF), abs = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i lo = _mm512_set1_epi32(0x0D800000), hi = _mm512_set1_epi32(0x71800000);  // 2**-100, 2**100
  for (int64_t r = 0; r < n; ++r) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(x + r * xs);
    int64_t i = 0;
    __mmask16 bad = 0;
    for (; i + 16 <= len; i += 16) {
      const __m512i v = _mm512_loadu_si512(p + i), m = _mm512_and_si512(v, abs);
      bad |= _mm512_test_epi32_mask(v, low) |
             (_mm512_cmpgt_epi32_mask(m, _mm512_setzero_si512()) &
              (_mm512_cmpgt_epi32_mask(lo, m) | _mm512_cmpgt_epi32_mask(m, hi)));
    }
    if (bad) return false;
    for (; i < len; ++i) {
      const uint32_t u = p[i], m = u & 0x7FFFFFFFu;
      if ((u & 0xFFFFu) || (m && (m < 0x0D800000u || m > 0x71800000u))) return false;
    }
  }
  return true;
}

// The biased exponents of x's nonzero values [n][len] (row stride xs): lo, hi (both 127 where all are zero).
inline void x_exponents(const float* x, int64_t n, int64_t xs, int64_t len, int& lo, int& hi) {
  lo = 255, hi = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < len; ++i) {
      uint32_t u;
      std::memcpy(&u, x + r * xs + i, 4);
      if (u & 0x7FFFFFFFu) {
        const int e = static_cast<int>((u >> 23) & 0xFF);
        lo = std::min(lo, e), hi = std::max(hi, e);
      }
    }
  if (lo > hi) lo = hi = 127;
}

// x rows side by side as bf16 step pairs: pair t of x row n (steps 2t, 2t + 1 of `step(n, s)`, 8 floats
// each) at [t][n][C][8] (C copies: 2 lay out the zmm that bcast_pair would build, for a plain load): the
// high 16 bits (x exact in bf16) of step 2t, then those of step 2t + 1; word i from value order[i] of the steps.
template <int N, int C = 1, class Step>
inline Words bf16_pairs(int64_t pairs, const Step& step, __m256i order = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)) {
  Words xb(static_cast<size_t>(std::max<int64_t>(1, pairs * N * C * LANES)));
  for (int64_t t = 0; t < pairs; ++t)
    for (int n = 0; n < N; ++n) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step(n, 2 * t)));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step(n, 2 * t + 1)));
      const __m256i v = _mm256_permutevar8x32_epi32(
          _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))), _mm256_srli_epi32(b, 16)),
          order);
      for (int c = 0; c < C; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb.data() + ((t * N + n) * C + c) * LANES), v);
    }
  return xb;
}
inline __m512 bcast_pair(const uint32_t* p) {
  return _mm512_castsi512_ps(_mm512_broadcast_i32x8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

// e4m3 codes -> bf16 pairs by table: byte tables lo / hi of the bf16 bits of every magnitude's q * 2**-8
// (from fp8_decode8, so bitwise its values), looked up by vpermi2b (7-bit index: the sign bit is
// ignored, then ORed in). spread puts the 32 codes of steps s, s + 1 of rows a | b (a 32-byte load of
// two 16-byte runs) in both bytes of their words: lane i's high word step s, its low word step s + 1.
// Measured on Zen 4: 4.3 cycles per 32 weights against 7 for the float32 decode and merge.
struct Fp8Bf16Tables {
  __m512i lo0, lo1, hi0, hi1, spread, sign;
};
inline const Fp8Bf16Tables& fp8_bf16_tables() {
  static const Fp8Bf16Tables t = [] {
    alignas(64) uint8_t lo[128], hi[128], spread[64];
    for (int m = 0; m < 128; m += 8) {
      uint8_t codes[LANES];
      alignas(32) float v[LANES];
      for (int i = 0; i < LANES; ++i) codes[i] = static_cast<uint8_t>(m + i);
      vstore(v, fp8_decode8(codes));
      for (int i = 0; i < LANES; ++i) {
        uint32_t u;
        std::memcpy(&u, &v[i], 4);
        lo[m + i] = static_cast<uint8_t>(u >> 16);
        hi[m + i] = static_cast<uint8_t>(u >> 24);
      }
    }
    for (int i = 0; i < 16; ++i) {  // lane i: row a (bytes 0-15) below 8, row b (16-31) from 8
      const int row = i < 8 ? 0 : 16, c = i % 8;
      spread[4 * i] = spread[4 * i + 1] = static_cast<uint8_t>(row + 8 + c);  // low word: step s + 1
      spread[4 * i + 2] = spread[4 * i + 3] = static_cast<uint8_t>(row + c);  // high word: step s
    }
    return Fp8Bf16Tables{_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi),
                         _mm512_load_si512(hi + 64), _mm512_load_si512(spread),
                         _mm512_set1_epi16(static_cast<short>(0x8000))};
  }();
  return t;
}
inline __m512 fp8_pairs_bf16(const uint8_t* a, const uint8_t* b, const Fp8Bf16Tables& t) {
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  const __m512i d = _mm512_permutexvar_epi8(t.spread, _mm512_zextsi256_si512(v));
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, d, t.lo1), hi = _mm512_permutex2var_epi8(t.hi0, d, t.hi1);
  const __m512i w = _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, lo, hi);  // odd bytes: the high ones
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(w, d, t.sign, 0xF8));  // w | (d & sign)
}

// FP8 codes of steps s, s + 1 of rows a | b as bf16 pairs (fp8_pairs_bf16); FP8 weights are always in the
// vdpbf16ps domain.
struct Fp8Pairs {
  // x's pairs in two copies (a plain zmm load, no broadcast): measured on Zen 4 (V = 129280, H = 5120,
  // 2 threads, best of 7) B = 4 24.2 -> 22.3 ms, 8 39.2 -> 33.3; bf16 rows, which read twice the bytes,
  // ran B = 8 42 -> 53 with them and keep one.
  static constexpr int kXCopies = 2;
  const Fp8Bf16Tables& t = fp8_bf16_tables();
  __m512 operator()(const uint8_t* a, const uint8_t* b) { return fp8_pairs_bf16(a, b, t); }
  bool in_domain() const { return true; }
  template <int P, int N>
  static bool chains_in_domain(const __m512 (&)[P][N]) { return true; }
};

// Dense bf16 steps s, s + 1 of rows a | b (16 values of each) as bf16 pairs: one vpermw over the two rows'
// 32 bytes (lane i < 8: row a's value i of step s in the high word, of step s + 1 in the low one; i >= 8: row
// b's). Each weight's magnitude bits u = w << 1 are folded into a running max (u) and min (u - 1: a zero
// wraps to the top, so zeros always pass): in_domain says whether every nonzero weight read so far has a
// biased exponent in [lo, hi] (the vdpbf16ps domain for this call's x, see above).
struct Bf16Pairs {
  static constexpr int kXCopies = 1;
  __m512i idx, one = _mm512_set1_epi16(1), umax = _mm512_setzero_si512(), tmin = _mm512_set1_epi32(-1);
  uint16_t u_lo, u_end;  // nonzero u must lie in [u_lo, u_end)
  Bf16Pairs(int lo, int hi) : u_lo(static_cast<uint16_t>(lo << 8)), u_end(static_cast<uint16_t>((hi + 1) << 8)) {
    alignas(64) uint16_t w[32];
    for (int i = 0; i < 16; ++i) {
      const int base = i < 8 ? 0 : 16, l = i % 8;
      w[2 * i] = static_cast<uint16_t>(base + 8 + l);  // low word: step s + 1
      w[2 * i + 1] = static_cast<uint16_t>(base + l);  // high word: step s
    }
    idx = _mm512_load_si512(w);
  }
  __m512 operator()(const uint16_t* a, const uint16_t* b) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
    const __m512i u = _mm512_slli_epi16(v, 1);
    umax = _mm512_max_epu16(umax, u);
    tmin = _mm512_min_epu16(tmin, _mm512_sub_epi16(u, one));
    return _mm512_castsi512_ps(_mm512_permutexvar_epi16(idx, v));
  }
  bool in_domain() const {
    return !(_mm512_cmpge_epu16_mask(umax, _mm512_set1_epi16(static_cast<short>(u_end))) |
             _mm512_cmplt_epu16_mask(tmin, _mm512_set1_epi16(static_cast<short>(u_lo - 1))));
  }
  // A K-chunk's chains as it starts: a pass that reran on FMAs may have left one subnormal (which
  // vdpbf16ps would read as zero), off the 2**-124 grid or past 2**125; such rows stay on FMAs. Nonzero
  // chains in [2**-100, 2**125) are safe (their ulp is at least 2**-124).
  template <int P, int N>
  static bool chains_in_domain(const __m512 (&a)[P][N]) {
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), lo = _mm512_set1_epi32(0x0D800000);
    const __m512i end = _mm512_set1_epi32(0x7E000000);
    __mmask16 bad = 0;
    for (int p = 0; p < P; ++p)
      for (int n = 0; n < N; ++n) {
        const __m512i m = _mm512_and_si512(_mm512_castps_si512(a[p][n]), abs);
        bad |= _mm512_test_epi32_mask(m, m) & (_mm512_cmplt_epu32_mask(m, lo) | _mm512_cmpge_epu32_mask(m, end));
      }
    return bad == 0;
  }
};

// Steps [s0, s1) (s0 even) of P row pairs for N x rows (FP8 or dense bf16 rows, decoded by D: Fp8Pairs /
// Bf16Pairs): full step pairs by vdpbf16ps (step s in the high half of each 32-bit lane), the rest by
// wide_steps; a pass whose weights left D's domain reruns whole by wide_steps from the chains it started
// with (still in acc). xb: bf16_pairs of x; xt: x for wide_steps; acc: [P][N][16].
template <int N, int P, class F, class D>
inline void wide_steps_bf16(const F& f, D dec, const float* xt, const uint32_t* xb, const int64_t* pr, int64_t s0,
                            int64_t s1, float* acc) {
  __m512 a[P][N];
  load_chains(acc, a);
  if (!D::chains_in_domain(a)) {  // an earlier pass of these rows ran on FMAs and left a chain outside
    wide_steps<N, P>(f, xt, pr, s0, s1, acc);
    return;
  }
  const int64_t full = std::min(s1, f.full_steps());
  constexpr int64_t kBytes = static_cast<int64_t>(sizeof(*f.w));
  // The next pass's lines, fetched a pass ahead: into L2 where a pass reads more than half an L1.
  const bool far = 2 * P * (s1 - s0) * LANES * kBytes > l1d_bytes() / 2;
  int64_t s = s0;
  for (; s + 1 < full; s += 2) {
    if (((s * kBytes) & 7) == 0)  // a new 64-byte line of each row: fetch it for the next P pairs
      for (int i = 0; i < 2 * P; ++i) f.prefetch_row(pr[2 * P + i], s, far);
    __m512 w[P];
    for (int p = 0; p < P; ++p)
      w[p] = dec(f.w + pr[2 * p] * f.w_stride + s * LANES, f.w + pr[2 * p + 1] * f.w_stride + s * LANES);
    for (int n = 0; n < N; ++n) {
      const uint32_t* xp = xb + ((s / 2) * N + n) * D::kXCopies * LANES;
      const __m512 xv = D::kXCopies == 2 ? _mm512_loadu_ps(reinterpret_cast<const float*>(xp)) : bcast_pair(xp);
      for (int p = 0; p < P; ++p) a[p][n] = dpbf16(a[p][n], w[p], xv);
    }
  }
  if (!dec.in_domain()) {
    wide_steps<N, P>(f, xt, pr, s0, s1, acc);
    return;
  }
  store_chains(a, acc);
  if (s < s1) wide_steps<N, P>(f, xt, pr, s, s1, acc);
}

// FP8 / dense bf16, batch N = 1..8, by vdpbf16ps: wide_direct's tiles, passes and chains; D: the pair decoder.
constexpr int64_t X_IN_L2_BYTES = 256 * 1024;  // a quarter of the smallest L2 of the AVX-512 BF16 CPUs (1 MiB)
template <int N, class F, class D>
void wide_pairs_bf16(const F& f, const D& dec, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  // Row pairs per pass: P * N zmm chains, P weight steps, x and the decoder's registers in the 32
  // (measured on Zen 4 for FP8; B = 5, 6 ran faster with 4 pairs than with 3; B = 3 on Zen 5 (V = 129280,
  // H = 5120, 2 threads, best of 11 interleaved) 20.8 ms with 6 pairs, 14.1 with 4, 15.7 with 5).
  constexpr int P = N <= 2 ? 8 : (N <= 6 ? 4 : 2);
  const int64_t steps = f.steps();
  // Whole rows while x's bf16 pairs fit in L2 (a row pair's pass then reads them from L2 at half the
  // weights' bytes): measured on Zen 4 (V = 129280, H = 5120, 2 threads, best of 7 interleaved) against
  // chunks of kDirectChunk steps: FP8 B = 3 38.9 -> 26.5 ms, 4 32.3 -> 28.3, 8 even; bf16 B = 4 53 -> 31,
  // 8 56 -> 41 (chunks of 256 steps in between).
  const Floats xt = rows_side_by_side<N>(x, xs, steps);
  const Words xb = bf16_pairs<N, D::kXCopies>(
      f.full_steps() / 2, [&](int n, int64_t s) { return x + n * xs + s * LANES; });
  const int64_t x_bytes = static_cast<int64_t>(xb.size() * sizeof(uint32_t));
  int64_t KC = x_bytes <= X_IN_L2_BYTES ? steps : F::kDirectChunk;  // even
  // Two row pairs a pass (B = 7, 8) take 32 bytes of x's pairs (two copies) per vdpbf16ps: from L2 that
  // held FP8 to about 1.3 cycles each on Zen 5. Where K-chunks of FP8_L1_CHUNK steps keep them in L1 with
  // 16 KiB to spare (N * 4 KiB: Zen 5's 48 KiB L1D, not Zen 4's 32 KiB), they run in those: Zen 5, V =
  // 129280, H = 5120, 2 threads, best of 9-11 interleaved, three runs: B = 7 26.5 -> 24.0, 27.7 -> 25.0,
  // 22.2 -> 19.1 ms; B = 8 24.2 -> 20.3, 25.1 -> 20.9, 28.9 -> 27.0 (chunks of 64 and 96 steps between,
  // 160 and 192 slower than whole rows).
  constexpr int64_t FP8_L1_CHUNK = 128;
  if constexpr (D::kXCopies == 2 && P == 2) {
    const int64_t chunk_bytes = FP8_L1_CHUNK / 2 * N * D::kXCopies * LANES * 4;
    if (steps > FP8_L1_CHUNK && chunk_bytes <= x_chunk_in_l1_bytes()) KC = FP8_L1_CHUNK;
  }
  pair_tiles<N, P>(
      rows, steps, KC,
      [&](auto p, const int64_t* prp, int64_t c0, int64_t c1, float* acc) {
        wide_steps_bf16<N, decltype(p)::value>(f, dec, xt.data(), xb.data(), prp, c0, c1, acc);
      },
      [&](int64_t v, int n, V chain) { out[n * os + v] = finish(chain, f.row_scale(v), F::kUnbias); });
}

// The bf16 bits of the 16 e2m1 values (code 8: -0.0), twice over: vpermw reads a word's low 5 bits.
inline __m512i e2m1_bf16_table() {
  return _mm512_set_epi16(
      static_cast<short>(0xC0C0), static_cast<short>(0xC080), static_cast<short>(0xC040), static_cast<short>(0xC000),
      static_cast<short>(0xBFC0), static_cast<short>(0xBF80), static_cast<short>(0xBF00), static_cast<short>(0x8000),
      0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0x0000, static_cast<short>(0xC0C0),
      static_cast<short>(0xC080), static_cast<short>(0xC040), static_cast<short>(0xC000), static_cast<short>(0xBFC0),
      static_cast<short>(0xBF80), static_cast<short>(0xBF00), static_cast<short>(0x8000), 0x40C0, 0x4080, 0x4040,
      0x4000, 0x3FC0, 0x3F80, 0x3F00, 0x0000);
}

// NVFP4 row pairs by vdpbf16ps, decoded with one shuffle per 32 weights. Byte k of a block holds steps 2k
// (low nibble) and 2k + 1 (high nibble), one bf16 pair. The 8 bytes of a group's k of rows a and b are
// broadcast to the low and high four qwords (8-byte broadcast loads), qword m shifted right by 8m: its
// dwords then start at bytes m and m + 4, so lanes 2m, 2m + 1 of a row hold blocks m, m + 4 (SPREAD_ORDER).
// Shifts and a vpternlogd put the low nibble in the high word and the high nibble in the low word, and one
// vpermw maps each word's low 5 bits through the e2m1 bf16 table (twice over: bit 4 ignored). x's pairs
// and the block scales are laid out in that lane order, and the totals are put back in block order before
// the reduction tree (unspread): the chains are nvfp4_row_pairs', lane for lane. Why: every shuffle takes
// one of vdpbf16ps's two pipes on Zen 5, and the four-shuffle decode (vpmovzxbd, vpmultishiftqb, vpermw
// and the 16-byte merge) held a loop of two row pairs at batch 8 to 0.73 of the vdpbf16ps rate, this one
// to 0.92 (weights and x in L1, one thread).
alignas(32) constexpr int32_t SPREAD_ORDER[LANES] = {0, 4, 1, 5, 2, 6, 3, 7};  // lane -> block of the group
// SPREAD_ORDER as vpermd indices (x's pairs into lane order); its inverse (a chain back to block order).
inline __m256i spread_order() { return _mm256_load_si256(reinterpret_cast<const __m256i*>(SPREAD_ORDER)); }
constexpr std::array<int32_t, LANES> spread_inverse_table() {
  std::array<int32_t, LANES> inv{};
  for (int i = 0; i < LANES; ++i) inv[static_cast<size_t>(SPREAD_ORDER[i])] = i;
  return inv;
}
alignas(32) constexpr std::array<int32_t, LANES> SPREAD_INVERSE = spread_inverse_table();
inline __m256i spread_inverse() { return _mm256_load_si256(reinterpret_cast<const __m256i*>(SPREAD_INVERSE.data())); }
struct SpreadPairs {
  __m512i shift = _mm512_set_epi64(24, 16, 8, 0, 24, 16, 8, 0);
  __m512i low_words = _mm512_set1_epi32(0xFFFF);
  __m512i table = e2m1_bf16_table();
  // The block scales' vpshufb: rows a | b (bytes 0-7 | 8-15), each in SPREAD_ORDER.
  __m128i bytes = [] {
    alignas(16) uint8_t b[16];
    for (int i = 0; i < 16; ++i) b[i] = static_cast<uint8_t>(i / LANES * LANES + SPREAD_ORDER[i % LANES]);
    return _mm_load_si128(reinterpret_cast<const __m128i*>(b));
  }();
  // 8 bytes of row a, 8 of row b -> qword m (row a: m < 4, b: m >= 4) = the row's bytes from byte m % 4.
  __m512i spread(const uint8_t* a, const uint8_t* b) const {
    int64_t u;
    std::memcpy(&u, a, 8);
    const __m512i v = _mm512_mask_broadcastq_epi64(_mm512_set1_epi64(u), 0xF0,
                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
    return _mm512_srlv_epi64(v, shift);
  }
  __m512 operator()(const uint8_t* a, const uint8_t* b) const {
    const __m512i q = spread(a, b);
    const __m512i idx = _mm512_ternarylogic_epi32(_mm512_slli_epi32(q, 16), _mm512_srli_epi32(q, 4), low_words, 0xD8);
    return _mm512_castsi512_ps(_mm512_permutexvar_epi16(idx, table));  // 0xD8: low words from srli, high from slli
  }
  // 8 block scales at a, 8 at b (lanes 0-7 | 8-15) in lane order: fp8_decode16 with the bytes in SPREAD_ORDER.
  __m512 scales(const uint8_t* a, const uint8_t* b) const { return fp8_decode16(_mm_shuffle_epi8(two_steps(a, b), bytes)); }
  // Block scales of group g of rows a | b in lane order.
  __m512 scales(const NVFP4Rows& f, int64_t a, int64_t b, int64_t g) const {
    return scales(f.bscale + a * f.bs_stride + g * LANES, f.bscale + b * f.bs_stride + g * LANES);
  }
};
// A chain's 8 lanes in SPREAD_ORDER -> block order.
inline V unspread(V a) { return {_mm256_permutevar8x32_ps(a.v, spread_inverse())}; }

// G groups at a time (their block sums interleaved, added to the totals in group order), then single
// groups. xb: [groups][8 k][N][16] bf16 pairs in SPREAD_ORDER (two copies: a plain zmm load); acc_mem:
// [P][N][16], the totals in SPREAD_ORDER (load, fma, store per group: P * N of them do not fit in registers
// beside P * G * N block sums); groups [g0, g1), all full.
template <int N, int P, int G>
inline void nvfp4_row_pairs_bf16(const NVFP4Rows& f, const SpreadPairs& dec, const uint32_t* xb, const int64_t* pr,
                                 int64_t g0, int64_t g1, float* acc_mem) {
  const int64_t nb = f.blocks();
  const uint8_t* ra[P];
  const uint8_t* rb[P];
  for (int p = 0; p < P; ++p) {
    ra[p] = f.packed + pr[2 * p] * f.p_stride;
    rb[p] = f.packed + pr[2 * p + 1] * f.p_stride;
  }
  int64_t g = g0;
  for (; g + G <= g1; g += G) {
    for (int j = 0; j < G; ++j) {
      if (((g + j) & 7) == 0)  // a 64-byte line of each run serves 8 groups: fetch it for the next P pairs
        for (int i = 0; i < 2 * P; ++i) f.prefetch_lines(pr[2 * P + i], g + j);
    }
    __m512 part[P][G][N];
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < G; ++j)
        for (int n = 0; n < N; ++n) part[p][j][n] = _mm512_setzero_ps();
    for (int64_t k = 0; k < LANES; ++k) {
      __m512 w[P][G];
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < G; ++j) {
          const int64_t o = k * nb + (g + j) * LANES;
          w[p][j] = dec(ra[p] + o, rb[p] + o);
        }
      for (int j = 0; j < G; ++j) {
        const uint32_t* xk = xb + ((g + j) * LANES + k) * N * 2 * LANES;
        for (int n = 0; n < N; ++n) {
          const __m512 xv = _mm512_load_ps(reinterpret_cast<const float*>(xk + n * 2 * LANES));
          for (int p = 0; p < P; ++p) part[p][j][n] = dpbf16(part[p][j][n], w[p][j], xv);
        }
      }
    }
    for (int j = 0; j < G; ++j)
      for (int p = 0; p < P; ++p) {
        const __m512 bs = dec.scales(f, pr[2 * p], pr[2 * p + 1], g + j);
        for (int n = 0; n < N; ++n) {
          float* a = acc_mem + (p * N + n) * 16;
          _mm512_store_ps(a, _mm512_fmadd_ps(part[p][j][n], bs, _mm512_load_ps(a)));
        }
      }
  }
  if constexpr (G > 1) {
    if (g < g1) nvfp4_row_pairs_bf16<N, P, 1>(f, dec, xb, pr, g, g1, acc_mem);
  }
}

// NVFP4, batch 3..8, by vdpbf16ps: P row pairs, G lane groups of each interleaved (P * G * N independent
// block sums for the latency of vdpbf16ps).
template <int N>
void wide_nvfp4_bf16(const NVFP4Rows& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  // Two row pairs (each x load serves two vdpbf16ps), G groups in flight: 12-16 block sums in registers.
  // x's pairs in two copies: a 32-byte broadcast load takes one of vdpbf16ps's two pipes on Zen 5, a
  // 64-byte load on a 64-byte line does not. Measured on Zen 5 (V = 129280, H = 5120, 2 threads, best of 11
  // interleaved) against one row pair, broadcasts and the totals in registers: B = 4 17.4 -> 15.8 ms, 5
  // 20.7 -> 17.1, 6 22.9 -> 21.2, 8 26.2 -> 24.5; one row pair with the two copies was slower (B = 8 30).
  constexpr int P = 2, G = N <= 5 ? 2 : 1;
  const int64_t full = f.blocks() / LANES;
  const SpreadPairs dec;
  const Words xb = bf16_pairs<N, 2>(
      full * LANES, [&](int n, int64_t s) { return x + n * xs + s * LANES; }, spread_order());
  // Every row pair reads all of x: chunks of as many groups as keep x's pairs in L1 with 16 KiB to spare
  // (the totals kept in memory between chunks; chunks of 16 groups measured 36 -> 28 ms at B = 8 on Zen 4,
  // where x was read from L2 for every pair; 32 against 40 KiB on Zen 5 about even).
  const int64_t group_bytes = LANES * N * 2 * LANES * static_cast<int64_t>(sizeof(uint32_t));
  const int64_t CG = std::max<int64_t>(1, std::min(full, x_chunk_in_l1_bytes() / group_bytes));
  pair_tiles<N, P>(
      rows, full, CG,
      [&](auto p, const int64_t* prp, int64_t c0, int64_t c1, float* acc) {
        nvfp4_row_pairs_bf16<N, decltype(p)::value, G>(f, dec, xb.data(), prp, c0, c1, acc);
      },
      [&](int64_t v, int n, V total) {
        total = unspread(total);
        for (int64_t g = full; g < f.groups(); ++g) total = nvfp4_groups<1>(f, x + n * xs, v, g, total);
        out[n * os + v] = finish(total, f.row_scale(v), NVFP4Rows::kUnbias);
      });
}

// NVFP4 by vdpbf16ps with a row's 16 blocks per zmm (wide_nvfp4_pairs' layout: pair q of a row is byte k
// of blocks 16q .. 16q + 15, 16 contiguous bytes per k; lane i = block 16q + i). One vpermi2b spreads the
// 16 bytes and the same bytes shifted right by 4 over the 16 lanes (even word: the high nibble, odd
// word: the low one, which vdpbf16ps multiplies first), one vpermw maps each word's low 5 bits through
// the e2m1 bf16 table (bit 4 ignored): two shuffles per 32 weights, where the FMA kernel spends three and
// two FMAs. Each group's block sums run from zero and are added as acc = fma(sum, block scales, acc) on
// the row's 8-lane totals, group after group (lanes 0-7 of a pair: group 2q, lanes 8-15: group 2q + 1):
// wide_nvfp4_pairs' chains, so nvfp4_groups<1>'s. xb: [pairs][8 k][N][16] bf16 pairs (lane i: step 2k of
// block 16q + i in the high word, step 2k + 1 in the low one); acc: the row's N totals ([N][8]).
struct E2m1Lanes {
  // vpermb: byte i into all four bytes of lane i; vpsrlvw: the even word (the high nibble's) right by 4.
  __m512i idx = _mm512_set_epi32(0x0F0F0F0F, 0x0E0E0E0E, 0x0D0D0D0D, 0x0C0C0C0C, 0x0B0B0B0B, 0x0A0A0A0A, 0x09090909,
                                 0x08080808, 0x07070707, 0x06060606, 0x05050505, 0x04040404, 0x03030303, 0x02020202,
                                 0x01010101, 0x00000000);
  __m512i shift = _mm512_set1_epi32(4);
  __m512i table = e2m1_bf16_table();
  // 16 bytes of packed e2m1 -> lane i: the low nibble of byte i (high word), its high nibble (low word).
  __m512 operator()(const uint8_t* p) const {
    const __m512i b = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_permutexvar_epi16(_mm512_srlv_epi16(_mm512_permutexvar_epi8(idx, b), shift), table));
  }
};

template <int N, int G>
inline void nvfp4_block_lanes_bf16(const NVFP4Rows& f, const uint32_t* xb, int64_t r, int64_t q0, int64_t q1,
                                   float* acc_mem, int64_t ahead) {
  const E2m1Lanes decode;
  const int64_t nb = f.blocks();
  const uint8_t* row = f.packed + r * f.p_stride;
  const uint8_t* srow = f.bscale + r * f.bs_stride;
  V acc[N];
  for (int n = 0; n < N; ++n) acc[n] = vload(acc_mem + n * LANES);
  for (int64_t q = q0; q < q1; q += G) {
    const uint8_t* p = row + q * 16;
    if ((q & 3) == 0 || G > 1) f.prefetch_in_order(ahead, q / 4);
    __m512 part[G][N];
    for (int j = 0; j < G; ++j)
      for (int n = 0; n < N; ++n) part[j][n] = _mm512_setzero_ps();
    for (int64_t k = 0; k < LANES; ++k) {
      for (int j = 0; j < G; ++j) {
        const __m512 w = decode(p + k * nb + j * 16);
        const uint32_t* xq = xb + ((q + j) * LANES + k) * N * 16;
        for (int n = 0; n < N; ++n)
          part[j][n] = dpbf16(part[j][n], w, _mm512_castsi512_ps(_mm512_loadu_si512(xq + n * 16)));
      }
    }
    for (int j = 0; j < G; ++j) {
      const __m512 bs = fp8_decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + (q + j) * 16)));
      for (int n = 0; n < N; ++n) {
        acc[n] = vfma(half0(part[j][n]), half0(bs), acc[n]);
        acc[n] = vfma(half1(part[j][n]), half1(bs), acc[n]);
      }
    }
  }
  for (int n = 0; n < N; ++n) vstore(acc_mem + n * LANES, acc[n]);
}

// The bytes of x's bf16 pairs in the block-lanes layout ([pairs][8 k][N][16] 32-bit words).
inline int64_t lanes_x_bytes(const NVFP4Rows& f, int n) { return f.blocks() / 16 * LANES * n * 16 * 4; }

// x's bf16 pairs for the kernels with a row's 16 blocks per zmm: [pairs][8 k][N][16] 32-bit words, word i
// of pair q = step 2k (high half) and 2k + 1 (low half) of block 16q + i.
template <int N>
inline Words block_lane_pairs(const float* x, int64_t xs, int64_t pairs) {
  Words xb(static_cast<size_t>(std::max<int64_t>(1, pairs * LANES * N * 16)));
  for (int64_t q = 0; q < pairs; ++q)
    for (int64_t k = 0; k < LANES; ++k)
      for (int n = 0; n < N; ++n)
        for (int64_t i = 0; i < 16; ++i) {
          uint32_t a, b;
          // x is in step order (gemm.py nvfp4_x): step 2k + h of block 8g + l at 128 g + 16 k + 8 h + l.
          const float* e = x + n * xs + (2 * q + i / LANES) * 128 + 16 * k + i % LANES;
          std::memcpy(&a, e, 4);
          std::memcpy(&b, e + LANES, 4);
          xb[static_cast<size_t>(((q * LANES + k) * N + n) * 16 + i)] = (a & 0xFFFF0000u) | (b >> 16);
        }
  return xb;
}

// NVFP4, batch 2..NVFP4_LANES_MAX (batch 1 runs row runs: the same chains), by nvfp4_block_lanes_bf16: tiles
// of WIDE_TILE rows, a row at a time, x's pairs read whole while they fit in L1 (x_in_l1_bytes), else in
// K-chunks of pairs for all the tile's rows (the totals wait in memory between chunks: a float32 store is exact).
template <int N>
void wide_nvfp4_lanes_bf16(const NVFP4Rows& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  // G * N independent block sums per k (measured: G = 2, 5, 10 no faster at batch 1, 6-12 on Zen 5; batch 3
  // on Zen 5, V = 129280, H = 5120, 2 threads, best of 21 interleaved: G = 4 14.2 ms, G = 3 17.1, row pairs
  // 16.9).
  constexpr int G = N == 2 ? 2 : 4;
  const int64_t pairs = f.blocks() / 16;
  const Words xb = block_lane_pairs<N>(x, xs, pairs);
  const int64_t pair_bytes = N * LANES * 16 * 4;
  const int64_t CP = lanes_x_bytes(f, N) <= x_in_l1_bytes() ? std::max<int64_t>(1, pairs)
                                                             : std::max<int64_t>(G, x_in_l1_bytes() / pair_bytes / G * G);
  const int64_t tiles = (rows + WIDE_TILE - 1) / WIDE_TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[WIDE_TILE * N * LANES];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t v0 = t * WIDE_TILE, tr = std::min(WIDE_TILE, rows - v0);
      std::fill(acc, acc + tr * N * LANES, 0.0f);
      for (int64_t c0 = 0; c0 < pairs; c0 += CP) {
        const int64_t c1 = std::min(pairs, c0 + CP), whole = c0 + (c1 - c0) / G * G;
        for (int64_t i = 0; i < tr; ++i) {
          const int64_t ahead = std::min(rows - 1, v0 + i + 2);
          nvfp4_block_lanes_bf16<N, G>(f, xb.data(), v0 + i, c0, whole, acc + i * N * LANES, ahead);
          if (whole < c1) nvfp4_block_lanes_bf16<N, 1>(f, xb.data(), v0 + i, whole, c1, acc + i * N * LANES, ahead);
        }
      }
      for (int64_t i = 0; i < tr; ++i)
        for (int n = 0; n < N; ++n) {
          V a = vload(acc + (i * N + n) * LANES);
          for (int64_t g = 2 * pairs; g < f.groups(); ++g) a = nvfp4_groups<1>(f, x + n * xs, v0 + i, g, a);
          out[n * os + v0 + i] = finish(a, f.row_scale(v0 + i), NVFP4Rows::kUnbias);
        }
    }
  });
}

// NVFP4, batch 1..NVFP4_RUNS_MAX, by vdpbf16ps, each row read in address order: run k (byte k of every
// block, nb contiguous bytes) for all of a chunk's block pairs, then run k + 1, so that a row is one forward
// stream of lines (and a thread's rows one stream) instead of 8 runs advancing side by side. A read of the
// weights alone (V = 129280, H = 5120, 2 threads, Zen 5) took 7.5-8.6 ms in this order, 9.4-9.8 in the
// block-lanes order; this kernel ran batch 1 in 7.8 ms against block lanes' 8.3 (best of 21 interleaved), and
// batch 2, with half the pairs per chunk, in 10.4 against 9.4 (so it runs batch 1 only). A pair q (blocks 16q
// .. 16q + 15, 16 bytes of run k) is decoded by E2m1Lanes (the one-shuffle SpreadPairs, with more
// instructions, ran batch 1 in 8.9 ms); its block sums stay in registers across the 8 runs (Q * N zmm, a
// chunk of Q <= RUNS_REGS / N pairs). A chunk's sums are then scaled and added to the row's totals in group
// order (nvfp4_block_lanes_bf16's chains, lane for lane), but during the next chunk's runs: that chain of 2 Q
// FMAs per x row is serial, and at the end of its own chunk it held up the next row's loads (9.1 ms).
constexpr int RUNS_REGS = 20;  // block sums in registers (32 zmm: the decoder's 3 constants, w, x)
constexpr int NVFP4_RUNS_MAX = 1;
// The chunk whose block sums wait to be scaled and added (row < 0: none), and the row it finishes.
struct RunsPending {
  alignas(64) float part[RUNS_REGS][16];  // [q * N + n], lane i = block 16q + i (E2m1Lanes)
  int64_t row = -1, q0 = 0, cnt = 0;
  V acc[NVFP4_RUNS_MAX];                  // the totals of `row`, the pending chunk not yet added
  int64_t done = -1;                      // a row whose totals are complete (in done_acc), or -1
  V done_acc[NVFP4_RUNS_MAX];
};

// Chunk [q0, q0 + Q) of row r, while adding the pending chunk; then this chunk is the pending one.
template <int N, int Q>
void nvfp4_row_runs_bf16(const NVFP4Rows& f, const E2m1Lanes& dec, const uint32_t* xb, int64_t r, int64_t q0,
                         int64_t ahead, bool to_l2, RunsPending& pend) {
  const int64_t nb = f.blocks();
  const uint8_t* row = f.packed + r * f.p_stride + q0 * 16;
  const uint8_t* next = f.packed + ahead * f.p_stride + q0 * 16;
  // prefetch_line, not prefetch_runs: with prefetch_runs the block sums were spilled and reloaded per run.
  const auto lines = [to_l2](const uint8_t* a, int64_t bytes) {
    const uintptr_t end = reinterpret_cast<uintptr_t>(a) + static_cast<uintptr_t>(bytes);
    for (uintptr_t l = reinterpret_cast<uintptr_t>(a) & ~uintptr_t{63}; l < end; l += 64)
      prefetch_line(reinterpret_cast<const void*>(l), to_l2);
  };
  lines(f.bscale + ahead * f.bs_stride + q0 * 16, Q * 16);
  const bool adding = pend.row >= 0;
  const uint8_t* psrow = adding ? f.bscale + pend.row * f.bs_stride + pend.q0 * 16 : nullptr;
  V acc[N];
  for (int n = 0; n < N; ++n) acc[n] = pend.acc[n];
  __m512 part[Q][N];
  _Pragma("GCC unroll 32") for (int q = 0; q < Q; ++q)
    for (int n = 0; n < N; ++n) part[q][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < LANES; ++k) {
    lines(next + k * nb, Q * 16);
    _Pragma("GCC unroll 32") for (int q = 0; q < Q; ++q) {
      const uint8_t* b = row + k * nb + q * 16;
      const __m512 w = dec(b);
      const uint32_t* xq = xb + ((q0 + q) * LANES + k) * N * 16;
      for (int n = 0; n < N; ++n)
        part[q][n] = dpbf16(part[q][n], w, _mm512_load_ps(reinterpret_cast<const float*>(xq + n * 16)));
    }
    if (adding)  // an eighth of the pending chunk's pairs, in order
      for (int64_t q = k * pend.cnt / LANES; q < (k + 1) * pend.cnt / LANES; ++q) {
        const __m512 bs = fp8_decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(psrow + q * 16)));
        for (int n = 0; n < N; ++n) {
          const __m512 s = _mm512_load_ps(pend.part[q * N + n]);
          acc[n] = vfma(half0(s), half0(bs), acc[n]);
          acc[n] = vfma(half1(s), half1(bs), acc[n]);
        }
      }
  }
  pend.done = -1;
  if (adding && pend.row != r) {  // the pending chunk was its row's last
    pend.done = pend.row;
    for (int n = 0; n < N; ++n) pend.done_acc[n] = acc[n], acc[n] = vzero();
  }
  _Pragma("GCC unroll 32") for (int q = 0; q < Q; ++q)
    for (int n = 0; n < N; ++n) _mm512_store_ps(pend.part[q * N + n], part[q][n]);
  for (int n = 0; n < N; ++n) pend.acc[n] = acc[n];  // zero after a finished row (and before the first)
  pend.row = r, pend.q0 = q0, pend.cnt = Q;
}
// The pending chunk's sums scaled and added to its row's totals, at once (after a thread's last chunk).
template <int N>
void runs_add_pending(const NVFP4Rows& f, const RunsPending& pend, V* acc) {
  const uint8_t* srow = f.bscale + pend.row * f.bs_stride + pend.q0 * 16;
  for (int n = 0; n < N; ++n) acc[n] = pend.acc[n];
  for (int64_t q = 0; q < pend.cnt; ++q) {
    const __m512 bs = fp8_decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + q * 16)));
    for (int n = 0; n < N; ++n) {
      const __m512 s = _mm512_load_ps(pend.part[q * N + n]);
      acc[n] = vfma(half0(s), half0(bs), acc[n]);
      acc[n] = vfma(half1(s), half1(bs), acc[n]);
    }
  }
}
// nvfp4_row_runs_bf16<N, Q> for Q = 1 .. RUNS_REGS / N, by a table built at compile time.
template <int N>
using RowRuns = void (*)(const NVFP4Rows&, const E2m1Lanes&, const uint32_t*, int64_t, int64_t, int64_t, bool,
                         RunsPending&);
template <int N, size_t... Q>
constexpr std::array<RowRuns<N>, sizeof...(Q)> row_runs_table(std::index_sequence<Q...>) {
  return {&nvfp4_row_runs_bf16<N, static_cast<int>(Q) + 1>...};
}

template <int N>
void wide_nvfp4_runs_bf16(const NVFP4Rows& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  static_assert(N <= NVFP4_RUNS_MAX, "RunsPending holds NVFP4_RUNS_MAX totals");
  constexpr int QMAX = RUNS_REGS / N;
  static constexpr auto table = row_runs_table<N>(std::make_index_sequence<QMAX>{});
  const int64_t pairs = f.blocks() / 16;
  const E2m1Lanes dec;
  const Words xb = block_lane_pairs<N>(x, xs, pairs);
  // Equal chunks of at most QMAX pairs (a row of H = 5120 at batch 1: one chunk of 20).
  const int64_t chunks = std::max<int64_t>(1, (pairs + QMAX - 1) / QMAX), per = (pairs + chunks - 1) / chunks;
  // Rows ahead to prefetch: a row (2880 bytes at H = 5120) takes about 100 ns at batch 1.
  constexpr int64_t AHEAD = 3;
  const bool to_l2 = prefetch_to_l2();
  const auto finish_row = [&](int64_t r, const V* acc) {
    for (int n = 0; n < N; ++n) {
      V a = acc[n];
      for (int64_t g = 2 * pairs; g < f.groups(); ++g) a = nvfp4_groups<1>(f, x + n * xs, r, g, a);
      out[n * os + r] = finish(a, f.row_scale(r), NVFP4Rows::kUnbias);
    }
  };
  at::parallel_for(0, rows, WIDE_TILE, [&](int64_t r0, int64_t r1) {
    RunsPending pend;
    for (int n = 0; n < N; ++n) pend.acc[n] = vzero();
    const auto call = [&](int64_t r, int64_t q0, int64_t cnt) {
      table[static_cast<size_t>(cnt - 1)](f, dec, xb.data(), r, q0, std::min(rows - 1, r + AHEAD), to_l2, pend);
      if (pend.done >= 0) finish_row(pend.done, pend.done_acc);
    };
    for (int64_t r = r0; r < r1; ++r) {
      if (pairs == 0) {
        V acc[N];
        for (int n = 0; n < N; ++n) acc[n] = vzero();
        finish_row(r, acc);
        continue;
      }
      for (int64_t q0 = 0; q0 < pairs; q0 += per) call(r, q0, std::min(per, pairs - q0));
    }
    if (pend.row >= 0) {  // the range's last chunk
      V acc[N];
      runs_add_pending<N>(f, pend, acc);
      finish_row(pend.row, acc);
    }
  });
}


// Which vdpbf16ps kernel runs which batch (measured on Zen 4, V = 129280, H = 5120, 2 threads, best of 9-21
// interleaved against the FMA kernels): FP8 every batch 1..8 (batch 1 27.8 -> 23.2 ms, in L2 61 -> 44 ps per
// weight); NVFP4 batches 1..2 by block lanes (batch 1 16.6 -> 12.5 ms, 2 22.9 -> 16.9), 3..8 by row pairs
// (block lanes read every x row once per weight row: batch 4 40 against 33 ms, 8 52 against 49). Batches 3
// and 4 run block lanes where all of x's pairs stay in L1 (30 and 40 KiB at H = 5120: Zen 5's 48 KiB L1D,
// not Zen 4's 32 KiB; Zen 5, best of 21 interleaved, x on 64-byte lines: batch 3 16.9 -> 14.2 ms, batch 4
// 14.1 -> 12.6 against the two-pair row kernel, 6.0 -> 4.8 at H = 4096, V = 60000). Batch 1 runs row runs
// (wide_nvfp4_runs_bf16, measured on Zen 5 only).
constexpr int NVFP4_LANES_MAX = 4;
#endif  // TRTVOCAB_DPBF16

template <int N, class F>
void wide(const F& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
#if TRTVOCAB_DPBF16
  if constexpr (std::is_same_v<F, FP8Rows>) {
    if (use_dpbf16() && x_fits_bf16(x, N, xs, f.steps() * LANES)) {
      wide_pairs_bf16<N>(f, Fp8Pairs{}, x, xs, rows, out, os);
      return;
    }
  }
  if constexpr (std::is_same_v<F, DenseRows<Dense::BF16>>) {
    if (use_dpbf16() && x_fits_bf16(x, N, xs, f.steps() * LANES)) {
      int lo, hi;  // x's biased exponents, then the weights' that keep the domain (see "AVX-512 BF16"):
      x_exponents(x, N, xs, f.steps() * LANES, lo, hi);
      // e_w - 127 in [-110 - (lo - 127), 100 - (hi - 127)], normal and finite.
      lo = std::max(1, 144 - lo), hi = std::min(254, 354 - hi);
      if (lo <= hi) {
        wide_pairs_bf16<N>(f, Bf16Pairs(lo, hi), x, xs, rows, out, os);
        return;
      }
    }
  }
  if constexpr (F::kGroupScaled && N <= NVFP4_RUNS_MAX) {
    if (use_dpbf16() && x_fits_bf16(x, N, xs, f.blocks() / LANES * 16 * LANES)) {
      wide_nvfp4_runs_bf16<N>(f, x, xs, rows, out, os);
      return;
    }
  }
  // Batch 1 took row runs above under the same test, so block lanes start at batch 2.
  if constexpr (F::kGroupScaled && N > NVFP4_RUNS_MAX && N <= NVFP4_LANES_MAX) {
    if (use_dpbf16() && (N <= 2 || lanes_x_bytes(f, N) <= x_in_l1_bytes()) &&
        x_fits_bf16(x, N, xs, f.blocks() / LANES * 16 * LANES)) {
      wide_nvfp4_lanes_bf16<N>(f, x, xs, rows, out, os);
      return;
    }
  }
  if constexpr (F::kGroupScaled && N >= 3) {
    if (use_dpbf16() && x_fits_bf16(x, N, xs, f.blocks() / LANES * 16 * LANES)) {
      wide_nvfp4_bf16<N>(f, x, xs, rows, out, os);
      return;
    }
  }
#endif
  if constexpr (F::kGroupScaled) {
    if constexpr (N <= NVGP_MAX) {
      wide_nvfp4<N>(f, x, xs, rows, out, os);  // lane-group pairs: the fewest decode instructions
    } else {
      wide_nvfp4_pairs_of_rows<N>(f, x, xs, rows, out, os);  // row pairs: x broadcast, shared by P pairs
    }
  } else {
    wide_direct<N>(f, x, xs, rows, out, os);
  }
}

// ---- AVX-512, batch >= 9: a decoded tile shared by every x row, two x rows per zmm ------------------
// The tile kernel's chains (batched above), on 512-bit registers: a zmm holds the 8-lane chains of
// two x rows (n, n + 1) against one weight row; the weight row's step (8 floats of the decoded tile)
// is broadcast to both halves (vbroadcastf32x8), so each half is exactly the 8-lane FMA of the AVX2
// kernel, in the same step order. A micro kernel holds WB_NV weight rows x WB_NP row pairs of chains
// (24 zmm) and reads WB_NP + WB_NV registers per step for 24 FMAs. x is re-laid out once per call
// into blocks of WB_ROWS rows: [block][step][pair][16] (the last block's odd row paired with zeros,
// computed and never written), so a block's K-chunk is one contiguous run. Tiles of WB_TILE weight
// rows are decoded a K-chunk at a time (FP8 / dense: WB_CHUNK steps; NVFP4: WB_CHUNK / 16 lane
// groups) into [row][steps][8] float32 and reused for every block of x rows; the chains wait in
// memory between chunks (a float32 store is exact). NVFP4's block sums start from zero per group
// and are added as acc = fma(sum, block scales, acc) in group order: every logit is the 8-lane
// kernels' chain, bitwise.
constexpr int WB_NV = 6, WB_NP = 4;  // micro kernel: weight rows x row pairs
constexpr int64_t WB_ROWS = 2 * WB_NP;  // x rows per block
constexpr int64_t WB_TILE = 24;  // weight rows per tile (a multiple of WB_NV)
constexpr int64_t WB_CHUNK = 32;  // steps per K-chunk (NVFP4: two lane groups)
constexpr int64_t WB_PASS = 128;  // x rows per pass over the decoded tiles (the chains in memory: WB_TILE * WB_PASS * 32 B)

// Steps [0, steps) of NV weight rows (tile row v: w + v * ws) against NP row pairs (pair j at step s:
// x + s * x_step + j * 16); acc: row v pair j at acc + v * acc_v + j * 16.
template <int NP, int NV>
inline void wb_micro(const float* x, int64_t x_step, const float* w, int64_t ws, int64_t steps, float* acc,
                     int64_t acc_v, const float*) {
  __m512 a[NV][NP];
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NP; ++j) a[v][j] = _mm512_loadu_ps(acc + v * acc_v + j * 16);
  for (int64_t s = 0; s < steps; ++s) {
    __m512 xv[NP];
    for (int j = 0; j < NP; ++j) xv[j] = _mm512_loadu_ps(x + s * x_step + j * 16);
    for (int v = 0; v < NV; ++v) {
      const __m512 wv = _mm512_broadcast_f32x8(_mm256_loadu_ps(w + v * ws + s * LANES));
      for (int j = 0; j < NP; ++j) a[v][j] = _mm512_fmadd_ps(wv, xv[j], a[v][j]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(acc + v * acc_v + j * 16, a[v][j]);
}

// NVFP4: the chunk's groups (steps / 16; the tile [step][group][8]: wb_decode) one after the other; each
// group's block sums start from zero in registers and are added to the totals in acc as
// acc = fma(sum, bs[v][g], acc). Not inlined: inlined into the tile loop, GCC kept the sums of the
// one-pair kernel on the stack inside the step loop (measured: NVFP4 at batch 9 1.4x slower).
template <int NP, int NV>
__attribute__((noinline)) void wb_micro_gs(const float* x, int64_t x_step, const float* w, int64_t ws,
                                           int64_t steps, float* acc, int64_t acc_v, const float* bs) {
  __m512 a[NV][NP];
  for (int64_t g = 0; g * 16 < steps; ++g) {
    for (int v = 0; v < NV; ++v)
      for (int j = 0; j < NP; ++j) a[v][j] = _mm512_setzero_ps();
    const float* xg = x + g * 16 * x_step;
    const float* wg = w + g * LANES;
    for (int64_t t = 0; t < 16; ++t) {
      __m512 xv[NP];
      for (int j = 0; j < NP; ++j) xv[j] = _mm512_loadu_ps(xg + t * x_step + j * 16);
      for (int v = 0; v < NV; ++v) {
        const __m512 wv = _mm512_broadcast_f32x8(_mm256_loadu_ps(wg + v * ws + t * 2 * LANES));
        for (int j = 0; j < NP; ++j) a[v][j] = _mm512_fmadd_ps(wv, xv[j], a[v][j]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m512 b = _mm512_broadcast_f32x8(_mm256_loadu_ps(bs + (v * (WB_CHUNK / 16) + g) * LANES));
      for (int j = 0; j < NP; ++j) {
        float* p = acc + v * acc_v + j * 16;
        _mm512_storeu_ps(p, _mm512_fmadd_ps(a[v][j], b, _mm512_loadu_ps(p)));
      }
    }
  }
}

template <int NP, int NV, bool GS>
inline void wb_call(const float* x, int64_t x_step, const float* w, int64_t ws, int64_t steps, float* acc,
                    int64_t acc_v, const float* bs) {
  if constexpr (GS) {
    wb_micro_gs<NP, NV>(x, x_step, w, ws, steps, acc, acc_v, bs);
  } else {
    wb_micro<NP, NV>(x, x_step, w, ws, steps, acc, acc_v, bs);
  }
}

template <int NV, bool GS>
inline void wb_micro_np(int64_t np, const float* x, int64_t x_step, const float* w, int64_t ws, int64_t steps,
                        float* acc, int64_t acc_v, const float* bs) {
  static_assert(WB_NP == 4, "the cases below");
  switch (np) {
    case 4: wb_call<4, NV, GS>(x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 3: wb_call<3, NV, GS>(x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 2: wb_call<2, NV, GS>(x, x_step, w, ws, steps, acc, acc_v, bs); break;
    default: wb_call<1, NV, GS>(x, x_step, w, ws, steps, acc, acc_v, bs); break;
  }
}

template <bool GS>
inline void wb_micro_any(int64_t nv, int64_t np, const float* x, int64_t x_step, const float* w, int64_t ws,
                         int64_t steps, float* acc, int64_t acc_v, const float* bs) {
  static_assert(WB_NV == 6, "the cases below");
  switch (nv) {
    case 6: wb_micro_np<6, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 5: wb_micro_np<5, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 4: wb_micro_np<4, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 3: wb_micro_np<3, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 2: wb_micro_np<2, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
    default: wb_micro_np<1, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
  }
}

// x rows [b0, b0 + nb) as blocks of WB_ROWS rows: block i (rows b0 + 8i ..) at xt + i * steps * 64 floats,
// step s pair j at + (s * pairs_i + j) * 16, pairs_i = its row pairs (rows past nb are zeros).
inline void wb_layout(const float* x, int64_t xs, int64_t b0, int64_t nb, int64_t steps, float* xt) {
  for (int64_t i = 0; i * WB_ROWS < nb; ++i) {
    const int64_t r0 = i * WB_ROWS, nr = std::min(WB_ROWS, nb - r0), pairs = (nr + 1) / 2;
    float* blk = xt + i * steps * WB_ROWS * LANES;
    for (int64_t s = 0; s < steps; ++s) {
      float* dst = blk + s * pairs * 16;
      for (int64_t r = 0; r < 2 * pairs; ++r) {
        if (r < nr) {
          std::memcpy(dst + r * LANES, x + (b0 + r0 + r) * xs + s * LANES, LANES * sizeof(float));
        } else {
          std::memset(dst + r * LANES, 0, LANES * sizeof(float));
        }
      }
    }
  }
}

// Steps [s0, s0 + n) of weight row r into the tile row dst: FP8 / dense [step][8], two steps per
// 512-bit decode (the tail step through the 8-lane decoder, zero-padded); NVFP4 (s0 / 16 = group g, n =
// 16 or 32: one or two groups) [step][group][8] with the groups' block scales in bs [group][8]: byte
// k of groups g, g + 1 is one 16-byte load, its nibbles decoded by a vpermps over the 16 e2m1 values.
inline void wb_decode(const FP8Rows& f, int64_t r, int64_t s0, int64_t n, float* dst, float*) {
  const uint8_t* p = f.w + r * f.w_stride;
  const int64_t full = std::min(s0 + n, f.full_steps());
  int64_t s = s0;
  for (; s + 2 <= full; s += 2)
    _mm512_storeu_ps(dst + (s - s0) * LANES, fp8_decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + s * LANES))));
  for (; s < s0 + n; ++s) vstore(dst + (s - s0) * LANES, s < full ? f.step_full(r, s) : f.step_tail(r, s));
}
template <Dense K>
inline void wb_decode(const DenseRows<K>& f, int64_t r, int64_t s0, int64_t n, float* dst, float*) {
  const auto* p = f.w + r * f.w_stride;
  const int64_t full = std::min(s0 + n, f.full_steps());
  int64_t s = s0;
  for (; s + 2 <= full; s += 2) {
    if constexpr (K == Dense::F32) {
      _mm512_storeu_ps(dst + (s - s0) * LANES, _mm512_loadu_ps(p + s * LANES));
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + s * LANES));
      if constexpr (K == Dense::FP16) {
        _mm512_storeu_ps(dst + (s - s0) * LANES, _mm512_cvtph_ps(h));
      } else {
        _mm512_storeu_ps(dst + (s - s0) * LANES, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      }
    }
  }
  for (; s < s0 + n; ++s) vstore(dst + (s - s0) * LANES, s < full ? f.step_full(r, s) : f.step_tail(r, s));
}
inline void wb_decode(const NVFP4Rows& f, int64_t r, int64_t s0, int64_t n, float* dst, float* bs) {
  const int64_t g = s0 / 16, ng = n / 16, nb = f.blocks();
  if (ng == 2 && (g + 2) * LANES <= nb) {
    const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                        -2.0f, -3.0f, -4.0f, -6.0f);
    const uint8_t* p = f.packed + r * f.p_stride + g * LANES;
    for (int64_t k = 0; k < LANES; ++k) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k * nb)));
      _mm512_storeu_ps(dst + (2 * k) * 2 * LANES, _mm512_permutexvar_ps(v, table));  // vpermps: the low 4 bits
      _mm512_storeu_ps(dst + (2 * k + 1) * 2 * LANES, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
    }
    _mm512_storeu_ps(bs, fp8_decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.bscale + r * f.bs_stride + g * LANES))));
    return;
  }
  alignas(64) float tmp[16 * LANES];
  for (int64_t j = 0; j < ng; ++j) {  // a partial group, or a last single one
    f.decode(r, s0 + j * 16, 16, tmp, bs + j * LANES);
    for (int64_t t = 0; t < 16; ++t) std::memcpy(dst + (t * 2 + j) * LANES, tmp + t * LANES, LANES * sizeof(float));
  }
}

// The lines of weight row r's K-chunk from step s. NVFP4: a row is 8 runs (byte k of every block) and
// its block scales, a 64-byte line of each serving 8 groups: at s = 0 the first two lines of each, at
// every 8th group the line after the current one.
template <class F>
inline void wb_prefetch(const F& f, int64_t r, int64_t s) {
  if constexpr (F::kGroupScaled) {
    const int64_t g = s / 16;
    if (g % 8) return;
    const uint8_t* run = f.packed + r * f.p_stride + g * LANES;
    const uint8_t* sc = f.bscale + r * f.bs_stride + g * LANES;
    for (int64_t k = 0; k < LANES; ++k) {
      if (g == 0) prefetch_runs(run + k * f.blocks());
      prefetch_runs(run + k * f.blocks() + 64);
    }
    if (g == 0) prefetch_runs(sc);
    prefetch_runs(sc + 64);
  } else {
    constexpr int64_t bytes = WB_CHUNK * LANES * static_cast<int64_t>(sizeof(*f.w));
    const char* p = reinterpret_cast<const char*>(f.w + r * f.w_stride + s * LANES);
    for (int64_t i = 0; i < bytes; i += 64) prefetch(p + i);
  }
}

#if TRTVOCAB_DPBF16
// ---- AVX-512 BF16, batch >= 9: the tile kernel with two chain steps per vdpbf16ps ----------------------
// The same tiles, passes and chains as above, where every x row fits (x_fits_bf16) and the weights are FP8
// or NVFP4 (exact in bf16): the decoded tile is packed into bf16 step pairs ([pair][8], NVFP4 [pair][group][8];
// lane l: step 2t in the high word, 2t + 1 in the low one, an odd last step paired with a zero step) and
// x into [block][pair][row pair][16], and the micro kernels run one vdpbf16ps where the FMA kernels run two:
// the two FMAs of each chain, bitwise ("AVX-512 BF16" above). A zero step adds fma(0, x, acc) = acc (x is
// finite), or a zero of another sign where acc is zero, which the finish's + 0 makes +0 either way.

// wb_layout's blocks as bf16 pairs: block i at xt + i * pairs * WB_ROWS * 8, pair t of row pair j at
// + (t * np + j) * 16: lanes 0-7 row 2j, 8-15 row 2j + 1 (rows past nb and the step past `steps`: zeros).
inline void wb_layout_bf16(const float* x, int64_t xs, int64_t b0, int64_t nb, int64_t steps, uint32_t* xt) {
  const int64_t pairs = (steps + 1) / 2;
  for (int64_t i = 0; i * WB_ROWS < nb; ++i) {
    const int64_t r0 = i * WB_ROWS, nr = std::min(WB_ROWS, nb - r0), np = (nr + 1) / 2;
    uint32_t* blk = xt + i * pairs * WB_ROWS * LANES;
    for (int64_t t = 0; t < pairs; ++t)
      for (int64_t r = 0; r < 2 * np; ++r) {
        uint32_t* dst = blk + t * np * 16 + r * LANES;
        for (int64_t l = 0; l < LANES; ++l) {
          uint32_t hi = 0, lo = 0;
          if (r < nr) {
            const float* row = x + (b0 + r0 + r) * xs;
            std::memcpy(&hi, row + 2 * t * LANES + l, 4);
            if (2 * t + 1 < steps) std::memcpy(&lo, row + (2 * t + 1) * LANES + l, 4);
          }
          dst[l] = (hi & 0xFFFF0000u) | (lo >> 16);
        }
      }
  }
}

// A tile row's decoded steps [0, n) (wb_decode's [step][m][8], m = 1, or 2 NVFP4 groups) as bf16 pairs
// [pair][m][8]; an odd n is paired with a zero step.
inline void wb_pack_bf16(const float* w, int64_t n, int m, uint32_t* dst) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t t = 0; 2 * t < n; ++t)
    for (int g = 0; g < m; ++g) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (2 * t * m + g) * LANES));
      const __m256i b = 2 * t + 1 < n
                            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + ((2 * t + 1) * m + g) * LANES))
                            : _mm256_setzero_si256();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (t * m + g) * LANES),
                          _mm256_or_si256(_mm256_and_si256(a, high), _mm256_srli_epi32(b, 16)));
    }
}

// Steps [s0, s0 + n) of weight row r straight into bf16 pairs ([pair][8], NVFP4 [pair][2 groups][8]) where
// the chunk is whole (FP8: full steps, n a multiple of 4: fp8_pairs_bf16 on pairs t, t + 1 of the row;
// NVFP4: two full groups, E2m1Lanes per k, block scales as wb_decode), else wb_decode into wt (float32
// scratch) and wb_pack_bf16: the same values either way (fp8_pairs_bf16's tables are fp8_decode8's bits).
inline void wb_decode_bf16(const FP8Rows& f, int64_t r, int64_t s0, int64_t n, uint32_t* dst, float* bs, float* wt) {
  if (n % 4 == 0 && s0 + n <= f.full_steps()) {
    const Fp8Bf16Tables& t = fp8_bf16_tables();
    const uint8_t* p = f.w + r * f.w_stride + s0 * LANES;
    for (int64_t s = 0; s < n; s += 4)
      _mm512_storeu_ps(reinterpret_cast<float*>(dst + (s / 2) * LANES), fp8_pairs_bf16(p + s * LANES, p + (s + 2) * LANES, t));
    return;
  }
  wb_decode(f, r, s0, n, wt, bs);
  wb_pack_bf16(wt, n, 1, dst);
}
inline void wb_decode_bf16(const NVFP4Rows& f, int64_t r, int64_t s0, int64_t n, uint32_t* dst, float* bs, float* wt) {
  const int64_t g = s0 / 16, nb = f.blocks();
  if (n == 32 && (g + 2) * LANES <= nb) {
    const E2m1Lanes decode;
    const uint8_t* p = f.packed + r * f.p_stride + g * LANES;
    for (int64_t k = 0; k < LANES; ++k) _mm512_storeu_ps(reinterpret_cast<float*>(dst + k * 2 * LANES), decode(p + k * nb));
    _mm512_storeu_ps(bs, fp8_decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.bscale + r * f.bs_stride + g * LANES))));
    return;
  }
  wb_decode(f, r, s0, n, wt, bs);
  wb_pack_bf16(wt, 16, 2, dst);
}

// wb_micro by vdpbf16ps: `pairs` step pairs of NV packed tile rows (row v: w + v * ws) against NP row pairs
// (pair t of row pair j: x + t * x_pair + j * 16).
template <int NP, int NV>
inline void wb_micro_bf16(const uint32_t* x, int64_t x_pair, const uint32_t* w, int64_t ws, int64_t pairs, float* acc,
                          int64_t acc_v, const float*) {
  __m512 a[NV][NP];
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NP; ++j) a[v][j] = _mm512_loadu_ps(acc + v * acc_v + j * 16);
  for (int64_t t = 0; t < pairs; ++t) {
    __m512 xv[NP];
    for (int j = 0; j < NP; ++j) xv[j] = _mm512_castsi512_ps(_mm512_loadu_si512(x + t * x_pair + j * 16));
    for (int v = 0; v < NV; ++v) {
      const __m512 wv = bcast_pair(w + v * ws + t * LANES);
      for (int j = 0; j < NP; ++j) a[v][j] = dpbf16(a[v][j], wv, xv[j]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(acc + v * acc_v + j * 16, a[v][j]);
}

// wb_micro_gs by vdpbf16ps: a group is 8 step pairs of the packed tile ([pair][2 groups][8]).
template <int NP, int NV>
__attribute__((noinline)) void wb_micro_gs_bf16(const uint32_t* x, int64_t x_pair, const uint32_t* w, int64_t ws,
                                                int64_t pairs, float* acc, int64_t acc_v, const float* bs) {
  __m512 a[NV][NP];
  for (int64_t g = 0; g * 8 < pairs; ++g) {
    for (int v = 0; v < NV; ++v)
      for (int j = 0; j < NP; ++j) a[v][j] = _mm512_setzero_ps();
    const uint32_t* xg = x + g * 8 * x_pair;
    const uint32_t* wg = w + g * LANES;
    for (int64_t t = 0; t < 8; ++t) {
      __m512 xv[NP];
      for (int j = 0; j < NP; ++j) xv[j] = _mm512_castsi512_ps(_mm512_loadu_si512(xg + t * x_pair + j * 16));
      for (int v = 0; v < NV; ++v) {
        const __m512 wv = bcast_pair(wg + v * ws + t * 2 * LANES);
        for (int j = 0; j < NP; ++j) a[v][j] = dpbf16(a[v][j], wv, xv[j]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m512 b = _mm512_broadcast_f32x8(_mm256_loadu_ps(bs + (v * (WB_CHUNK / 16) + g) * LANES));
      for (int j = 0; j < NP; ++j) {
        float* p = acc + v * acc_v + j * 16;
        _mm512_storeu_ps(p, _mm512_fmadd_ps(a[v][j], b, _mm512_loadu_ps(p)));
      }
    }
  }
}

template <int NV, bool GS>
inline void wb_micro_np_bf16(int64_t np, const uint32_t* x, int64_t x_pair, const uint32_t* w, int64_t ws,
                             int64_t pairs, float* acc, int64_t acc_v, const float* bs) {
  static_assert(WB_NP == 4, "the cases below");
  auto call = [&](auto npc) {
    constexpr int NP = decltype(npc)::value;
    if constexpr (GS) {
      wb_micro_gs_bf16<NP, NV>(x, x_pair, w, ws, pairs, acc, acc_v, bs);
    } else {
      wb_micro_bf16<NP, NV>(x, x_pair, w, ws, pairs, acc, acc_v, bs);
    }
  };
  switch (np) {
    case 4: call(std::integral_constant<int, 4>{}); break;
    case 3: call(std::integral_constant<int, 3>{}); break;
    case 2: call(std::integral_constant<int, 2>{}); break;
    default: call(std::integral_constant<int, 1>{}); break;
  }
}

template <bool GS>
inline void wb_micro_any_bf16(int64_t nv, int64_t np, const uint32_t* x, int64_t x_pair, const uint32_t* w,
                              int64_t ws, int64_t pairs, float* acc, int64_t acc_v, const float* bs) {
  static_assert(WB_NV == 6, "the cases below");
  switch (nv) {
    case 6: wb_micro_np_bf16<6, GS>(np, x, x_pair, w, ws, pairs, acc, acc_v, bs); break;
    case 5: wb_micro_np_bf16<5, GS>(np, x, x_pair, w, ws, pairs, acc, acc_v, bs); break;
    case 4: wb_micro_np_bf16<4, GS>(np, x, x_pair, w, ws, pairs, acc, acc_v, bs); break;
    case 3: wb_micro_np_bf16<3, GS>(np, x, x_pair, w, ws, pairs, acc, acc_v, bs); break;
    case 2: wb_micro_np_bf16<2, GS>(np, x, x_pair, w, ws, pairs, acc, acc_v, bs); break;
    default: wb_micro_np_bf16<1, GS>(np, x, x_pair, w, ws, pairs, acc, acc_v, bs); break;
  }
}
#endif  // TRTVOCAB_DPBF16

// BF: the vdpbf16ps micro kernels on bf16 pairs of the tile and of x (FP8 / NVFP4 where x fits).
template <bool BF, class F>
void wide_batched(const F& f, const float* x, int64_t n_rows, int64_t xs, int64_t rows, float* out, int64_t os) {
  constexpr bool GS = F::kGroupScaled;
  const int64_t steps = f.steps();
  const int64_t tiles = (rows + WB_TILE - 1) / WB_TILE;
  const int64_t passes = (n_rows + WB_PASS - 1) / WB_PASS;  // of equal size
  const int64_t pass = (n_rows + passes - 1) / passes;
  const int64_t ws = WB_CHUNK * LANES;
  const int64_t pairs = (steps + 1) / 2;
  // The f32 layout's size holds the bf16 one (half of it).
  Floats xt(static_cast<size_t>(((pass + WB_ROWS - 1) / WB_ROWS) * WB_ROWS * steps * LANES));
  uint32_t* xtb = reinterpret_cast<uint32_t*>(xt.data());
  for (int64_t b0 = 0; b0 < n_rows; b0 += pass) {
    const int64_t nb = std::min(pass, n_rows - b0), blocks = (nb + WB_ROWS - 1) / WB_ROWS;
    const int64_t acc_v = blocks * WB_ROWS * LANES;  // floats per weight row's chains
#if TRTVOCAB_DPBF16
    if constexpr (BF) {
      wb_layout_bf16(x, xs, b0, nb, steps, xtb);
    } else {
      wb_layout(x, xs, b0, nb, steps, xt.data());
    }
#else
    wb_layout(x, xs, b0, nb, steps, xt.data());
#endif
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      Floats wt(static_cast<size_t>(WB_TILE * ws)), acc(static_cast<size_t>(WB_TILE * acc_v)),
          wtb(static_cast<size_t>(BF ? WB_TILE * ws / 2 : 0));
      alignas(64) float bs[WB_TILE * (WB_CHUNK / 16) * LANES];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t v0 = t * WB_TILE, tr = std::min(WB_TILE, rows - v0);
        std::fill(acc.data(), acc.data() + WB_TILE * acc_v, 0.0f);
        for (int64_t s0 = 0; s0 < steps; s0 += WB_CHUNK) {
          const int64_t ks = std::min(WB_CHUNK, steps - s0);
          for (int64_t v = 0; v < tr; ++v) {
            if (s0 + WB_CHUNK < steps) {
              wb_prefetch(f, v0 + v, s0 + WB_CHUNK);
            } else if (v0 + WB_TILE + v < rows) {
              wb_prefetch(f, v0 + WB_TILE + v, 0);  // the next tile's first chunk
            }
#if TRTVOCAB_DPBF16
            if constexpr (BF) {
              wb_decode_bf16(f, v0 + v, s0, ks, reinterpret_cast<uint32_t*>(wtb.data()) + v * ws / 2,
                             bs + v * (WB_CHUNK / 16) * LANES, wt.data() + v * ws);
              continue;
            }
#endif
            wb_decode(f, v0 + v, s0, ks, wt.data() + v * ws, bs + v * (WB_CHUNK / 16) * LANES);
          }
          for (int64_t i = 0; i < blocks; ++i) {
            const int64_t np = (std::min(WB_ROWS, nb - i * WB_ROWS) + 1) / 2;
            float* acc_i = acc.data() + i * WB_ROWS * LANES;
            for (int64_t v = 0; v < tr; v += WB_NV) {
              const int64_t nv = std::min<int64_t>(WB_NV, tr - v);
              const float* bsv = bs + v * (WB_CHUNK / 16) * LANES;
#if TRTVOCAB_DPBF16
              if constexpr (BF) {
                const uint32_t* xb = xtb + i * pairs * WB_ROWS * LANES + (s0 / 2) * np * 16;
                wb_micro_any_bf16<GS>(nv, np, xb, np * 16, reinterpret_cast<const uint32_t*>(wtb.data()) + v * ws / 2,
                                      ws / 2, (ks + 1) / 2, acc_i + v * acc_v, acc_v, bsv);
                continue;
              }
#endif
              const float* xb = xt.data() + i * steps * WB_ROWS * LANES + s0 * np * 16;
              wb_micro_any<GS>(nv, np, xb, np * 16, wt.data() + v * ws, ws, ks, acc_i + v * acc_v, acc_v, bsv);
            }
          }
        }
        for (int64_t v = 0; v < tr; ++v) {
          const float scale = f.row_scale(v0 + v);
          for (int64_t n = 0; n < nb; ++n)
            out[(b0 + n) * os + v0 + v] = finish(vload(acc.data() + v * acc_v + n * LANES), scale, F::kUnbias);
        }
      }
    });
  }
}

// Batch >= 9: the vdpbf16ps tile kernel where it runs (FP8 / NVFP4, x fits), else the FMA one.
template <class F>
void wide_batched(const F& f, const float* x, int64_t n_rows, int64_t xs, int64_t rows, float* out, int64_t os) {
#if TRTVOCAB_DPBF16
  if constexpr (std::is_same_v<F, FP8Rows> || F::kGroupScaled) {
    if (use_dpbf16() && x_fits_bf16(x, n_rows, xs, f.steps() * LANES)) {
      wide_batched<true>(f, x, n_rows, xs, rows, out, os);
      return;
    }
  }
#endif
  wide_batched<false>(f, x, n_rows, xs, rows, out, os);
}
#endif

template <class F>
int run(const F& f, const float* x, int64_t n_rows, int64_t x_stride, int64_t rows, float* out, int64_t out_stride) {
  try {
    if (rows <= 0 || n_rows <= 0) return 0;
#if TRTVOCAB_AVX512
    switch (n_rows) {
      case 1: wide<1>(f, x, x_stride, rows, out, out_stride); return 0;
      case 2: wide<2>(f, x, x_stride, rows, out, out_stride); return 0;
      case 3: wide<3>(f, x, x_stride, rows, out, out_stride); return 0;
      case 4: wide<4>(f, x, x_stride, rows, out, out_stride); return 0;
      case 5: wide<5>(f, x, x_stride, rows, out, out_stride); return 0;
      case 6: wide<6>(f, x, x_stride, rows, out, out_stride); return 0;
      case 7: wide<7>(f, x, x_stride, rows, out, out_stride); return 0;
      case 8: wide<8>(f, x, x_stride, rows, out, out_stride); return 0;
      default: wide_batched(f, x, n_rows, x_stride, rows, out, out_stride); return 0;
    }
#endif
    switch (n_rows) {
      case 1: gemv(f, x, rows, out); break;
      case 2: direct<2>(f, x, x_stride, rows, out, out_stride); break;
      case 3: direct<3>(f, x, x_stride, rows, out, out_stride); break;
      case 4: direct<4>(f, x, x_stride, rows, out, out_stride); break;
      case 5: direct<5>(f, x, x_stride, rows, out, out_stride); break;
      case 6: direct<6>(f, x, x_stride, rows, out, out_stride); break;
      case 7: direct<7>(f, x, x_stride, rows, out, out_stride); break;
      case 8: direct<8>(f, x, x_stride, rows, out, out_stride); break;
      default: batched(f, x, n_rows, x_stride, rows, out, out_stride); break;
    }
    return 0;
  } catch (...) {
    return 1;
  }
}

}  // namespace

extern "C" {

// Bumped whenever a signature below changes (the Python side checks it).
int trtvocab_fused_abi() { return 3; }

// The bandwidth probe of benchmarks/bandwidth.py: reads `nbytes` (a multiple of 256) from p with
// at::parallel_for (the heads' threads), 8 independent 32-byte accumulators per thread, and
// returns a checksum (so the reads cannot be dropped). A STREAM-like "read" kernel.
uint64_t trtvocab_read_probe(const uint8_t* p, int64_t nbytes) {
  const int64_t blocks = nbytes / 256;
  std::vector<uint64_t> sums(static_cast<size_t>(at::get_num_threads()) + 1, 0);
  at::parallel_for(0, blocks, 1024, [&](int64_t b0, int64_t b1) {
    uint64_t total = 0;
#if TRTVOCAB_AVX2
    __m256i a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_si256();
    for (int64_t b = b0; b < b1; ++b) {
      const __m256i* q = reinterpret_cast<const __m256i*>(p + b * 256);
      for (int i = 0; i < 8; ++i) a[i] = _mm256_add_epi64(a[i], _mm256_loadu_si256(q + i));
    }
    alignas(32) uint64_t t[4];
    for (int i = 1; i < 8; ++i) a[0] = _mm256_add_epi64(a[0], a[i]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), a[0]);
    total = t[0] + t[1] + t[2] + t[3];
#else
    uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* q = p + b * 256;
      for (int i = 0; i < 32; ++i) {
        uint64_t v;
        std::memcpy(&v, q + 8 * i, 8);
        a[i % 8] += v;
      }
    }
    for (int i = 0; i < 8; ++i) total += a[i];
#endif
    sums[static_cast<size_t>(at::get_thread_num())] += total;
  });
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  return total;
}

// Which lane implementation this build uses: 3 = AVX-512 (F, BW, VL, DQ) kernels at every batch (the
// AVX2 8-lane code for their tails and the finish), 2 = AVX2 + FMA + F16C, 0 = portable C++.
int trtvocab_fused_isa() { return TRTVOCAB_AVX512 ? 3 : (TRTVOCAB_AVX2 ? 2 : 0); }

// 1: this build has the vdpbf16ps kernels (AVX-512 BF16 + VBMI), vdpbf16ps is the two FMAs on this CPU
// (dpbf16_matches_fma) and they are on (use_dpbf16): FP8 / NVFP4 heads whose x fits
// (x_fits_bf16) run them; else 0.
int trtvocab_fused_dpbf16() {
#if TRTVOCAB_DPBF16
  return use_dpbf16() ? 1 : 0;
#else
  return 0;
#endif
}

// Turn the vdpbf16ps kernels on (1: wherever they match the FMAs), off (0), or back to this CPU's default
// (-1: where they are faster, dpbf16_pays_here); returns trtvocab_fused_dpbf16(). The logits are the same
// bits either way: for the tests and benchmarks.
int trtvocab_fused_set_dpbf16(int mode) {
#if TRTVOCAB_DPBF16
  dpbf16_mode.store(mode < 0 ? -1 : (mode > 0 ? 1 : 0), std::memory_order_relaxed);
#else
  (void)mode;
#endif
  return trtvocab_fused_dpbf16();
}

// Whether x [n][len] (row stride xs) fits the vdpbf16ps kernels (x_fits_bf16: 1 / 0); -1 where this build
// has none. For the tests.
int trtvocab_fused_x_fits_bf16(const float* x, int64_t n, int64_t xs, int64_t len) {
#if TRTVOCAB_DPBF16
  return x_fits_bf16(x, n, xs, len) ? 1 : 0;
#else
  (void)x, (void)n, (void)xs, (void)len;
  return -1;
#endif
}

// out[n * out_stride + r] = sum_k x[n * x_stride + k] * e4m3(w[r * w_stride + k]) * scale[r * scale_stride]
// x: float32 [n_rows, x_stride], zero-padded past `hidden` to a multiple of 8 columns.
int trtvocab_fp8_logits(const float* x, int64_t n_rows, int64_t x_stride, int64_t hidden, const uint8_t* w,
                        int64_t rows, int64_t w_stride, const float* scale, int64_t scale_stride, float* out,
                        int64_t out_stride) {
  FP8Rows f{w, w_stride, hidden, scale, scale_stride};
  return run(f, x, n_rows, x_stride, rows, out, out_stride);
}

// out[n * out_stride + r] = sum_k x[n * x_stride + k] * w[r * w_stride + k], w bf16 (kind 0), fp16 (1) or
// float32 (2); x: float32 [n_rows, x_stride], zero-padded past `hidden` to a multiple of 8 columns.
int trtvocab_dense_logits(const float* x, int64_t n_rows, int64_t x_stride, int64_t hidden, const void* w,
                          int64_t rows, int64_t w_stride, int kind, float* out, int64_t out_stride) {
  if (kind < 0 || kind > 2) return 2;  // not a kind this build knows
  if (kind == 2) {
    DenseRows<Dense::F32> f{static_cast<const float*>(w), w_stride, hidden};
    return run(f, x, n_rows, x_stride, rows, out, out_stride);
  }
  const auto* h = static_cast<const uint16_t*>(w);
  if (kind == 1) {
    DenseRows<Dense::FP16> f{h, w_stride, hidden};
    return run(f, x, n_rows, x_stride, rows, out, out_stride);
  }
  DenseRows<Dense::BF16> f{h, w_stride, hidden};
  return run(f, x, n_rows, x_stride, rows, out, out_stride);
}

// out[n * out_stride + r] = sum_k x[k] * e2m1(code k of row r) * e4m3(block scale) * global_scale
// packed: block-major uint8 [rows, hidden / 2]; bscale: e4m3 bytes [rows, hidden / 16];
// x: float32 [n_rows, x_stride] in the kernel's step order (trtvocab.kernels.nvfp4_x).
int trtvocab_nvfp4_logits(const float* x, int64_t n_rows, int64_t x_stride, int64_t hidden, const uint8_t* packed,
                          int64_t rows, int64_t p_stride, const uint8_t* bscale, int64_t bs_stride,
                          float global_scale, float* out, int64_t out_stride) {
  NVFP4Rows f{packed, p_stride, hidden, bscale, bs_stride, global_scale};
  return run(f, x, n_rows, x_stride, rows, out, out_stride);
}

}  // extern "C"
