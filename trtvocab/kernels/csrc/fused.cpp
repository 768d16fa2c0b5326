// Fused dequantize-multiply CPU kernels of trtvocab's FP8 and NVFP4 LM heads.
//
// The C++ half of trtvocab/kernels/ (gemm.py documents the design and the numerics contract,
// build.py builds this file: torch.utils.cpp_extension, -O3 -march=native -fopenmp) called
// through ctypes.
// Threads: at::parallel_for (torch's own intra-op pool and OpenMP runtime).
//
// ==== THE DISPATCH TABLE: which kernel computes a call ===============================================
// Every cell computes the same bits (the chain of fused/contract.h): the choice is speed only, and the
// self-check (trtvocab/kernels/selfcheck.py) and tests/test_fused_kernels.py run every cell this CPU can.
//
// It stays a branch, not a table of function pointers: the ISA is fixed at compile time (#if, one build
// per -march), the batch band picks a template instantiation (run(): a switch on B, wide<N>: if constexpr),
// and the last conditions are read from the call's data at run time. The code of the choice is exactly:
// run() below (ISA, batch band), wide<N>() (AVX-512, batch 1..8), wide_batched<F>() (AVX-512, batch >= 9).
//
// Conditions:  bf16  = use_dpbf16() [vdpbf16ps on: mode of trtvocab_fused_set_dpbf16, default AMD only
//                      (dpbf16_pays_here), and bitwise the two FMAs on this CPU (dpbf16_matches_fma)]
//                      && x_fits_bf16(x) [every x value exact in bf16, zero or |x| in [2**-100, 2**100]]
//              bf16w = bf16 && the bf16 weights' exponents keep the domain (Bf16Pairs; checked per pass,
//                      a pass that meets one outside reruns on the FMA kernel)
//              inL1  = lanes_x_bytes(f, B) <= x_in_l1_bytes() [x's bf16 pairs fit in L1 less 8 KiB]
//
// format     batch  ISA tier (header)             condition       kernel
// ---------  -----  ----------------------------  --------------  ------------------------------------------
// FP8        1..8   AVX-512 BF16 (avx512_bf16.h)  bf16            wide_pairs_bf16<B, Fp8Pairs>
// dense bf16 1..8   AVX-512 BF16 (avx512_bf16.h)  bf16w           wide_pairs_bf16<B, Bf16Pairs>
// NVFP4      1      AVX-512 BF16 (avx512_bf16.h)  bf16            wide_nvfp4_runs_bf16<1>     (row runs)
// NVFP4      2      AVX-512 BF16 (avx512_bf16.h)  bf16            wide_nvfp4_lanes_bf16<2>    (block lanes)
// NVFP4      3..4   AVX-512 BF16 (avx512_bf16.h)  bf16 && inL1    wide_nvfp4_lanes_bf16<B>    (block lanes)
// NVFP4      3..8   AVX-512 BF16 (avx512_bf16.h)  bf16            wide_nvfp4_bf16<B>          (row pairs)
// FP8, dense 1..8   AVX-512 (avx512.h)            -               wide_direct<B>              (row pairs)
// NVFP4      1..2   AVX-512 (avx512.h)            -               wide_nvfp4<B>               (lane-group pairs)
// NVFP4      3..8   AVX-512 (avx512.h)            -               wide_nvfp4_pairs_of_rows<B> (row pairs)
// FP8, NVFP4 >= 9   AVX-512 BF16                  bf16            wide_batched<true>: wb_decode_bf16,
//                   (avx512_bf16_tiles.h)                         wb_micro_any_bf16 (bf16 step pairs)
// any        >= 9   AVX-512 (avx512_tiles.h)      -               wide_batched<false>: wb_decode, wb_micro_any
// any        1      portable / AVX2 (lanes8.h)    -               gemv (FP8, dense: kGemvRows rows at a time;
//                                                                 NVFP4: gemv_rows_nvfp4<1>, a row at a time)
// any        2..8   portable / AVX2 (lanes8.h)    -               direct<B> (NVFP4: gemv_rows_nvfp4<B>)
// any        >= 9   portable / AVX2 (lanes8.h)    -               batched
//
// A call runs the first row, top to bottom, whose format and batch match, whose tier the build has and
// whose condition holds. Tiers: TRTVOCAB_DPBF16 (AVX-512 F/BW/VL/DQ + BF16 + VBMI) > TRTVOCAB_AVX512
// (F/BW/VL/DQ) > TRTVOCAB_AVX2 (AVX2 + FMA + F16C) > portable C++; an AVX-512 build never reaches the 8-lane
// rows (its AVX2 code serves the 512-bit kernels' tails and finish). "dense" is bf16, fp16 or float32 rows;
// only bf16 ones take a bf16 row. Band limits: NVFP4_RUNS_MAX = 1, NVFP4_LANES_MAX = 4, NVGP_MAX = 2; 1..8
// against >= 9 is run()'s switch.
// GGUF formats (Q8_0, Q6_K, ...) have their own kernels and table in gguf.cpp (trtvocab_gguf_logits);
// the vocab tree's (max, sum exp) nodes are treesum.cpp. Why each cell wins where it does, with the
// measurements and the benchmarks/kernel_ab.py command that reproduces them: docs/kernels.md.

