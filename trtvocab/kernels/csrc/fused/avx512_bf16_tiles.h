// fused/avx512_bf16_tiles.h: the AVX-512 BF16 (vdpbf16ps) tile kernels of batch >= 9 (wb_layout_bf16,
// wb_decode_bf16, and wb_micro_any's Bf16Steps).
// Part of fused.cpp's one translation unit (included there, in order, after the headers before it).
#pragma once

#if TRTVOCAB_DPBF16

namespace {

// ---- AVX-512 BF16, batch >= 9: the tile kernel with two chain steps per vdpbf16ps ----------------------
// The same tiles, passes and chains as fused/avx512_tiles.h's, where every x row fits (x_fits_bf16) and the
// weights are FP8 or NVFP4 (exact in bf16): the decoded tile is packed into bf16 step pairs ([pair][8],
// NVFP4 [pair][group][8];
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

// The micro kernels' step by vdpbf16ps (wb_micro, wb_micro_gs with Op = Bf16Steps): a step is a pair of steps
// of the packed tile rows (row v: w + v * ws) and of x (pair t of row pair j: x + t * x_pair + j * 16); an NVFP4
// group is 8 step pairs of the packed tile ([pair][2 groups][8]).
struct Bf16Steps {
  using T = uint32_t;
  static constexpr int64_t kGroup = 8;
  static __m512 x(const uint32_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static __m512 w(const uint32_t* p) { return bcast_pair(p); }
  static __m512 step(__m512 a, __m512 w, __m512 x) { return dpbf16(a, w, x); }
};

// wide_batched's policy with BF = true: the vdpbf16ps kernels on bf16 pairs of the tile and of x.
template <>
struct Tiles<true> {
  static void layout(const float* x, int64_t xs, int64_t b0, int64_t nb, int64_t steps, float* xt) {
    wb_layout_bf16(x, xs, b0, nb, steps, reinterpret_cast<uint32_t*>(xt));
  }
  template <class F>
  static void decode(const F& f, int64_t r, int64_t s0, int64_t n, float* wt, float* wtb, float* bs) {
    wb_decode_bf16(f, r, s0, n, reinterpret_cast<uint32_t*>(wtb), bs, wt);
  }
  template <bool GS>
  static void micro(int64_t nv, int64_t np, const float* xt, int64_t i, int64_t, int64_t pairs, int64_t s0,
                    const float*, const float* wtb, int64_t ws, int64_t ks, float* acc, int64_t acc_v, const float* bs) {
    const uint32_t* xb = reinterpret_cast<const uint32_t*>(xt) + i * pairs * WB_ROWS * LANES + (s0 / 2) * np * 16;
    wb_micro_any<Bf16Steps, GS>(nv, np, xb, np * 16, reinterpret_cast<const uint32_t*>(wtb), ws / 2, (ks + 1) / 2,
                                acc, acc_v, bs);
  }
};


}  // namespace
#endif  // TRTVOCAB_DPBF16
