// GGUF block kernels (Q8_0, Q6_K) of trtvocab's GGUF heads: x [N, H] float32 times the stored rows.
//
// Built into the same library as fused.cpp (trtvocab/kernels/build.py); called through ctypes
// (trtvocab/kernels/gemm.py, gguf_logits). Threads: at::parallel_for (torch's intra-op pool).
//
// The chain (trtvocab/quant/gguf_blocks.py computes the same bits with torch ops): a weight is
// gguf.quants.dequantize's value, Q8_0 q * d, Q6_K (d * sc) * q, each a float32 product (exact: at
// most 24 significant bits); logit (n, v):
//   acc[8] = 0;  for step s = 0 .. H/8 - 1:  acc = acc + w_s * x_s     (a rounded product, a rounded sum)
//   logit  = (((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))) + 0
// Never an FMA (-ffp-contract=off; the intrinsics are explicit mul and add), so the portable C++
// build computes the same bits as the AVX2 and AVX-512 ones. The AVX-512 kernel keeps two 8-lane
// chains per zmm (two weight rows), never one 16-lane chain. A logit's chain is the same for any
// batch, row range or tile: bitwise batch-, partition- and tp-invariant.

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GGUF_AVX2 1
#else
#define GGUF_AVX2 0
#endif
#if GGUF_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define GGUF_AVX512 1
#else
#define GGUF_AVX512 0
#endif

namespace {

constexpr int Q8_BYTES = 34;   // fp16 d, 32 int8 q
constexpr int Q6_BYTES = 210;  // ql[128], qh[64], int8 scales[16], fp16 d
constexpr int64_t ROW_BLOCK = 32;  // rows every x group of a batch > 8 meets in cache

// One group of at most 8 x rows against weight rows [r0, r1) (rows_*_nb<KIND, NB>, NB = the group's size).
using GroupFn = void (*)(const float* x, int64_t xs, int64_t chunks, const uint8_t* w, int64_t r0, int64_t r1,
                         int64_t ws, float* out, int64_t os);

// Blocks of ROW_BLOCK rows, every group of 8 x rows over a block while it is in cache: the weight is read
// from memory once per call at any batch. ``groups[k]`` runs a group of k + 1 rows.
inline void row_blocks(const GroupFn* groups, const float* x, int64_t n, int64_t xs, int64_t hidden,
                       const uint8_t* w, int64_t r0, int64_t r1, int64_t ws, float* out, int64_t os) {
  const int64_t chunks = hidden / 32;
  for (int64_t b0 = r0; b0 < r1; b0 += ROW_BLOCK) {
    const int64_t b1 = b0 + ROW_BLOCK < r1 ? b0 + ROW_BLOCK : r1;
    for (int64_t n0 = 0; n0 < n; n0 += 8) {
      const int64_t group = n - n0 < 8 ? n - n0 : 8;
      groups[group - 1](x + n0 * xs, xs, chunks, w, b0, b1, ws, out + n0 * os, os);
    }
  }
}

// An fp16 number as float32 (exact, subnormals, inf and NaN included).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
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

// The 32 weights of chunk k (elements 32k .. 32k + 31) of a row, as float32 (portable decode).
template <int KIND>
inline void decode32(const uint8_t* row, int64_t k, float* w) {
  if (KIND == 0) {
    const uint8_t* blk = row + k * Q8_BYTES;
    const float d = half_to_float(blk);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
  } else {
    const uint8_t* blk = row + (k >> 3) * Q6_BYTES;
    const int sub = static_cast<int>(k & 7), half = sub >> 2, c = sub & 3;
    const float d = half_to_float(blk + 208);
    const float ds[2] = {d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * sub])),
                         d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * sub + 1]))};
    const uint8_t* ql = blk + half * 64 + (c & 1) * 32;
    const uint8_t* qh = blk + 128 + half * 32;
    for (int j = 0; j < 32; ++j) {
      const int lo = (ql[j] >> (4 * (c >> 1))) & 0x0f, hi = (qh[j] >> (2 * c)) & 0x03;
      w[j] = ds[j >> 4] * static_cast<float>((lo | (hi << 4)) - 32);
    }
  }
}

