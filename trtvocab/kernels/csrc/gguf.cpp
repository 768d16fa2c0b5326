// GGUF block kernels (Q8_0, Q6_K, Q4_0, Q4_1, Q5_0, Q4_K) of trtvocab's GGUF heads: x [N, H] float32 times the stored rows.
//
// Built into the same library as fused.cpp (trtvocab/kernels/compile.py); called through ctypes
// (trtvocab/kernels/gemm.py, gguf_logits). Threads: at::parallel_for (torch's intra-op pool). The ISA tiers
// (TRTVOCAB_AVX2 / TRTVOCAB_AVX512), the fp16 decode and the 8-lane tree are the fused family's
// (fused/contract.h, fused/vec8.h); a build runs its top tier (one build per -march, as fused.cpp):
//   TRTVOCAB_AVX512  rows_avx512: the 8-lane ymm tiles with 32 registers (Shape<NB, true>)
//   TRTVOCAB_AVX2    rows_avx2:   the same tiles with 16 registers (Shape<NB, false>)
//   portable         rows_portable: decode32 and scalar chains
// The block types: enum Kind and TRAITS below, one row each, the rows of trtvocab.quant.gguf_blocks.BLOCK_TYPES
// (a test holds the two equal through trtvocab_gguf_kind); adding one: docs/kernels.md.
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

#include "fused/contract.h"
#include "fused/vec8.h"

namespace {

// trtvocab_gguf_logits' kind: the block types, in the order of trtvocab.quant.gguf_blocks.BLOCK_TYPES.
enum Kind : int { Q8_0, Q6_K, Q4_0, Q4_1, Q5_0, Q4_K, KINDS };

// How the AVX2 / AVX-512 tiles (tile_avx2) decode a chunk of 32 values: straight from the row (decode32_avx2), or
// from 8 chunks unpacked at once (unpack8 into Chunks8, then decode8) always, or at batches <= 4 only (Zen 4, one
// thread, CPU time: Q4_0 / Q4_1 B = 1 1.03-1.13x faster so, B = 8 on the AVX-512 build 0.91-0.98x; Q5_0 B = 1
// 1.19-1.26x, B = 8 1.0-1.2x).
enum class Unpack : int { ROW, CHUNKS8, CHUNKS8_UPTO_4 };

// One block type: its GGML name, values and bytes per block, where a block's codes start (the 32-value types'
// nibbles or int8 codes), and its tiles' decode.
struct BlockTraits {
  const char* name;
  int values;
  int bytes;
  int codes_at;
  Unpack unpack;
};
constexpr BlockTraits TRAITS[KINDS] = {
    {"Q8_0", 32, 34, 2, Unpack::ROW},              // fp16 d, 32 int8 q
    {"Q6_K", 256, 210, 0, Unpack::CHUNKS8},        // ql[128], qh[64], int8 scales[16], fp16 d
    {"Q4_0", 32, 18, 2, Unpack::CHUNKS8_UPTO_4},   // fp16 d, 16 bytes of nibbles (elements j and j + 16 in byte j)
    {"Q4_1", 32, 20, 4, Unpack::CHUNKS8_UPTO_4},   // fp16 d, fp16 m, nibbles as Q4_0
    {"Q5_0", 32, 22, 6, Unpack::CHUNKS8},          // fp16 d, uint32 qh (bit j: element j's fifth bit), nibbles
    {"Q4_K", 256, 144, 16, Unpack::CHUNKS8},       // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, qs[128]
};
constexpr int block_values(int kind) { return TRAITS[kind].values; }
constexpr int block_bytes(int kind) { return TRAITS[kind].bytes; }
constexpr int codes_at(int kind) { return TRAITS[kind].codes_at; }
constexpr bool super_block(int kind) { return TRAITS[kind].values == 256; }  // the K-quants: 8 chunks a block

// An fp16 number at p (little-endian) as float32 (half_to_float: exact).
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
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
  if constexpr (KIND == Q8_0) {
    const uint8_t* blk = row + k * block_bytes(KIND);
    const float d = half_at(blk);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
  } else if constexpr (KIND == Q6_K) {
    const uint8_t* blk = row + (k >> 3) * block_bytes(KIND);
    const int sub = static_cast<int>(k & 7), half = sub >> 2, c = sub & 3;
    const float d = half_at(blk + 208);
    const float ds[2] = {d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * sub])),
                         d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * sub + 1]))};
    const uint8_t* ql = blk + half * 64 + (c & 1) * 32;
    const uint8_t* qh = blk + 128 + half * 32;
    for (int j = 0; j < 32; ++j) {
      const int lo = (ql[j] >> (4 * (c >> 1))) & 0x0f, hi = (qh[j] >> (2 * c)) & 0x03;
      w[j] = ds[j >> 4] * static_cast<float>((lo | (hi << 4)) - 32);
    }
  } else if constexpr (KIND == Q4_K) {
    const uint8_t* blk = row + (k >> 3) * block_bytes(KIND);
    float ds, dm;
    q4k_scales<half_at>(blk, static_cast<int>(k & 7), &ds, &dm);
    const uint8_t* qs = blk + 16 + 32 * ((k & 7) >> 1);
    const int shift = 4 * static_cast<int>(k & 1);
    for (int j = 0; j < 32; ++j) w[j] = ds * static_cast<float>((qs[j] >> shift) & 0x0f) - dm;
  } else {  // Q4_0, Q4_1, Q5_0: nibble j low = element j, high = element j + 16
    const uint8_t* blk = row + k * block_bytes(KIND);
    const float d = half_at(blk);
    const uint8_t* qs = blk + codes_at(KIND);
    uint32_t qh = 0;
    if (KIND == Q5_0) std::memcpy(&qh, blk + 2, 4);
    const float m = KIND == Q4_1 ? half_at(blk + 2) : 0.0f;
    for (int j = 0; j < 32; ++j) {
      const int nib = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
      if (KIND == Q4_0) w[j] = d * static_cast<float>(nib - 8);
      if (KIND == Q4_1) w[j] = d * static_cast<float>(nib) + m;  // two roundings (-ffp-contract=off)
      if (KIND == Q5_0) w[j] = d * static_cast<float>((nib | static_cast<int>(((qh >> j) & 1u) << 4)) - 16);
    }
  }
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
      for (int b = 0; b < nb; ++b) out[(n0 + b) * os + r] = tree8(acc[b]) + 0.0f;
    }
  }
}

