// fused/lanes8.h: the 8-lane kernels on V (any ISA): batch 1 gemv, batch 2..8 direct<N>, batch >= 9 batched.
// Part of fused.cpp's one translation unit (included there, in order, after the headers before it).
#pragma once

namespace {

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
  row_tiles<DIRECT_TILE, N * LANES>(rows, chunks, KC, [&](int64_t v0, int64_t tr, int64_t c0, int64_t c1, float* acc) {
    int64_t v = 0;
    for (; v + R <= tr; v += R) direct_chunk<N, R>(f, x, xs, v0 + v, c0, c1, acc + v * N * LANES);
    for (; v < tr; ++v) direct_chunk<N, 1>(f, x, xs, v0 + v, c0, c1, acc + v * N * LANES);
  }, [&](int64_t v0, int64_t tr, const float* acc) {
    for (int64_t v = 0; v < tr; ++v) {
      const float scale = f.row_scale(v0 + v);
      for (int n = 0; n < N; ++n) out[n * os + v0 + v] = finish(vload(acc + (v * N + n) * LANES), scale, F::kUnbias);
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

}  // namespace
