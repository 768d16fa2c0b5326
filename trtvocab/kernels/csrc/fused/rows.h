// fused/rows.h: the row formats as policy classes (FP8Rows, DenseRows<K>, NVFP4Rows): how a row's steps decode.
// Part of fused.cpp's one translation unit (included there, in order, after the headers before it).
#pragma once

namespace {

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
  // as one sequential stream to the hardware prefetchers. The lane-group kernel uses it; the row-pair
  // kernels, whose passes interleave 2 P rows, were slower with it and keep prefetch_lines (docs/kernels.md, K4).
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

}  // namespace
