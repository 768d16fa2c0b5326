// GGUF block kernels (Q8_0, Q6_K, Q4_0, Q4_1, Q5_0, Q4_K) of trtvocab's GGUF heads: x [N, H] float32 times the stored rows.
//
// Built into the same library as fused.cpp (trtvocab/kernels/build.py); called through ctypes
// (trtvocab/kernels/gemm.py, gguf_logits). Threads: at::parallel_for (torch's intra-op pool).
//
// The chain (trtvocab/quant/gguf_blocks.py computes the same bits with torch ops): a weight is
// gguf.quants.dequantize's value, Q8_0 q * d, Q6_K (d * sc) * q, Q4_0 / Q5_0 d * q, each a float32
// product (exact: at most 24 significant bits), Q4_1 d * q + m and Q4_K (d * sc) * q - dmin * m (exact
// products, then one rounded add); logit (n, v):
//   acc[8] = 0;  for step s = 0 .. H/8 - 1:  acc = acc + w_s * x_s     (a rounded product, a rounded sum)
//   logit  = (((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))) + 0
// Never an FMA (-ffp-contract=off; the intrinsics are explicit mul and add), so the portable C++
// build computes the same bits as the AVX2 and AVX-512 ones (8-lane ymm chains in both). A weight
// chunk (32 values) is decoded once into registers and multiplied into every x row of the tile;
// a logit's chain is the same for any batch, row range or tile: bitwise batch-, partition- and
// tp-invariant.

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

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

// Kinds (trtvocab_gguf_logits' kind): 0 Q8_0, 1 Q6_K, 2 Q4_0, 3 Q4_1, 4 Q5_0, 5 Q4_K.
constexpr int Q8_BYTES = 34;   // fp16 d, 32 int8 q
constexpr int Q6_BYTES = 210;  // ql[128], qh[64], int8 scales[16], fp16 d
constexpr int Q40_BYTES = 18;  // fp16 d, 16 bytes of nibbles (elements j and j + 16 in byte j)
constexpr int Q41_BYTES = 20;  // fp16 d, fp16 m, nibbles as Q4_0
constexpr int Q50_BYTES = 22;  // fp16 d, uint32 qh (bit j: element j's fifth bit), nibbles as Q4_0
constexpr int Q4K_BYTES = 144; // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, qs[128]
constexpr int block_values(int kind) { return kind == 1 || kind == 5 ? 256 : 32; }
constexpr int block_bytes(int kind) {
  return kind == 0 ? Q8_BYTES : kind == 1 ? Q6_BYTES : kind == 2 ? Q40_BYTES : kind == 3 ? Q41_BYTES
       : kind == 4 ? Q50_BYTES : Q4K_BYTES;
}
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

// Q4_K sub-block j's float32 scale d * sc and min dmin * m (gguf.quants' get_scale_min; exact products).
template <float (*HALF)(const uint8_t*)>
inline void q4k_scales(const uint8_t* blk, int j, float* ds, float* dm) {
  const uint8_t* s = blk + 4;
  int sc, m;
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
  *ds = HALF(blk) * static_cast<float>(sc);
  *dm = HALF(blk + 2) * static_cast<float>(m);
}