inline float tree8(const float* a) {
  return (((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))) + 0.0f;
}

// Portable: NB x rows against one weight row, chunk by chunk.
template <int KIND>
void rows_portable(const float* x, int64_t n, int64_t xs, int64_t hidden, const uint8_t* w, int64_t r0, int64_t r1,
                   int64_t ws, float* out, int64_t os) {
  const int64_t chunks = hidden / 32;
  float wv[32];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t n0 = 0; n0 < n; n0 += 8) {
      const int nb = static_cast<int>(n - n0 < 8 ? n - n0 : 8);
      float acc[8][8] = {};
      const uint8_t* row = w + r * ws;
      for (int64_t at = 0; at < ws; at += 64) __builtin_prefetch(row + 2 * ws + at);
      for (int64_t k = 0; k < chunks; ++k) {
        decode32<KIND>(row, k, wv);
        for (int b = 0; b < nb; ++b) {
          const float* xr = x + (n0 + b) * xs + 32 * k;
          for (int t = 0; t < 4; ++t)
            for (int l = 0; l < 8; ++l) {
              const float p = wv[8 * t + l] * xr[8 * t + l];
              acc[b][l] = acc[b][l] + p;
            }
        }
      }
      for (int b = 0; b < nb; ++b) out[(n0 + b) * os + r] = tree8(acc[b]);
    }
  }
}

#if GGUF_AVX2
inline float hsum_tree(__m256 v) {
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  return tree8(a);
}

inline __m256 cvt8(__m128i bytes8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8)); }

// The 4 steps of chunk k of a row as float32 (AVX2 decode, bitwise decode32's).
template <int KIND>
inline void decode32_avx2(const uint8_t* row, int64_t k, __m256* w) {
  if (KIND == 0) {
    const uint8_t* blk = row + k * Q8_BYTES;
    const __m256 d = _mm256_set1_ps(half_to_float(blk));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_mul_ps(cvt8(lo), d);
    w[1] = _mm256_mul_ps(cvt8(_mm_srli_si128(lo, 8)), d);
    w[2] = _mm256_mul_ps(cvt8(hi), d);
    w[3] = _mm256_mul_ps(cvt8(_mm_srli_si128(hi, 8)), d);
  } else {
    const uint8_t* blk = row + (k >> 3) * Q6_BYTES;
    const int sub = static_cast<int>(k & 7), half = sub >> 2, c = sub & 3;
    const float d = half_to_float(blk + 208);
    const __m256 ds0 = _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * sub])));
    const __m256 ds1 = _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * sub + 1])));
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + half * 64 + (c & 1) * 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + half * 32));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (c >> 1))), _mm256_set1_epi8(0x0f));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), _mm256_set1_epi8(0x03));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_mul_ps(ds0, cvt8(q0));
    w[1] = _mm256_mul_ps(ds0, cvt8(_mm_srli_si128(q0, 8)));
    w[2] = _mm256_mul_ps(ds1, cvt8(q1));
    w[3] = _mm256_mul_ps(ds1, cvt8(_mm_srli_si128(q1, 8)));
  }
}

// RR weight rows x NB x rows in registers (RR * NB <= 8 chains), one pass over the chunks.
template <int KIND, int RR, int NB>
inline void tile_avx2(const float* x, int64_t xs, int64_t chunks, const uint8_t* row0, int64_t ws, float* out,
                      int64_t os) {
  __m256 acc[RR][NB];
  for (int r = 0; r < RR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_setzero_ps();
  __m256 w[4];
  // The tile after next (its RR rows are one contiguous range): one line per decoded chunk, ahead of use.
  const uint8_t* ahead = row0 + 2 * RR * ws;
  const int64_t ahead_lines = (RR * ws + 63) / 64;
  int64_t line = 0;
  for (int64_t k = 0; k < chunks; ++k) {
    for (int r = 0; r < RR; ++r) {
      if (line < ahead_lines) _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line++), _MM_HINT_T0);
      decode32_avx2<KIND>(row0 + r * ws, k, w);
      for (int t = 0; t < 4; ++t)
        for (int b = 0; b < NB; ++b) {
          const __m256 xv = _mm256_loadu_ps(x + b * xs + 32 * k + 8 * t);
          acc[r][b] = _mm256_add_ps(acc[r][b], _mm256_mul_ps(w[t], xv));
        }
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int b = 0; b < NB; ++b) out[b * os + r] = hsum_tree(acc[r][b]);
}