#include "fused/contract.h"
#include "fused/vec8.h"
#include "fused/rows.h"
#include "fused/lanes8.h"
#include "fused/avx512.h"
#include "fused/avx512_bf16.h"

namespace {

#if TRTVOCAB_AVX512
#if TRTVOCAB_DPBF16
// NVFP4 block lanes (wide_nvfp4_lanes_bf16) run batches 2..NVFP4_LANES_MAX: they read every x row once per
// weight row, so batches 3 and 4 take them only where all of x's pairs stay in L1 (the dispatch table's
// inL1; docs/kernels.md, K15).
constexpr int NVFP4_LANES_MAX = 4;
#endif  // TRTVOCAB_DPBF16

template <int N, class F>
void wide(const F& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
#if TRTVOCAB_DPBF16
  if constexpr (std::is_same_v<F, FP8Rows>) {
    if (use_dpbf16() && x_fits_bf16(x, N, xs, f.steps() * LANES)) {
      wide_pairs_bf16<N>(f, Fp8Pairs{}, x, xs, rows, out, os);
      return;
    }
  }
  if constexpr (std::is_same_v<F, DenseRows<Dense::BF16>>) {
    if (use_dpbf16() && x_fits_bf16(x, N, xs, f.steps() * LANES)) {
      int lo, hi;  // x's biased exponents, then the weights' that keep the domain (fused/avx512_bf16.h):
      x_exponents(x, N, xs, f.steps() * LANES, lo, hi);
      // e_w - 127 in [-110 - (lo - 127), 100 - (hi - 127)], normal and finite.
      lo = std::max(1, 144 - lo), hi = std::min(254, 354 - hi);
      if (lo <= hi) {
        wide_pairs_bf16<N>(f, Bf16Pairs(lo, hi), x, xs, rows, out, os);
        return;
      }
    }
  }
  if constexpr (F::kGroupScaled && N <= NVFP4_RUNS_MAX) {
    if (use_dpbf16() && x_fits_bf16(x, N, xs, f.blocks() / LANES * 16 * LANES)) {
      wide_nvfp4_runs_bf16<N>(f, x, xs, rows, out, os);
      return;
    }
  }
  // Batch 1 took row runs above under the same test, so block lanes start at batch 2.
  if constexpr (F::kGroupScaled && N > NVFP4_RUNS_MAX && N <= NVFP4_LANES_MAX) {
    if (use_dpbf16() && (N <= 2 || lanes_x_bytes(f, N) <= x_in_l1_bytes()) &&
        x_fits_bf16(x, N, xs, f.blocks() / LANES * 16 * LANES)) {
      wide_nvfp4_lanes_bf16<N>(f, x, xs, rows, out, os);
      return;
    }
  }
  if constexpr (F::kGroupScaled && N >= 3) {
    if (use_dpbf16() && x_fits_bf16(x, N, xs, f.blocks() / LANES * 16 * LANES)) {
      wide_nvfp4_bf16<N>(f, x, xs, rows, out, os);
      return;
    }
  }
#endif
  if constexpr (F::kGroupScaled) {
    if constexpr (N <= NVGP_MAX) {
      wide_nvfp4<N>(f, x, xs, rows, out, os);  // lane-group pairs: the fewest decode instructions
    } else {
      wide_nvfp4_pairs_of_rows<N>(f, x, xs, rows, out, os);  // row pairs: x broadcast, shared by P pairs
    }
  } else {
    wide_direct<N>(f, x, xs, rows, out, os);
  }
}
#endif  // TRTVOCAB_AVX512

}  // namespace

