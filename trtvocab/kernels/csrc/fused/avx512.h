// fused/avx512.h: the AVX-512 (F, BW, VL, DQ) FMA kernels: batch 1..8 pair kernels (wide_direct,
// wide_nvfp4, wide_nvfp4_pairs_of_rows) and the batch >= 9 tile kernels (wb_*).
// Part of fused.cpp's one translation unit (included there, in order, after the headers before it).
#pragma once

// ---- AVX-512, batch 1..8: two independent 8-lane chains per zmm register ----------------------------
// The chains are those of fused/lanes8.h (the same steps, the same FMAs, the same tree), so a logit is bitwise the
// one of the 8-lane kernels: a zmm holds the 8-lane chains of two weight rows (FP8, dense: rows r, r + 1
// at the same step) or of two lane groups of one row (NVFP4: groups 2q, 2q + 1, each summed from zero
// and added to the row's 8-lane total in group order). Only the width of the instructions changes.
#if TRTVOCAB_AVX512

namespace {

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

// ---- AVX-512, batch >= 9: a decoded tile shared by every x row, two x rows per zmm ------------------
// The tile kernel's chains (batched, fused/lanes8.h), on 512-bit registers: a zmm holds the 8-lane chains of
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

}  // namespace
#endif  // TRTVOCAB_AVX512
