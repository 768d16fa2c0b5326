// Fused dequantize-multiply CPU kernels of trtvocab's FP8 and NVFP4 LM heads.
//
// The C++ half of trtvocab/weights/kernels.py, which documents the design, builds this file
// (torch.utils.cpp_extension, -O3 -march=native -fopenmp) and calls it through ctypes.
// Threads: at::parallel_for (torch's own intra-op pool and OpenMP runtime).
//
// Every logit (x row n, weight row v) is one chain, computed the same way whatever the
// batch, the row range or the tile that holds it:
//   FP8    acc[8] = 0;  for step s = 0 .. S-1 (fixed order along H):  acc = fma(w_s, x_s, acc)
//   NVFP4  acc[8] = 0;  for group g:  part = 0;  for its 16 steps: part = fma(e2m1_s, x_s, part);
//                       acc = fma(part, block scales_g * 2**-8, acc)   (lane = block)
//   logit  = ((((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))) * 256) * scale + 0
// where a step is 8 weights decoded exactly to float32 (FP8: q * 2**-8, see below) and the 8
// matching inputs. The batch-1 kernel runs the chains of 8 (FP8) or 1 (NVFP4) rows in registers; the batched
// kernel decodes a tile of rows to float32 once per K-chunk, keeps every chain's 8 lanes in
// memory between chunks (a float32 store is exact) and reuses the tile for all x rows.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TRTVOCAB_AVX2 1
#else
#define TRTVOCAB_AVX2 0
#endif

namespace {

constexpr int64_t LANES = 8;
constexpr int64_t BATCH_BLOCK = 64;   // x rows per pass over a decoded tile
constexpr float UNBIAS = 256.0f;      // decoded weights (FP8) and block scales (NVFP4) are q * 2**-8
constexpr int64_t PREFETCH_BYTES = 1024;  // how far ahead in a row the NVFP4 decoder prefetches

// The NVFP4 decoder reads 8 runs of 8 bytes per row and group (more streams than hardware
// prefetchers follow, a row at a time at batch 1, a tile's worth batched): ask ahead.
inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
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
#endif

inline float finish(V acc, float scale) {
  // * 256 is exact; then one rounding for the scale; + 0 makes a -0 logit +0.
  return (vhsum(acc) * UNBIAS) * scale + 0.0f;
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
  // Decode steps [s0, s0 + n) of row r into dst (8 floats per step).
  void decode(int64_t r, int64_t s0, int64_t n, float* dst, float*) const {
    uint8_t tmp[LANES];
    for (int64_t s = 0; s < n; ++s) vstore(dst + s * LANES, fp8_decode8(step_bytes(r, s0 + s, tmp)));
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
  const uint8_t* packed;
  int64_t p_stride, hidden;
  const uint8_t* bscale;
  int64_t bs_stride;
  float global_scale;
  int64_t blocks() const { return hidden / 16; }
  int64_t groups() const { return (blocks() + LANES - 1) / LANES; }
  int64_t steps() const { return groups() * 16; }
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
    if (g % 8) return;
    const uint8_t* row = packed + r * p_stride + g * LANES + PREFETCH_BYTES / 8;
    for (int64_t k = 0; k < LANES; ++k) prefetch(row + k * blocks());
    prefetch(bscale + r * bs_stride + g * LANES + PREFETCH_BYTES / 8);
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
template <int R>
void gemv_rows(const FP8Rows& f, const float* x, int64_t r0, float* out) {
  V acc[R];
  for (int i = 0; i < R; ++i) acc[i] = vzero();
  const int64_t full = f.hidden / LANES, steps = f.steps();
  const uint8_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = f.w + (r0 + i) * f.w_stride;
  for (int64_t s = 0; s < full; ++s) {
    V xv = vload(x + s * LANES);
    for (int i = 0; i < R; ++i) acc[i] = vfma(fp8_decode8(rows[i] + s * LANES), xv, acc[i]);
  }
  uint8_t tmp[LANES];
  for (int64_t s = full; s < steps; ++s) {
    V xv = vload(x + s * LANES);
    for (int i = 0; i < R; ++i) acc[i] = vfma(fp8_decode8(f.step_bytes(r0 + i, s, tmp)), xv, acc[i]);
  }
  for (int i = 0; i < R; ++i) out[r0 + i] = finish(acc[i], f.row_scale(r0 + i));
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

template <int R>
void gemv_rows(const NVFP4Rows& f, const float* x, int64_t r0, float* out) {
  const int64_t nb = f.blocks();
  for (int i = 0; i < R; ++i) {
    const int64_t r = r0 + i;
    const uint8_t* row = f.packed + r * f.p_stride;
    const uint8_t* srow = f.bscale + r * f.bs_stride;
    V acc = vzero();
    int64_t g = 0;
    for (; (g + 2) * LANES <= nb; g += 2) {  // two full groups: bytes 8g .. 8g + 15 of each run
      f.prefetch_group(r, g);
      const uint8_t* p = row + g * LANES;
      const float* xa = x + g * 16 * LANES;
      const float* xb = xa + 16 * LANES;
      V pa = vzero(), pb = vzero();
      for (int64_t k = 0; k < LANES; ++k) {
        V lo, hi;
        fp4_decode8(p + k * nb, lo, hi);
        pa = vfma(lo, vload(xa + (2 * k) * LANES), pa);
        pa = vfma(hi, vload(xa + (2 * k + 1) * LANES), pa);
        fp4_decode8(p + k * nb + LANES, lo, hi);
        pb = vfma(lo, vload(xb + (2 * k) * LANES), pb);
        pb = vfma(hi, vload(xb + (2 * k + 1) * LANES), pb);
      }
      acc = vfma(pa, fp8_decode8(srow + g * LANES), acc);
      acc = vfma(pb, fp8_decode8(srow + (g + 1) * LANES), acc);
    }
    for (; g < f.groups(); ++g) acc = nvfp4_groups<1>(f, x, r, g, acc);
    out[r] = finish(acc, f.row_scale(r));
  }
}

template <class F>
void gemv(const F& f, const float* x, int64_t rows, float* out) {
  constexpr int GEMV_ROWS = F::kGemvRows;
  const int64_t groups = (rows + GEMV_ROWS - 1) / GEMV_ROWS;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      int64_t r0 = g * GEMV_ROWS;
      if (r0 + GEMV_ROWS <= rows) {
        gemv_rows<GEMV_ROWS>(f, x, r0, out);
      } else {
        for (int64_t r = r0; r < rows; ++r) gemv_rows<1>(f, x, r, out);
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
    std::vector<float> wt(static_cast<size_t>(TILE_ROWS * CHUNK_STEPS * LANES));
    std::vector<float> acc(static_cast<size_t>(TILE_ROWS * nblock * LANES));
    std::vector<float> bs(static_cast<size_t>(TILE_ROWS * LANES));  // a group's block scales (NVFP4)
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
            out[(b0 + n) * out_stride + v0 + v] = finish(vload(acc.data() + v * acc_v + n * LANES), scale);
        }
      }
    }
  });
}