// Batch >= 9: the tile kernels (defined after wide<N>, as in one file: the same code, the same order).
#include "fused/avx512_tiles.h"
#include "fused/avx512_bf16_tiles.h"

namespace {

#if TRTVOCAB_AVX512

// BF: the vdpbf16ps micro kernels on bf16 pairs of the tile and of x (FP8 / NVFP4 where x fits).
template <bool BF, class F>
void wide_batched(const F& f, const float* x, int64_t n_rows, int64_t xs, int64_t rows, float* out, int64_t os) {
  constexpr bool GS = F::kGroupScaled;
  const int64_t steps = f.steps();
  const int64_t tiles = (rows + WB_TILE - 1) / WB_TILE;
  const int64_t passes = (n_rows + WB_PASS - 1) / WB_PASS;  // of equal size
  const int64_t pass = (n_rows + passes - 1) / passes;
  const int64_t ws = WB_CHUNK * LANES;
  const int64_t pairs = (steps + 1) / 2;
  // The f32 layout's size holds the bf16 one (half of it).
  Floats xt(static_cast<size_t>(((pass + WB_ROWS - 1) / WB_ROWS) * WB_ROWS * steps * LANES));
  uint32_t* xtb = reinterpret_cast<uint32_t*>(xt.data());
  for (int64_t b0 = 0; b0 < n_rows; b0 += pass) {
    const int64_t nb = std::min(pass, n_rows - b0), blocks = (nb + WB_ROWS - 1) / WB_ROWS;
    const int64_t acc_v = blocks * WB_ROWS * LANES;  // floats per weight row's chains
#if TRTVOCAB_DPBF16
    if constexpr (BF) {
      wb_layout_bf16(x, xs, b0, nb, steps, xtb);
    } else {
      wb_layout(x, xs, b0, nb, steps, xt.data());
    }
#else
    wb_layout(x, xs, b0, nb, steps, xt.data());
#endif
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      Floats wt(static_cast<size_t>(WB_TILE * ws)), acc(static_cast<size_t>(WB_TILE * acc_v)),
          wtb(static_cast<size_t>(BF ? WB_TILE * ws / 2 : 0));
      alignas(64) float bs[WB_TILE * (WB_CHUNK / 16) * LANES];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t v0 = t * WB_TILE, tr = std::min(WB_TILE, rows - v0);
        std::fill(acc.data(), acc.data() + WB_TILE * acc_v, 0.0f);
        for (int64_t s0 = 0; s0 < steps; s0 += WB_CHUNK) {
          const int64_t ks = std::min(WB_CHUNK, steps - s0);
          for (int64_t v = 0; v < tr; ++v) {
            if (s0 + WB_CHUNK < steps) {
              wb_prefetch(f, v0 + v, s0 + WB_CHUNK);
            } else if (v0 + WB_TILE + v < rows) {
              wb_prefetch(f, v0 + WB_TILE + v, 0);  // the next tile's first chunk
            }
#if TRTVOCAB_DPBF16
            if constexpr (BF) {
              wb_decode_bf16(f, v0 + v, s0, ks, reinterpret_cast<uint32_t*>(wtb.data()) + v * ws / 2,
                             bs + v * (WB_CHUNK / 16) * LANES, wt.data() + v * ws);
              continue;
            }
#endif
            wb_decode(f, v0 + v, s0, ks, wt.data() + v * ws, bs + v * (WB_CHUNK / 16) * LANES);
          }
          for (int64_t i = 0; i < blocks; ++i) {
            const int64_t np = (std::min(WB_ROWS, nb - i * WB_ROWS) + 1) / 2;
            float* acc_i = acc.data() + i * WB_ROWS * LANES;
            for (int64_t v = 0; v < tr; v += WB_NV) {
              const int64_t nv = std::min<int64_t>(WB_NV, tr - v);
              const float* bsv = bs + v * (WB_CHUNK / 16) * LANES;
#if TRTVOCAB_DPBF16
              if constexpr (BF) {
                const uint32_t* xb = xtb + i * pairs * WB_ROWS * LANES + (s0 / 2) * np * 16;
                wb_micro_any_bf16<GS>(nv, np, xb, np * 16, reinterpret_cast<const uint32_t*>(wtb.data()) + v * ws / 2,
                                      ws / 2, (ks + 1) / 2, acc_i + v * acc_v, acc_v, bsv);
                continue;
              }
#endif
              const float* xb = xt.data() + i * steps * WB_ROWS * LANES + s0 * np * 16;
              wb_micro_any<GS>(nv, np, xb, np * 16, wt.data() + v * ws, ws, ks, acc_i + v * acc_v, acc_v, bsv);
            }
          }
        }
        for (int64_t v = 0; v < tr; ++v) {
          const float scale = f.row_scale(v0 + v);
          for (int64_t n = 0; n < nb; ++n)
            out[(b0 + n) * os + v0 + v] = finish(vload(acc.data() + v * acc_v + n * LANES), scale, F::kUnbias);
        }
      }
    });
  }
}

