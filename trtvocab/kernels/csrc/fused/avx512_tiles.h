// fused/avx512_tiles.h: the AVX-512 (F, BW, VL, DQ) FMA tile kernels of batch >= 9 (wb_layout, wb_decode,
// wb_micro_any<FmaSteps>; wb_micro_any also runs the vdpbf16ps steps of avx512_bf16_tiles.h).
// Part of fused.cpp's one translation unit (included there, in order, after the headers before it).
#pragma once

#if TRTVOCAB_AVX512

namespace {

// ---- AVX-512, batch >= 9: a decoded tile shared by every x row, two x rows per zmm ------------------
// The tile kernel's chains (batched, fused/lanes8.h), on 512-bit registers: a zmm holds the 8-lane chains
// of two x rows (n, n + 1) against one weight row; the weight row's step (8 floats of the decoded tile)
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

// The micro kernels' chain step as a policy (Op), like the row formats: FmaSteps here (float32 tile steps, x
// rows as they are), Bf16Steps (avx512_bf16_tiles.h: bf16 step pairs by vdpbf16ps). Op::T: an element of x's
// layout and of the tile; x(p): a zmm of x (a row pair's step); w(p): a tile row's step broadcast to both
// halves; step(a, w, x): one step of the chains; kGroup: the steps of an NVFP4 group.
struct FmaSteps {
  using T = float;
  static constexpr int64_t kGroup = 16;
  static __m512 x(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 w(const float* p) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }
  static __m512 step(__m512 a, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, a); }
};

// Steps [0, steps) of NV weight rows (tile row v: w + v * ws) against NP row pairs (pair j at step s:
// x + s * x_step + j * 16); acc: row v pair j at acc + v * acc_v + j * 16.
template <class Op, int NP, int NV>
inline void wb_micro(const typename Op::T* x, int64_t x_step, const typename Op::T* w, int64_t ws, int64_t steps,
                     float* acc, int64_t acc_v, const float*) {
  __m512 a[NV][NP];
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NP; ++j) a[v][j] = _mm512_loadu_ps(acc + v * acc_v + j * 16);
  for (int64_t s = 0; s < steps; ++s) {
    __m512 xv[NP];
    for (int j = 0; j < NP; ++j) xv[j] = Op::x(x + s * x_step + j * 16);
    for (int v = 0; v < NV; ++v) {
      const __m512 wv = Op::w(w + v * ws + s * LANES);
      for (int j = 0; j < NP; ++j) a[v][j] = Op::step(a[v][j], wv, xv[j]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(acc + v * acc_v + j * 16, a[v][j]);
}

// NVFP4: the chunk's groups (steps / kGroup; the tile [step][group][8]: wb_decode) one after the other; each
// group's block sums start from zero in registers and are added to the totals in acc as
// acc = fma(sum, bs[v][g], acc). Not inlined: inlined into the tile loop, GCC kept the sums of the
// one-pair kernel on the stack inside the step loop (measured: NVFP4 at batch 9 1.4x slower).
template <class Op, int NP, int NV>
__attribute__((noinline)) void wb_micro_gs(const typename Op::T* x, int64_t x_step, const typename Op::T* w,
                                           int64_t ws, int64_t steps, float* acc, int64_t acc_v, const float* bs) {
  __m512 a[NV][NP];
  for (int64_t g = 0; g * Op::kGroup < steps; ++g) {
    for (int v = 0; v < NV; ++v)
      for (int j = 0; j < NP; ++j) a[v][j] = _mm512_setzero_ps();
    const typename Op::T* xg = x + g * Op::kGroup * x_step;
    const typename Op::T* wg = w + g * LANES;
    for (int64_t t = 0; t < Op::kGroup; ++t) {
      __m512 xv[NP];
      for (int j = 0; j < NP; ++j) xv[j] = Op::x(xg + t * x_step + j * 16);
      for (int v = 0; v < NV; ++v) {
        const __m512 wv = Op::w(wg + v * ws + t * 2 * LANES);
        for (int j = 0; j < NP; ++j) a[v][j] = Op::step(a[v][j], wv, xv[j]);
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

template <class Op, int NP, int NV, bool GS>
inline void wb_call(const typename Op::T* x, int64_t x_step, const typename Op::T* w, int64_t ws, int64_t steps,
                    float* acc, int64_t acc_v, const float* bs) {
  if constexpr (GS) {
    wb_micro_gs<Op, NP, NV>(x, x_step, w, ws, steps, acc, acc_v, bs);
  } else {
    wb_micro<Op, NP, NV>(x, x_step, w, ws, steps, acc, acc_v, bs);
  }
}

template <class Op, int NV, bool GS>
inline void wb_micro_np(int64_t np, const typename Op::T* x, int64_t x_step, const typename Op::T* w, int64_t ws,
                        int64_t steps, float* acc, int64_t acc_v, const float* bs) {
  static_assert(WB_NP == 4, "the cases below");
  switch (np) {
    case 4: wb_call<Op, 4, NV, GS>(x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 3: wb_call<Op, 3, NV, GS>(x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 2: wb_call<Op, 2, NV, GS>(x, x_step, w, ws, steps, acc, acc_v, bs); break;
    default: wb_call<Op, 1, NV, GS>(x, x_step, w, ws, steps, acc, acc_v, bs); break;
  }
}

// The micro kernel of nv weight rows x np row pairs (1 .. WB_NV, 1 .. WB_NP), `steps` steps of Op.
template <class Op, bool GS>
inline void wb_micro_any(int64_t nv, int64_t np, const typename Op::T* x, int64_t x_step, const typename Op::T* w,
                         int64_t ws, int64_t steps, float* acc, int64_t acc_v, const float* bs) {
  static_assert(WB_NV == 6, "the cases below");
  switch (nv) {
    case 6: wb_micro_np<Op, 6, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 5: wb_micro_np<Op, 5, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 4: wb_micro_np<Op, 4, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 3: wb_micro_np<Op, 3, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
    case 2: wb_micro_np<Op, 2, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
    default: wb_micro_np<Op, 1, GS>(np, x, x_step, w, ws, steps, acc, acc_v, bs); break;
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


// The tile kernels of wide_batched as a policy (Tiles<BF>): BF = false, the FMA kernels on float32 tiles. Each
// member takes the pass's buffers whole (x's layout, the float32 tile, the bf16 tile) and uses its own.
template <bool BF>
struct Tiles;

template <>
struct Tiles<false> {
  static void layout(const float* x, int64_t xs, int64_t b0, int64_t nb, int64_t steps, float* xt) {
    wb_layout(x, xs, b0, nb, steps, xt);
  }
  template <class F>
  static void decode(const F& f, int64_t r, int64_t s0, int64_t n, float* wt, float*, float* bs) {
    wb_decode(f, r, s0, n, wt, bs);
  }
  // Block i of x's layout (steps s0 ..) against nv decoded rows of the tile.
  template <bool GS>
  static void micro(int64_t nv, int64_t np, const float* xt, int64_t i, int64_t steps, int64_t, int64_t s0,
                    const float* wt, const float*, int64_t ws, int64_t ks, float* acc, int64_t acc_v, const float* bs) {
    const float* xb = xt + i * steps * WB_ROWS * LANES + s0 * np * 16;
    wb_micro_any<FmaSteps, GS>(nv, np, xb, np * 16, wt, ws, ks, acc, acc_v, bs);
  }
};


}  // namespace
#endif  // TRTVOCAB_AVX512