#if TRTVOCAB_AVX2
// The chain's end: the 8 lanes' tree (vhsum), then + 0.
inline float hsum_tree(__m256 v) { return vhsum(V{v}) + 0.0f; }

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
  const __m128i v16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + codes_at(KIND)));
  const __m256i q = _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(v16), _mm256_setr_epi64x(0, 0, 4, 4)),
                                     _mm256_set1_epi8(0x0f));
  if (KIND == Q4_0) return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
  if (KIND == Q4_1) return q;
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
  if constexpr (super_block(KIND)) {
    const uint8_t* blk = row + (k >> 3) * block_bytes(KIND);
    if (KIND == Q6_K) unpack_q6k(blk, u);
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
  const uint8_t* blk = super_block(KIND) ? row : row + k * block_bytes(KIND);  // the 32-value blocks'
  const __m256 d = super_block(KIND) ? _mm256_setzero_ps() : bcast_half(blk);
  for (int t = 0; t < 4; ++t) {
    const __m256 c = cvt8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * t)));
    if (KIND == Q6_K) {
      w[t] = _mm256_mul_ps(_mm256_broadcast_ss(u.ds + 2 * j + (t >> 1)), c);
    } else if (KIND == Q4_K) {
      w[t] = _mm256_sub_ps(_mm256_mul_ps(_mm256_broadcast_ss(u.ds + j), c), _mm256_broadcast_ss(u.dm + j));
    } else if (KIND == Q4_1) {
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
  if (KIND == Q8_0) {
    // MEM_SCALE: the scale as a float32 in memory, broadcast into each step's product. Held in a register
    // for the chunk (bcast_half), it left GCC too few for the 32-register tiles of 4 or more x rows, which
    // kept their accumulators on the stack between chunks. The same value (one F16C conversion either way).
    const uint8_t* blk = row + k * block_bytes(KIND);
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
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + codes_at(KIND)));
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
    if (KIND == Q4_0) {
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    const __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    if (KIND == Q4_1) {
      const __m256 m = bcast_half(blk + 2);
      for (int t = 0; t < 4; ++t) w[t] = _mm256_add_ps(_mm256_mul_ps(d, cvt8(q[t])), m);
    } else {
      for (int t = 0; t < 4; ++t) w[t] = _mm256_mul_ps(d, cvt8(q[t]));
    }
  }
}