// Batch >= 9: the vdpbf16ps tile kernel where it runs (FP8 / NVFP4, x fits), else the FMA one.
template <class F>
void wide_batched(const F& f, const float* x, int64_t n_rows, int64_t xs, int64_t rows, float* out, int64_t os) {
#if TRTVOCAB_DPBF16
  if constexpr (std::is_same_v<F, FP8Rows> || F::kGroupScaled) {
    if (use_dpbf16() && x_fits_bf16(x, n_rows, xs, f.steps() * LANES)) {
      wide_batched<true>(f, x, n_rows, xs, rows, out, os);
      return;
    }
  }
#endif
  wide_batched<false>(f, x, n_rows, xs, rows, out, os);
}
#endif

template <class F>
int run(const F& f, const float* x, int64_t n_rows, int64_t x_stride, int64_t rows, float* out, int64_t out_stride) {
  try {
    if (rows <= 0 || n_rows <= 0) return 0;
#if TRTVOCAB_AVX512
    switch (n_rows) {
      case 1: wide<1>(f, x, x_stride, rows, out, out_stride); return 0;
      case 2: wide<2>(f, x, x_stride, rows, out, out_stride); return 0;
      case 3: wide<3>(f, x, x_stride, rows, out, out_stride); return 0;
      case 4: wide<4>(f, x, x_stride, rows, out, out_stride); return 0;
      case 5: wide<5>(f, x, x_stride, rows, out, out_stride); return 0;
      case 6: wide<6>(f, x, x_stride, rows, out, out_stride); return 0;
      case 7: wide<7>(f, x, x_stride, rows, out, out_stride); return 0;
      case 8: wide<8>(f, x, x_stride, rows, out, out_stride); return 0;
      default: wide_batched(f, x, n_rows, x_stride, rows, out, out_stride); return 0;
    }
#endif
    switch (n_rows) {
      case 1: gemv(f, x, rows, out); break;
      case 2: direct<2>(f, x, x_stride, rows, out, out_stride); break;
      case 3: direct<3>(f, x, x_stride, rows, out, out_stride); break;
      case 4: direct<4>(f, x, x_stride, rows, out, out_stride); break;
      case 5: direct<5>(f, x, x_stride, rows, out, out_stride); break;
      case 6: direct<6>(f, x, x_stride, rows, out, out_stride); break;
      case 7: direct<7>(f, x, x_stride, rows, out, out_stride); break;
      case 8: direct<8>(f, x, x_stride, rows, out, out_stride); break;
      default: batched(f, x, n_rows, x_stride, rows, out, out_stride); break;
    }
    return 0;
  } catch (...) {
    return 1;
  }
}

