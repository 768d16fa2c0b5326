// fused/avx512.h: the AVX-512 (F, BW, VL, DQ) FMA kernels of batch 1..8 (wide_direct, wide_nvfp4,
// wide_nvfp4_pairs_of_rows).
// Part of fused.cpp's one translation unit (included there, in order, after the headers before it).
#pragma once

// ---- AVX-512, batch 1..8: two independent 8-lane chains per zmm register ----------------------------
// The chains are those of fused/lanes8.h (the same steps, the same FMAs, the same tree), so a logit is
// bitwise the one of the 8-lane kernels: a zmm holds the 8-lane chains of two weight rows (FP8, dense: rows r, r + 1
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
// with itself), then the rows the last pass prefetches (clamped to the shard). pr holds TILE + 4P.
template <int P, int64_t TILE>
inline void tile_row_pairs(int64_t* pr, int64_t v0, int64_t tr, int64_t rows) {
  const int64_t pairs = (tr + 1) / 2;
  for (int64_t i = 0; i < TILE + 4 * P; ++i) pr[i] = std::min(v0 + i, rows - 1);
  for (int64_t i = tr; i < 2 * pairs; ++i) pr[i] = v0 + tr - 1;
}

// The tile loop of the AVX-512 pair kernels: tiles of pair_tile_rows<P>() weight rows (WIDE_TILE rounded
// up to whole passes of P pairs: no pair left to run alone; K18) on torch's threads; per tile, passes over
// [c0, c1) chunks (of `chunk`) of [0, extent), each pass calling pass(P-constant, row pairs, c0, c1, acc)
// for P pairs at a time (then single pairs, in a shard's last tile), and finish(row, n, chain) per logit
// with its 8-lane chain from the pair's zmm accumulator.
template <int P>
constexpr int64_t pair_tile_rows() { return 2 * P * ((WIDE_TILE / 2 + P - 1) / P); }
template <int N, int P, class Pass, class Finish>
inline void pair_tiles(int64_t rows, int64_t extent, int64_t chunk, const Pass& pass, const Finish& finish) {
  constexpr int64_t TILE = pair_tile_rows<P>();
  const int64_t tiles = (rows + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[TILE / 2 * N * 16];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t v0 = t * TILE, tr = std::min(TILE, rows - v0);
      const int64_t pairs = (tr + 1) / 2;
      int64_t pr[TILE + 4 * P];
      tile_row_pairs<P, TILE>(pr, v0, tr, rows);
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
  // The next pass's lines, fetched a pass ahead: into L2 where a pass reads more than half an L1, and at
  // batch 7, 8 (x then takes more than half of a 32 KiB L1 itself; K18).
  const bool far = N >= 7 || 2 * P * (s1 - s0) * LANES * static_cast<int64_t>(sizeof(*f.w)) > l1d_bytes() / 2;
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

// FP8 / dense, batch N = 1..8: tiles of pair_tile_rows<P>() rows; each K-chunk of kDirectChunk steps is read
// for all the tile's rows (x's chunk stays in L1; at batch <= WHOLE_ROWS_MAX, and for float32 rows
// while x fits in L2, the chunk is the whole row: measured faster), P row pairs at a time, the next
// pass's rows prefetched; an odd last row is paired with itself (computed twice, written once).
constexpr int WHOLE_ROWS_MAX = 2;
// x's bytes (float32 rows side by side, or bf16 pairs) up to which a kernel runs whole rows: a quarter of
// the smallest L2 of the AVX-512 CPUs measured (1 MiB).
constexpr int64_t X_IN_L2_BYTES = 256 * 1024;
// NVFP4 batches up to this run in lane-group pairs (wide_nvfp4), larger ones in row pairs: measured.
constexpr int NVGP_MAX = 2;
template <int N, class F>
void wide_direct(const F& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  constexpr bool F32 = std::is_same_v<F, DenseRows<Dense::F32>>;
  // Row pairs per pass: P * N zmm chains and 2 P decoded steps in the 32 registers. float32 rows need
  // no decode registers: four pairs at batch 5, 6, three at 7, 8 (24 chains, 3 weights, 1 x; K17).
  constexpr int P_DECODED = N == 1 ? 8 : (N == 2 ? 5 : (N == 3 ? 5 : (N == 4 ? 4 : (N <= 6 ? 3 : 2))));
  constexpr int P = !F32 || N <= 4 ? P_DECODED : (N <= 6 ? 4 : 3);
  const int64_t steps = f.steps();
  // float32 rows run whole while x fits in L2 (K17: chunks of 32 rows' kDirectChunk steps held the
  // rows' streams from DRAM back), the others whole at batch <= WHOLE_ROWS_MAX.
  const bool whole = F32 ? steps * N * LANES * static_cast<int64_t>(sizeof(float)) <= X_IN_L2_BYTES
                         : N <= WHOLE_ROWS_MAX;
  const int64_t KC = whole ? steps : F::kDirectChunk;
  const Floats xt = rows_side_by_side<N>(x, xs, steps);
  pair_tiles<N, P>(
      rows, steps, KC,
      [&](auto p, const int64_t* prp, int64_t c0, int64_t c1, float* acc) {
        wide_steps<N, decltype(p)::value>(f, xt.data(), prp, c0, c1, acc);
      },
      [&](int64_t v, int n, V chain) { out[n * os + v] = finish(chain, f.row_scale(v), F::kUnbias); });
}

// The block sums of a lane-group pair (sum(n) for x row n; lanes 0-7: group 2q, 8-15: group 2q + 1) scaled
// by the pair's 16 FP8 block scales at `scales` and added to the row's N 8-lane totals, group 2q first.
template <int N, class Sum>
inline void add_pair_sums(const uint8_t* scales, const Sum& sum, V* acc) {
  const __m512 bs = fp8_decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
  for (int n = 0; n < N; ++n) {
    const __m512 part = sum(n);
    acc[n] = vfma(half0(part), half0(bs), acc[n]);
    acc[n] = vfma(half1(part), half1(bs), acc[n]);
  }
}

// The lane-group pair loop (wide_nvfp4_pairs, nvfp4_block_lanes_bf16): pairs [q0, q1) of row r, G at a time,
// each pair's block sums from zero (sums(bytes of run k, pair, k, its N sums) per run k), then added to the
// row's totals (add_pair_sums); acc: the row's N totals ([N][8]); the lines of row `ahead` prefetched.
template <int N, int G, class Sums>
inline void lane_pairs(const NVFP4Rows& f, int64_t r, int64_t q0, int64_t q1, float* acc_mem, int64_t ahead,
                       const Sums& sums) {
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
      for (int j = 0; j < G; ++j) sums(p + k * nb + j * 16, q + j, k, part[j]);
    }
    for (int j = 0; j < G; ++j) add_pair_sums<N>(srow + (q + j) * 16, [&](int n) { return part[j][n]; }, acc);
  }
  for (int n = 0; n < N; ++n) vstore(acc_mem + n * LANES, acc[n]);
}