// Which tiles decode from Chunks8 (the kind's Unpack).
template <int KIND, int NB>
constexpr bool from_chunks8() {
  return TRAITS[KIND].unpack == Unpack::CHUNKS8 || (TRAITS[KIND].unpack == Unpack::CHUNKS8_UPTO_4 && NB <= 4);
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

#if TRTVOCAB_AVX512
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

// The build's top tier (a lower one: a build for it, TRTVOCAB_KERNELS_ISA; docs/kernels.md, "Forcing a path").
template <int KIND>
void run_rows(const float* x, int64_t n, int64_t xs, int64_t hidden, const uint8_t* w, int64_t r0, int64_t r1,
              int64_t ws, float* out, int64_t os) {
#if TRTVOCAB_AVX512
  rows_avx512<KIND>(x, n, xs, hidden, w, r0, r1, ws, out, os);
#elif TRTVOCAB_AVX2
  rows_avx2<KIND>(x, n, xs, hidden, w, r0, r1, ws, out, os);
#else
  rows_portable<KIND>(x, n, xs, hidden, w, r0, r1, ws, out, os);
#endif
}

}  // namespace

extern "C" {

// The kind of the block type `name` (its GGML name), with its values and bytes per block where the pointers are
// not null; -1 where this build has no such type. For the test that holds trtvocab.quant.gguf_blocks equal to TRAITS.
int trtvocab_gguf_kind(const char* name, int64_t* values, int64_t* bytes) {
  for (int kind = 0; kind < KINDS; ++kind) {
    if (std::strcmp(TRAITS[kind].name, name) != 0) continue;
    if (values) *values = TRAITS[kind].values;
    if (bytes) *bytes = TRAITS[kind].bytes;
    return kind;
  }
  return -1;
}

// out[n, r] = the chain of x row n and weight row r; kind: enum Kind; hidden a multiple of the block's values.
int trtvocab_gguf_logits(const float* x, int64_t n, int64_t xs, int64_t hidden, int kind, const uint8_t* w,
                         int64_t rows, int64_t ws, float* out, int64_t os) {
  if (kind < 0 || kind >= KINDS || hidden % block_values(kind)) return 2;
  if (n <= 0 || rows <= 0) return 0;
  try {
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      switch (kind) {
        case Q8_0: return run_rows<Q8_0>(x, n, xs, hidden, w, r0, r1, ws, out, os);
        case Q6_K: return run_rows<Q6_K>(x, n, xs, hidden, w, r0, r1, ws, out, os);
        case Q4_0: return run_rows<Q4_0>(x, n, xs, hidden, w, r0, r1, ws, out, os);
        case Q4_1: return run_rows<Q4_1>(x, n, xs, hidden, w, r0, r1, ws, out, os);
        case Q5_0: return run_rows<Q5_0>(x, n, xs, hidden, w, r0, r1, ws, out, os);
        default: return run_rows<Q4_K>(x, n, xs, hidden, w, r0, r1, ws, out, os);
      }
    });
  } catch (...) {
    return 1;
  }
  return 0;
}

}  // extern "C"