// The multiply probe's vectors: the widest this build has (16 float32 lanes on AVX-512, 8 on AVX2; the
// portable build's scalar chains, one lane, whatever the compiler vectorizes them to). GCC / clang vector
// types: one chain loop for every build.
#if TRTVOCAB_AVX512
typedef float MulVec __attribute__((vector_size(64)));
#elif TRTVOCAB_AVX2
typedef float MulVec __attribute__((vector_size(32)));
#else
typedef float MulVec;
#endif
constexpr int64_t MUL_LANES = static_cast<int64_t>(sizeof(MulVec) / sizeof(float));

// One item of the multiply probe: `steps` rounds of 16 independent chains of multiplies by m on vectors V
// (MulVec); the sum of the chains' lanes.
template <class V>
float mul_chains(int64_t steps, float m) {
  V a[16];
  for (int i = 0; i < 16; ++i) a[i] = V{} + static_cast<float>(i + 1);
  const V f = V{} + m;
  for (int64_t s = 0; s < steps; ++s)
    for (int i = 0; i < 16; ++i) a[i] = a[i] * f;
  for (int i = 1; i < 16; ++i) a[0] = a[0] + a[i];
  if constexpr (std::is_same_v<V, float>) {
    return a[0];
  } else {
    float total = 0.0f;
    for (size_t l = 0; l < sizeof(V) / sizeof(float); ++l) total += a[0][l];
    return total;
  }
}

}  // namespace

extern "C" {

// Bumped whenever a signature below changes (the Python side checks it).
int trtvocab_fused_abi() { return 3; }

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

// The multiply probe of benchmarks/bandwidth.py: how many float32 multiplies a second this machine's cores
// make, with the heads' threads (at::parallel_for over get_num_threads() items: torch's pool gives each
// thread one; the count below holds however they fall, the rate is the machine's only then). Each item runs
// mul_chains: enough independent chains to cover a multiply's latency on every pipe that multiplies.
// Chain i starts at i + 1 (chains of one start would be one chain to the compiler: measured, it merged them)
// and `m` comes from the caller (1.0f keeps every value exact, so no chain over- or underflows, and a compiler
// cannot fold a multiplier it does not know); the chains' sum, MUL_LANES * 136 an item with m = 1, goes to
// `sink` (so they cannot be dropped). Returns the multiplies made: steps * 16 * MUL_LANES per item.
int64_t trtvocab_mul_probe(int64_t steps, float m, float* sink) {
  const int threads = at::get_num_threads();
  std::vector<float> sums(static_cast<size_t>(threads) + 1, 0.0f);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    float total = 0.0f;
    for (int64_t t = t0; t < t1; ++t) total += mul_chains<MulVec>(steps, m);
    sums[static_cast<size_t>(at::get_thread_num())] += total;
  });
  float total = 0.0f;
  for (float s : sums) total += s;
  *sink = total;
  return steps * 16 * MUL_LANES * threads;
}

// Which lane implementation this build uses: 3 = AVX-512 (F, BW, VL, DQ) kernels at every batch (the
// AVX2 8-lane code for their tails and the finish), 2 = AVX2 + FMA + F16C, 0 = portable C++.
int trtvocab_fused_isa() { return TRTVOCAB_AVX512 ? 3 : (TRTVOCAB_AVX2 ? 2 : 0); }

// 1: this build has the vdpbf16ps kernels (AVX-512 BF16 + VBMI), vdpbf16ps is the two FMAs on this CPU
// (dpbf16_matches_fma) and they are on (use_dpbf16): FP8 / NVFP4 heads whose x fits
// (x_fits_bf16) run them; else 0.
int trtvocab_fused_dpbf16() {
#if TRTVOCAB_DPBF16
  return use_dpbf16() ? 1 : 0;
#else
  return 0;
#endif
}