// The 32 weights of chunk k (elements 32k .. 32k + 31) of a row, as float32 (portable decode).
template <int KIND>
inline void decode32(const uint8_t* row, int64_t k, float* w) {
  if (KIND == 0) {
    const uint8_t* blk = row + k * Q8_BYTES;
    const float d = half_to_float(blk);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
  } else if (KIND == 1) {
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
  } else if (KIND == 5) {
    const uint8_t* blk = row + (k >> 3) * Q4K_BYTES;
    float ds, dm;
    q4k_scales<half_to_float>(blk, static_cast<int>(k & 7), &ds, &dm);
    const uint8_t* qs = blk + 16 + 32 * ((k & 7) >> 1);
    const int shift = 4 * static_cast<int>(k & 1);
    for (int j = 0; j < 32; ++j) w[j] = ds * static_cast<float>((qs[j] >> shift) & 0x0f) - dm;
  } else {  // Q4_0, Q4_1, Q5_0: nibble j low = element j, high = element j + 16
    const uint8_t* blk = row + k * block_bytes(KIND);
    const float d = half_to_float(blk);
    const uint8_t* qs = blk + (KIND == 2 ? 2 : KIND == 3 ? 4 : 6);
    uint32_t qh = 0;
    if (KIND == 4) std::memcpy(&qh, blk + 2, 4);
    const float m = KIND == 3 ? half_to_float(blk + 2) : 0.0f;
    for (int j = 0; j < 32; ++j) {
      const int nib = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
      if (KIND == 2) w[j] = d * static_cast<float>(nib - 8);
      if (KIND == 3) w[j] = d * static_cast<float>(nib) + m;  // two roundings (-ffp-contract=off)
      if (KIND == 4) w[j] = d * static_cast<float>((nib | static_cast<int>(((qh >> j) & 1u) << 4)) - 16);
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

// An fp16 scale as float32 by F16C, broadcast: exact for every finite value (subnormals become
// normal float32, whatever MXCSR says); a signalling NaN comes out quiet, as the product with it would be
// anyway, so the chain's bits equal half_to_float's (measured: Q8_0 B = 1 13.0 -> 14.6 MAC/ns, in L2).
inline __m256 bcast_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
}

// Q4_0 / Q4_1 / Q5_0: a block's 32 codes as int8 in element order (Q4_0 q - 8, Q4_1 q, Q5_0 q - 16), one 256-bit
// pass: the 16 nibble bytes in both lanes, split by a 64-bit shift per lane (0, 4) and a mask (element j < 16:
// byte j's low nibble, j >= 16: byte j - 16's high one); Q5_0's fifth bits as a byte mask (qh's byte j / 8
// spread over 8 bytes by a byte shuffle, bit j % 8 tested): q - 16 where it is clear, q where it is set.
template <int KIND>
inline __m256i small_codes(const uint8_t* blk) {
  const __m128i v16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (KIND == 2 ? 2 : KIND == 3 ? 4 : 6)));
  const __m256i q = _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(v16), _mm256_setr_epi64x(0, 0, 4, 4)),
                                     _mm256_set1_epi8(0x0f));
  if (KIND == 2) return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
  if (KIND == 3) return q;
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_add_epi8(q, _mm256_andnot_si256(set, _mm256_set1_epi8(-16)));  // (q | five << 4) - 16
}

// Eight chunks of a tile row unpacked once (on the stack) and decoded from there, each chunk then as Q8_0's
// (vpmovsxbd from memory, vcvtdq2ps, one broadcast scale): the 256 codes as int8 in element order and, for the
// K-quants, the float32 sub-block scales (Q6_K d * sc, 16 of them; Q4_K d * sc in ds[0..7], dmin * m in
// dm[0..7]), each the same float32 product decode32 forms (same operand order). The 32-value blocks keep their
// fp16 scales in the row, read per chunk.
struct Chunks8 {
  alignas(32) int8_t q[256];
  alignas(32) float ds[16];
  alignas(32) float dm[8];
};

// Q6_K: per half of 128 values, ql's two 32-byte vectors give the low nibbles (chunks c = 0, 1: & 15; c = 2, 3:
// >> 4), qh's one vector the two high bits of all four (bits 2c, 2c + 1 moved to 4, 5 by a constant shift and
// masked with 0x30); the 16 int8 scales widened and multiplied by d as two 8-lane vectors.
inline void unpack_q6k(const uint8_t* blk, Chunks8* u) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  for (int half = 0; half < 2; ++half) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * half));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * half + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * half));
    const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                           _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
    const __m256i hi[4] = {_mm256_and_si256(_mm256_slli_epi16(qh, 4), m30), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                           _mm256_and_si256(qh, m30), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30)};
    for (int c = 0; c < 4; ++c)
      _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 128 * half + 32 * c),
                         _mm256_sub_epi8(_mm256_or_si256(lo[c], hi[c]), off));
  }
  const __m256 d = bcast_half(blk + 208);
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  _mm256_store_ps(u->ds, _mm256_mul_ps(d, cvt8(sc)));
  _mm256_store_ps(u->ds + 8, _mm256_mul_ps(d, cvt8(_mm_srli_si128(sc, 8))));
}