template <int KIND, int NB>
void rows_avx2_nb(const float* x, int64_t xs, int64_t chunks, const uint8_t* w, int64_t r0, int64_t r1, int64_t ws,
                  float* out, int64_t os) {
  constexpr int RR = NB == 1 ? 8 : NB == 2 ? 4 : NB <= 4 ? 2 : 1;
  int64_t r = r0;
  for (; r + RR <= r1; r += RR) tile_avx2<KIND, RR, NB>(x, xs, chunks, w + r * ws, ws, out + r, os);
  for (; r < r1; ++r) tile_avx2<KIND, 1, NB>(x, xs, chunks, w + r * ws, ws, out + r, os);
}

template <int KIND>
void rows_avx2(const float* x, int64_t n, int64_t xs, int64_t hidden, const uint8_t* w, int64_t r0, int64_t r1,
               int64_t ws, float* out, int64_t os) {
  static constexpr GroupFn groups[8] = {rows_avx2_nb<KIND, 1>, rows_avx2_nb<KIND, 2>, rows_avx2_nb<KIND, 3>,
                                        rows_avx2_nb<KIND, 4>, rows_avx2_nb<KIND, 5>, rows_avx2_nb<KIND, 6>,
                                        rows_avx2_nb<KIND, 7>, rows_avx2_nb<KIND, 8>};
  row_blocks(groups, x, n, xs, hidden, w, r0, r1, ws, out, os);
}
#endif

#if GGUF_AVX512
// Two weight rows per zmm: the low 8 lanes are row a's chain, the high 8 row b's (never one 16-lane chain).
inline __m512 pair(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }

template <int KIND, int RP, int NB>
inline void tile_avx512(const float* x, int64_t xs, int64_t chunks, const uint8_t* row0, int64_t ws, float* out,
                        int64_t os) {
  __m512 acc[RP][NB];
  for (int p = 0; p < RP; ++p)
    for (int b = 0; b < NB; ++b) acc[p][b] = _mm512_setzero_ps();
  __m256 wa[4], wb[4];
  const uint8_t* ahead = row0 + 4 * RP * ws;  // the tile after next, as in tile_avx2
  const int64_t ahead_lines = (2 * RP * ws + 63) / 64;
  int64_t line = 0;
  for (int64_t k = 0; k < chunks; ++k) {
    for (int p = 0; p < RP; ++p) {
      for (int i = 0; i < 2 && line < ahead_lines; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line++), _MM_HINT_T0);
      decode32_avx2<KIND>(row0 + (2 * p) * ws, k, wa);
      decode32_avx2<KIND>(row0 + (2 * p + 1) * ws, k, wb);
      for (int t = 0; t < 4; ++t) {
        const __m512 wv = pair(wa[t], wb[t]);
        for (int b = 0; b < NB; ++b) {
          const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + b * xs + 32 * k + 8 * t));
          acc[p][b] = _mm512_add_ps(acc[p][b], _mm512_mul_ps(wv, xv));
        }
      }
    }
  }
  for (int p = 0; p < RP; ++p)
    for (int b = 0; b < NB; ++b) {
      out[b * os + 2 * p] = hsum_tree(_mm512_castps512_ps256(acc[p][b]));
      out[b * os + 2 * p + 1] = hsum_tree(_mm512_extractf32x8_ps(acc[p][b], 1));
    }
}