// Turn the vdpbf16ps kernels on (1: wherever they match the FMAs), off (0), or back to this CPU's default
// (-1: where they are faster, dpbf16_pays_here); returns trtvocab_fused_dpbf16(). The logits are the same
// bits either way: for the tests and benchmarks.
int trtvocab_fused_set_dpbf16(int mode) {
#if TRTVOCAB_DPBF16
  dpbf16_mode.store(mode < 0 ? -1 : (mode > 0 ? 1 : 0), std::memory_order_relaxed);
#else
  (void)mode;
#endif
  return trtvocab_fused_dpbf16();
}

// Whether x [n][len] (row stride xs) fits the vdpbf16ps kernels (x_fits_bf16: 1 / 0); -1 where this build
// has none. For the tests.
int trtvocab_fused_x_fits_bf16(const float* x, int64_t n, int64_t xs, int64_t len) {
#if TRTVOCAB_DPBF16
  return x_fits_bf16(x, n, xs, len) ? 1 : 0;
#else
  (void)x, (void)n, (void)xs, (void)len;
  return -1;
#endif
}

// out[n * out_stride + r] = sum_k x[n * x_stride + k] * e4m3(w[r * w_stride + k]) * scale[r * scale_stride]
// x: float32 [n_rows, x_stride], zero-padded past `hidden` to a multiple of 8 columns.
int trtvocab_fp8_logits(const float* x, int64_t n_rows, int64_t x_stride, int64_t hidden, const uint8_t* w,
                        int64_t rows, int64_t w_stride, const float* scale, int64_t scale_stride, float* out,
                        int64_t out_stride) {
  FP8Rows f{w, w_stride, hidden, scale, scale_stride};
  return run(f, x, n_rows, x_stride, rows, out, out_stride);
}

// out[n * out_stride + r] = sum_k x[n * x_stride + k] * w[r * w_stride + k], w bf16 (kind 0), fp16 (1) or
// float32 (2); x: float32 [n_rows, x_stride], zero-padded past `hidden` to a multiple of 8 columns.
int trtvocab_dense_logits(const float* x, int64_t n_rows, int64_t x_stride, int64_t hidden, const void* w,
                          int64_t rows, int64_t w_stride, int kind, float* out, int64_t out_stride) {
  if (kind < 0 || kind > 2) return 2;  // not a kind this build knows
  if (kind == 2) {
    DenseRows<Dense::F32> f{static_cast<const float*>(w), w_stride, hidden};
    return run(f, x, n_rows, x_stride, rows, out, out_stride);
  }
  const auto* h = static_cast<const uint16_t*>(w);
  if (kind == 1) {
    DenseRows<Dense::FP16> f{h, w_stride, hidden};
    return run(f, x, n_rows, x_stride, rows, out, out_stride);
  }
  DenseRows<Dense::BF16> f{h, w_stride, hidden};
  return run(f, x, n_rows, x_stride, rows, out, out_stride);
}

// out[n * out_stride + r] = sum_k x[k] * e2m1(code k of row r) * e4m3(block scale) * global_scale
// packed: block-major uint8 [rows, hidden / 2]; bscale: e4m3 bytes [rows, hidden / 16];
// x: float32 [n_rows, x_stride] in the kernel's step order (trtvocab.kernels.nvfp4_x).
int trtvocab_nvfp4_logits(const float* x, int64_t n_rows, int64_t x_stride, int64_t hidden, const uint8_t* packed,
                          int64_t rows, int64_t p_stride, const uint8_t* bscale, int64_t bs_stride,
                          float global_scale, float* out, int64_t out_stride) {
  NVFP4Rows f{packed, p_stride, hidden, bscale, bs_stride, global_scale};
  return run(f, x, n_rows, x_stride, rows, out, out_stride);
}

}  // extern "C"