// Q4_K: qs's four 32-byte vectors give two chunks each (& 15, >> 4); the 12 scale bytes (read as 16 from blk + 4,
// all inside the block) give get_scale_min's eight sc and eight m by two byte shuffles: low parts
// (sc j < 4: s[j] & 63, j >= 4: s[j + 4] & 15; m j < 4: s[j + 4] & 63, j >= 4: s[j + 4] >> 4) and high parts
// ((s[j - 4] >> 6) << 4 for sc, (s[j] >> 6) << 4 for m, j >= 4).
inline void unpack_q4k(const uint8_t* blk, Chunks8* u) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  for (int p = 0; p < 4; ++p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * p));
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 64 * p), _mm256_and_si256(v, m4));
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 64 * p + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
  }
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  const __m128i low = _mm_shuffle_epi8(s, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i high = _mm_shuffle_epi8(s, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i lows = _mm_or_si128(
      _mm_and_si128(low, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
      _mm_and_si128(_mm_srli_epi16(low, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
  const __m128i scm = _mm_or_si128(lows, _mm_and_si128(_mm_srli_epi16(high, 2), _mm_set1_epi8(0x30)));
  _mm256_store_ps(u->ds, _mm256_mul_ps(bcast_half(blk), cvt8(scm)));
  _mm256_store_ps(u->dm, _mm256_mul_ps(bcast_half(blk + 2), cvt8(_mm_srli_si128(scm, 8))));
}

// Chunks k .. k + 7 of a row (k a multiple of 8; the 32-value blocks: those of them below `chunks`).
template <int KIND>
inline void unpack8(const uint8_t* row, int64_t k, int64_t chunks, Chunks8* u) {
  if constexpr (KIND == 1 || KIND == 5) {
    const uint8_t* blk = row + (k >> 3) * block_bytes(KIND);
    if (KIND == 1) unpack_q6k(blk, u);
    else unpack_q4k(blk, u);
  } else {
    const int64_t n = chunks - k < 8 ? chunks - k : 8;
    for (int64_t i = 0; i < n; ++i)
      _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 32 * i), small_codes<KIND>(row + (k + i) * block_bytes(KIND)));
  }
}

// Chunk k of a row from its unpacked group: Q6_K (d * sc) * q, sc per 16 values; Q4_K (d * sc) * q - dmin * m;
// Q4_0 / Q5_0 d * q, Q4_1 d * q + m (d and m from the block).
template <int KIND>
inline void decode8(const Chunks8& u, const uint8_t* row, int64_t k, __m256* w) {
  const int j = static_cast<int>(k & 7);
  const int8_t* q = u.q + 32 * j;
  const uint8_t* blk = KIND == 1 || KIND == 5 ? row : row + k * block_bytes(KIND);  // the 32-value blocks'
  const __m256 d = KIND == 1 || KIND == 5 ? _mm256_setzero_ps() : bcast_half(blk);
  for (int t = 0; t < 4; ++t) {
    const __m256 c = cvt8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * t)));
    if (KIND == 1) {
      w[t] = _mm256_mul_ps(_mm256_broadcast_ss(u.ds + 2 * j + (t >> 1)), c);
    } else if (KIND == 5) {
      w[t] = _mm256_sub_ps(_mm256_mul_ps(_mm256_broadcast_ss(u.ds + j), c), _mm256_broadcast_ss(u.dm + j));
    } else if (KIND == 3) {
      w[t] = _mm256_add_ps(_mm256_mul_ps(d, c), bcast_half(blk + 2));
    } else {
      w[t] = _mm256_mul_ps(d, c);
    }
  }
}