// Batches 1-4 run the AVX2 tiles (their decode, not the multiply, sets the pace: Q8_0 B = 1 measured 2.0 ms
// against 3.4 for row pairs, 32768 x 640, one thread); 5-8 one row pair against every x row.
template <int KIND, int NB>
void rows_avx512_nb(const float* x, int64_t xs, int64_t chunks, const uint8_t* w, int64_t r0, int64_t r1, int64_t ws,
                    float* out, int64_t os) {
  if (NB <= 4) return rows_avx2_nb<KIND, NB>(x, xs, chunks, w, r0, r1, ws, out, os);
  constexpr int RP = 1;
  int64_t r = r0;
  for (; r + 2 * RP <= r1; r += 2 * RP) tile_avx512<KIND, RP, NB>(x, xs, chunks, w + r * ws, ws, out + r, os);
  for (; r < r1; ++r) tile_avx2<KIND, 1, NB>(x, xs, chunks, w + r * ws, ws, out + r, os);
}

template <int KIND>
void rows_avx512(const float* x, int64_t n, int64_t xs, int64_t hidden, const uint8_t* w, int64_t r0, int64_t r1,
                 int64_t ws, float* out, int64_t os) {
  static constexpr GroupFn groups[8] = {rows_avx512_nb<KIND, 1>, rows_avx512_nb<KIND, 2>, rows_avx512_nb<KIND, 3>,
                                        rows_avx512_nb<KIND, 4>, rows_avx512_nb<KIND, 5>, rows_avx512_nb<KIND, 6>,
                                        rows_avx512_nb<KIND, 7>, rows_avx512_nb<KIND, 8>};
  row_blocks(groups, x, n, xs, hidden, w, r0, r1, ws, out, os);
}
#endif

// Which path runs: 0 portable, 1 AVX2, 2 AVX-512 (trtvocab_gguf_set_path forces a lower one, for tests).
int g_path = GGUF_AVX512 ? 2 : (GGUF_AVX2 ? 1 : 0);

template <int KIND>
void run_rows(const float* x, int64_t n, int64_t xs, int64_t hidden, const uint8_t* w, int64_t r0, int64_t r1,
              int64_t ws, float* out, int64_t os, int path) {
#if GGUF_AVX512
  if (path == 2) return rows_avx512<KIND>(x, n, xs, hidden, w, r0, r1, ws, out, os);
#endif
#if GGUF_AVX2
  if (path >= 1) return rows_avx2<KIND>(x, n, xs, hidden, w, r0, r1, ws, out, os);
#endif
  (void)path;
  rows_portable<KIND>(x, n, xs, hidden, w, r0, r1, ws, out, os);
}

}  // namespace

extern "C" {

// The paths this build has (2: AVX-512, 1: AVX2, 0: portable) and the one calls use.
int trtvocab_gguf_max_path() { return GGUF_AVX512 ? 2 : (GGUF_AVX2 ? 1 : 0); }
int trtvocab_gguf_set_path(int path) {
  const int top = trtvocab_gguf_max_path();
  g_path = path < 0 || path > top ? top : path;
  return g_path;
}

// out[n, r] = the chain of x row n and weight row r; kind 0 Q8_0, 1 Q6_K; hidden a multiple of 32 (Q6_K: 256).
int trtvocab_gguf_logits(const float* x, int64_t n, int64_t xs, int64_t hidden, int kind, const uint8_t* w,
                         int64_t rows, int64_t ws, float* out, int64_t os) {
  if (hidden % (kind == 0 ? 32 : 256) || (kind != 0 && kind != 1)) return 2;
  if (n <= 0 || rows <= 0) return 0;
  const int path = g_path;
  try {
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      if (kind == 0)
        run_rows<0>(x, n, xs, hidden, w, r0, r1, ws, out, os, path);
      else
        run_rows<1>(x, n, xs, hidden, w, r0, r1, ws, out, os, path);
    });
  } catch (...) {
    return 1;
  }
  return 0;
}

}  // extern "C"