template <class F>
int run(const F& f, const float* x, int64_t n_rows, int64_t x_stride, int64_t rows, float* out, int64_t out_stride) {
  try {
    if (rows <= 0 || n_rows <= 0) return 0;
    if (n_rows == 1) {
      gemv(f, x, rows, out);
    } else {
      batched(f, x, n_rows, x_stride, rows, out, out_stride);
    }
    return 0;
  } catch (...) {
    return 1;
  }
}

}  // namespace

extern "C" {

// Bumped whenever a signature below changes (the Python side checks it).
int trtvocab_fused_abi() { return 2; }

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

// Which lane implementation this build uses: 2 = AVX2 + FMA + F16C, 0 = portable C++.
int trtvocab_fused_isa() { return TRTVOCAB_AVX2 ? 2 : 0; }

// out[n * out_stride + r] = sum_k x[n * x_stride + k] * e4m3(w[r * w_stride + k]) * scale[r * scale_stride]
// x: float32 [n_rows, x_stride], zero-padded past `hidden` to a multiple of 8 columns.
int trtvocab_fp8_logits(const float* x, int64_t n_rows, int64_t x_stride, int64_t hidden, const uint8_t* w,
                        int64_t rows, int64_t w_stride, const float* scale, int64_t scale_stride, float* out,
                        int64_t out_stride) {
  FP8Rows f{w, w_stride, hidden, scale, scale_stride};
  return run(f, x, n_rows, x_stride, rows, out, out_stride);
}

// out[n * out_stride + r] = sum_k x[k] * e2m1(code k of row r) * e4m3(block scale) * global_scale
// packed: block-major uint8 [rows, hidden / 2]; bscale: e4m3 bytes [rows, hidden / 16];
// x: float32 [n_rows, x_stride] in the kernel's step order (trtvocab.weights.kernels.nvfp4_x).
int trtvocab_nvfp4_logits(const float* x, int64_t n_rows, int64_t x_stride, int64_t hidden, const uint8_t* packed,
                          int64_t rows, int64_t p_stride, const uint8_t* bscale, int64_t bs_stride,
                          float global_scale, float* out, int64_t out_stride) {
  NVFP4Rows f{packed, p_stride, hidden, bscale, bs_stride, global_scale};
  return run(f, x, n_rows, x_stride, rows, out, out_stride);
}

}  // extern "C"