// The 4 steps of chunk k of a row as float32 straight from the row (AVX2 decode, bitwise decode32's): Q8_0, and
// Q4_0 / Q4_1 at B >= 5 (128-bit: one mask and one shift per 16 bytes of nibbles).
template <int KIND, bool MEM_SCALE = false>
inline void decode32_avx2(const uint8_t* row, int64_t k, __m256* w) {
  if (KIND == 0) {
    // MEM_SCALE: the scale as a float32 in memory, broadcast into each step's product. Held in a register
    // for the chunk (bcast_half), it left GCC too few for the 32-register tiles of 4 or more x rows, which
    // kept their accumulators on the stack between chunks. The same value (one F16C conversion either way).
    const uint8_t* blk = row + k * Q8_BYTES;
    uint16_t h;
    std::memcpy(&h, blk, 2);
    const float d1 = _cvtsh_ss(h);
    const __m256 d = bcast_half(blk);
    for (int t = 0; t < 4; ++t)
      w[t] = _mm256_mul_ps(cvt8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * t))),
                           MEM_SCALE ? _mm256_broadcast_ss(&d1) : d);
  } else {  // Q4_0 (minus 8 on each 16-byte half), Q4_1
    const uint8_t* blk = row + k * block_bytes(KIND);
    const __m256 d = bcast_half(blk);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (KIND == 2 ? 2 : 4)));
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
    if (KIND == 2) {
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    const __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    if (KIND == 3) {
      const __m256 m = bcast_half(blk + 2);
      for (int t = 0; t < 4; ++t) w[t] = _mm256_add_ps(_mm256_mul_ps(d, cvt8(q[t])), m);
    } else {
      for (int t = 0; t < 4; ++t) w[t] = _mm256_mul_ps(d, cvt8(q[t]));
    }
  }
}

// Which tiles decode from Chunks8: the K-quants and Q5_0 always, Q4_0 / Q4_1 at B <= 4 (Zen 4, one thread, CPU
// time: B = 1 1.03-1.13x faster so, B = 8 on the AVX-512 build 0.91-0.98x; Q5_0 B = 1 1.19-1.26x, B = 8 1.0-1.2x).
template <int KIND, int NB>
constexpr bool from_chunks8() {
  return KIND == 1 || KIND == 5 || KIND == 4 || ((KIND == 2 || KIND == 3) && NB <= 4);
}

// RR weight rows x NB x rows in registers, one pass over the chunks. Each chunk of a row is decoded once
// into registers and multiplied into all NB x rows; with XA (x amortized) the chunk of all RR rows is decoded
// first and each x vector loaded once for the RR rows. Each chain (r, b) still takes steps 0, 1, 2, ... in order.
// Tiles that decode from Chunks8 unpack each row's next 8 chunks at every eighth chunk.
template <int KIND, int RR, int NB, bool XA, bool WIDE>
inline void tile_avx2(const float* x, int64_t xs, int64_t chunks, const uint8_t* row0, int64_t ws, float* out,
                      int64_t os) {
  constexpr bool GROUPED = from_chunks8<KIND, NB>();
  __m256 acc[RR][NB];
  for (int r = 0; r < RR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_setzero_ps();
  Chunks8 u[GROUPED ? RR : 1];
  // The tile after next (its RR rows are one contiguous range): a few lines per chunk, ahead of use. WIDE
  // (32 registers): PF lines every chunk, the tile's bytes per chunk in lines rounded up (the last chunks'
  // reach past it; a prefetch never faults), a fixed count: around a loop of a variable trip count GCC kept
  // the larger tiles' accumulators on the stack between chunks (AVX-512 build, one thread, against that
  // loop: 0.95-1.00x the time at B = 1..8 over the six types). The 16-register tiles keep the loop, which
  // stops at the tile's last line (the fixed count ran the AVX2 build's Q8_0 B = 1 1.25-1.40x slower).
  constexpr int PF = (RR * block_bytes(KIND) * 32 / block_values(KIND) + 63) / 64;
  const uint8_t* ahead = row0 + 2 * RR * ws;
  const int64_t ahead_lines = (RR * ws + 63) / 64;
  const int64_t per_chunk = (ahead_lines + chunks - 1) / chunks;
  int64_t line = 0;
  for (int64_t k = 0; k < chunks; ++k) {
    if constexpr (WIDE) {
      for (int i = 0; i < PF; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * (PF * k + i)), _MM_HINT_T0);
    } else {
      for (int64_t i = 0; i < per_chunk && line < ahead_lines; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line++), _MM_HINT_T0);
    }
    if constexpr (GROUPED) {
      if ((k & 7) == 0)
        for (int r = 0; r < RR; ++r) unpack8<KIND>(row0 + r * ws, k, chunks, &u[r]);
    }
    if (XA) {
      __m256 w[RR][4];
      for (int r = 0; r < RR; ++r) {
        if constexpr (GROUPED) decode8<KIND>(u[r], row0 + r * ws, k, w[r]);
        else decode32_avx2<KIND, (WIDE && NB >= 4)>(row0 + r * ws, k, w[r]);
      }
      for (int t = 0; t < 4; ++t)
        for (int b = 0; b < NB; ++b) {
          const __m256 xv = _mm256_loadu_ps(x + b * xs + 32 * k + 8 * t);
          for (int r = 0; r < RR; ++r) acc[r][b] = _mm256_add_ps(acc[r][b], _mm256_mul_ps(w[r][t], xv));
        }
    } else {
      for (int r = 0; r < RR; ++r) {
        __m256 w[4];
        if constexpr (GROUPED) decode8<KIND>(u[r], row0 + r * ws, k, w);
        else decode32_avx2<KIND>(row0 + r * ws, k, w);
        for (int t = 0; t < 4; ++t)
          for (int b = 0; b < NB; ++b) {
            const __m256 xv = _mm256_loadu_ps(x + b * xs + 32 * k + 8 * t);
            acc[r][b] = _mm256_add_ps(acc[r][b], _mm256_mul_ps(w[t], xv));
          }
      }
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int b = 0; b < NB; ++b) out[b * os + r] = hsum_tree(acc[r][b]);
}