// A row_tiles pass of the lane-group pair kernels over pairs [c0, c1): each of the tile's tr rows from v0, G
// pairs at a time, then the rest one by one; run(G-constant, row, q0, q1, its totals, the row after the next).
template <int N, int G, class Run>
inline void lane_pair_rows(int64_t rows, int64_t v0, int64_t tr, int64_t c0, int64_t c1, float* acc, const Run& run) {
  const int64_t whole = c0 + (c1 - c0) / G * G;
  for (int64_t i = 0; i < tr; ++i) {
    const int64_t ahead = std::min(rows - 1, v0 + i + 2);
    run(std::integral_constant<int, G>{}, v0 + i, c0, whole, acc + i * N * LANES, ahead);
    if (whole < c1) run(std::integral_constant<int, 1>{}, v0 + i, whole, c1, acc + i * N * LANES, ahead);
  }
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
  lane_pairs<N, G>(f, r, q0, q1, acc_mem, ahead, [&](const uint8_t* b, int64_t q, int64_t k, __m512 (&part)[N]) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m512 lo = _mm512_permutexvar_ps(v, table);  // vpermps reads the low 4 bits: the low nibble
    const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    const float* xq = xw + (q * 16 + 2 * k) * N * 16;
    for (int n = 0; n < N; ++n) part[n] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xq + n * 16), part[n]);
    for (int n = 0; n < N; ++n) part[n] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xq + (N + n) * 16), part[n]);
  });
}

// Batch 1..NVGP_MAX (larger batches run nvfp4_row_pairs, which reads half the x per FMA): a row runs
// whole, four pairs interleaved, the row after the next prefetched. Written for any N: tiles of
// WIDE_TILE rows, each K-chunk of pairs (N chunks of xw in L1, at most 16 KiB) read for all the
// tile's rows, whose totals wait in memory between chunks (a float32 store is exact).
// The logits of a tile's rows [v0, v0 + tr) from their chains (N a row; the pairs kernels' first 2 * pairs groups):
// the groups past them added by the 8-lane kernel, then finish.
template <int N>
inline void finish_nvfp4_tile(const NVFP4Rows& f, const float* x, int64_t xs, int64_t pairs, int64_t v0, int64_t tr,
                              const float* acc, float* out, int64_t os) {
  for (int64_t i = 0; i < tr; ++i) {
    for (int n = 0; n < N; ++n) {
      V a = vload(acc + (i * N + n) * LANES);
      for (int64_t g = 2 * pairs; g < f.groups(); ++g) a = nvfp4_groups<1>(f, x + n * xs, v0 + i, g, a);
      out[n * os + v0 + i] = finish(a, f.row_scale(v0 + i), NVFP4Rows::kUnbias);
    }
  }
}

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
  row_tiles<WIDE_TILE, N * LANES>(rows, pairs, CP, [&](int64_t v0, int64_t tr, int64_t c0, int64_t c1, float* acc) {
    lane_pair_rows<N, G>(rows, v0, tr, c0, c1, acc, [&](auto g, int64_t r, int64_t q0, int64_t q1, float* a, int64_t ahead) {
      wide_nvfp4_pairs<N, decltype(g)::value>(f, xw.data(), r, q0, q1, a, ahead);
    });
  }, [&](int64_t v0, int64_t tr, const float* acc) { finish_nvfp4_tile<N>(f, x, xs, pairs, v0, tr, acc, out, os); });
}

// The packed bytes of P NVFP4 row pairs: ra[p] row pr[2p], rb[p] row pr[2p + 1].
template <int P>
inline void pair_rows(const NVFP4Rows& f, const int64_t* pr, const uint8_t* (&ra)[P], const uint8_t* (&rb)[P]) {
  for (int p = 0; p < P; ++p) {
    ra[p] = f.packed + pr[2 * p] * f.p_stride;
    rb[p] = f.packed + pr[2 * p + 1] * f.p_stride;
  }
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
  pair_rows(f, pr, ra, rb);
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

}  // namespace
#endif  // TRTVOCAB_AVX512