// Tile shapes: 16 ymm registers (AVX2) or 32 (AVX-512VL builds).
// With 32 registers every tile decodes its rows' chunk first (B = 1: 4 rows so, measured 13.0 MAC/ns
// against 12.6 for 8 rows decoded one after the other, Q8_0 in L2, one thread); with 16 only where the
// decoded chunks (4 registers a row) and the chains fit.
template <int NB, bool WIDE>
struct Shape {
  static constexpr int RR = WIDE ? (NB == 1 ? 4 : NB == 2 ? 6 : NB <= 4 ? 4 : NB <= 6 ? 3 : 2)
                                 : (NB == 1 ? 8 : NB == 2 ? 4 : NB <= 4 ? 2 : 1);
  static constexpr bool XA = WIDE || RR * (4 + NB) <= 14;
};

template <int KIND, int NB, bool WIDE = false>
void rows_avx2_nb(const float* x, int64_t xs, int64_t chunks, const uint8_t* w, int64_t r0, int64_t r1, int64_t ws,
                  float* out, int64_t os) {
  constexpr int RR = Shape<NB, WIDE>::RR;
  constexpr bool XA = Shape<NB, WIDE>::XA;
  int64_t r = r0;
  for (; r + RR <= r1; r += RR) tile_avx2<KIND, RR, NB, XA, WIDE>(x, xs, chunks, w + r * ws, ws, out + r, os);
  for (; r < r1; ++r) tile_avx2<KIND, 1, NB, false, WIDE>(x, xs, chunks, w + r * ws, ws, out + r, os);
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
// AVX-512 builds run the same 8-lane ymm tiles with the 32 registers AVX-512VL gives: larger tiles (more rows
// against each group of x rows). Measured on Zen 4 (one thread, Q8_0 640 wide, in L2, CPU time): B = 8 32 MAC/ns
// against 23 for zmm row pairs (two 8-lane chains a zmm, x broadcast from memory), B = 1 12.6 against 10.8.
template <int KIND, int NB>
void rows_avx512_nb(const float* x, int64_t xs, int64_t chunks, const uint8_t* w, int64_t r0, int64_t r1, int64_t ws,
                    float* out, int64_t os) {
  rows_avx2_nb<KIND, NB, true>(x, xs, chunks, w, r0, r1, ws, out, os);
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

// The chain probe of benchmarks/gguf_head.py: how fast a thread runs this file's chain at B = 1 with no
// format to unpack and no memory to wait for. Per item (one a thread: at::parallel_for over get_num_threads()
// items), 4 rows of 768 int8 codes, a float32 scale per 8 and one x row (7.5 KiB, in L1), `rounds` times: per 8 weights of a row the decode of a Q8_0 chunk's step
// (vpmovsxbd, vcvtdq2ps, times a broadcast scale) and the chain's product and sum, the ymm ops of tile_avx2's
// 4-row B = 1 tile (the portable build: the same in scalar C++). x is `x0` everywhere (0: every chain stays
// exactly 0; 1: every product a multiple of 2^-6, the sums exact below 2^18); their sum goes to `sink`.
// Returns the weights multiplied: rounds * 4 * 768 per item.
int64_t trtvocab_gguf_chain_probe(int64_t rounds, float x0, float* sink) {
  constexpr int ROWS = 4, H = 768;
  const int threads = at::get_num_threads();
  std::vector<float> sums(static_cast<size_t>(threads) + 1, 0.0f);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) int8_t q[ROWS][H];
    alignas(64) float sc[ROWS][H / 8];
    alignas(64) float xv[H];
    for (int r = 0; r < ROWS; ++r) {
      for (int i = 0; i < H; ++i) q[r][i] = static_cast<int8_t>((i * 7 + r) % 64 - 32);
      for (int i = 0; i < H / 8; ++i) sc[r][i] = 0.015625f * static_cast<float>(1 + (i + r) % 7);
    }
    for (int i = 0; i < H; ++i) xv[i] = x0;
    float total = 0.0f;
    for (int64_t t = t0; t < t1; ++t) {
#if GGUF_AVX2
      __m256 acc[ROWS];
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t k = 0; k < rounds; ++k)
        for (int s = 0; s < H / 8; ++s) {
          const __m256 x8 = _mm256_load_ps(xv + 8 * s);
          for (int r = 0; r < ROWS; ++r) {
            const __m256 w = _mm256_mul_ps(_mm256_broadcast_ss(&sc[r][s]),
                                           cvt8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[r] + 8 * s))));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(w, x8));
          }
        }
      for (int r = 0; r < ROWS; ++r) total += hsum_tree(acc[r]);
#else
      float acc[ROWS][8] = {};
      for (int64_t k = 0; k < rounds; ++k)
        for (int s = 0; s < H / 8; ++s)
          for (int r = 0; r < ROWS; ++r)
            for (int l = 0; l < 8; ++l) {
              const float w = sc[r][s] * static_cast<float>(q[r][8 * s + l]);
              acc[r][l] = acc[r][l] + w * xv[8 * s + l];
            }
      for (int r = 0; r < ROWS; ++r) total += tree8(acc[r]);
#endif
    }
    sums[static_cast<size_t>(at::get_thread_num())] += total;
  });
  float total = 0.0f;
  for (float v : sums) total += v;
  *sink = total;
  return rounds * ROWS * H * threads;
}

// out[n, r] = the chain of x row n and weight row r; kind 0 Q8_0, 1 Q6_K, 2 Q4_0, 3 Q4_1, 4 Q5_0, 5 Q4_K;
// hidden a multiple of the block's values (32; the K-quants 256).
int trtvocab_gguf_logits(const float* x, int64_t n, int64_t xs, int64_t hidden, int kind, const uint8_t* w,
                         int64_t rows, int64_t ws, float* out, int64_t os) {
  if (kind < 0 || kind > 5 || hidden % block_values(kind)) return 2;
  if (n <= 0 || rows <= 0) return 0;
  const int path = g_path;
  try {
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      switch (kind) {
        case 0: return run_rows<0>(x, n, xs, hidden, w, r0, r1, ws, out, os, path);
        case 1: return run_rows<1>(x, n, xs, hidden, w, r0, r1, ws, out, os, path);
        case 2: return run_rows<2>(x, n, xs, hidden, w, r0, r1, ws, out, os, path);
        case 3: return run_rows<3>(x, n, xs, hidden, w, r0, r1, ws, out, os, path);
        case 4: return run_rows<4>(x, n, xs, hidden, w, r0, r1, ws, out, os, path);
        default: return run_rows<5>(x, n, xs, hidden, w, r0, r1, ws, out, os, path);
      }
    });
  } catch (...) {
    return 1;
  }
  return 0;
}

}  // extern "C"
