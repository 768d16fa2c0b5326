// Fused dequantize-multiply CPU kernels of trtvocab's FP8 and NVFP4 LM heads.
//
// The C++ half of trtvocab/kernels/ (gemm.py documents the design and the numerics contract,
// compile.py builds this file: torch.utils.cpp_extension, -O3 -march=native -fopenmp) called
// through ctypes.
// Threads: at::parallel_for (torch's own intra-op pool and OpenMP runtime).
//
// ==== THE DISPATCH TABLE: which kernel computes a call ===============================================
// Every cell computes the same bits (the chain of fused/contract.h): the choice is speed only, and the
// self-check (trtvocab/kernels/selfcheck.py) and the tests of tests/kernels/ (test_isa_paths.py, test_dpbf16.py,
// test_tiles.py, test_dense_kernel.py) run every cell this CPU can.
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
//                   (avx512_bf16_tiles.h)                         wb_micro_any<Bf16Steps> (bf16 step pairs)
// any        >= 9   AVX-512 (avx512_tiles.h)      -               wide_batched<false>: wb_decode, wb_micro_any<FmaSteps>
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
// GGUF formats (Q8_0, Q6_K, ...) have their own kernels in gguf.cpp (trtvocab_gguf_logits, on these tiers);
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

// BF: the vdpbf16ps micro kernels on bf16 pairs of the tile and of x (FP8 / NVFP4 where x fits): the tile
// kernels are the policy Tiles<BF> (fused/avx512_tiles.h, fused/avx512_bf16_tiles.h).
template <bool BF, class F>
void wide_batched(const F& f, const float* x, int64_t n_rows, int64_t xs, int64_t rows, float* out, int64_t os) {
  using T = Tiles<BF>;
  constexpr bool GS = F::kGroupScaled;
  const int64_t steps = f.steps();
  const int64_t tiles = (rows + WB_TILE - 1) / WB_TILE;
  const int64_t passes = (n_rows + WB_PASS - 1) / WB_PASS;  // of equal size
  const int64_t pass = (n_rows + passes - 1) / passes;
  const int64_t ws = WB_CHUNK * LANES;
  const int64_t pairs = (steps + 1) / 2;
  // The f32 layout's size holds the bf16 one (half of it).
  Floats xt(static_cast<size_t>(((pass + WB_ROWS - 1) / WB_ROWS) * WB_ROWS * steps * LANES));
  for (int64_t b0 = 0; b0 < n_rows; b0 += pass) {
    const int64_t nb = std::min(pass, n_rows - b0), blocks = (nb + WB_ROWS - 1) / WB_ROWS;
    const int64_t acc_v = blocks * WB_ROWS * LANES;  // floats per weight row's chains
    T::layout(x, xs, b0, nb, steps, xt.data());
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
            T::decode(f, v0 + v, s0, ks, wt.data() + v * ws, wtb.data() + v * ws / 2, bs + v * (WB_CHUNK / 16) * LANES);
          }
          for (int64_t i = 0; i < blocks; ++i) {
            const int64_t np = (std::min(WB_ROWS, nb - i * WB_ROWS) + 1) / 2;
            float* acc_i = acc.data() + i * WB_ROWS * LANES;
            for (int64_t v = 0; v < tr; v += WB_NV) {
              const int64_t nv = std::min<int64_t>(WB_NV, tr - v);
              const float* bsv = bs + v * (WB_CHUNK / 16) * LANES;
              T::template micro<GS>(nv, np, xt.data(), i, steps, pairs, s0, wt.data() + v * ws, wtb.data() + v * ws / 2,
                                    ws, ks, acc_i + v * acc_v, acc_v, bsv);
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

}  // namespace

extern "C" {

// The library's ABI (its C functions here, in treesum.cpp, gguf.cpp and probes.cpp): bumped whenever one is
// added or its signature changes, with trtvocab.kernels.compile.ABI and SYMBOLS (the Python side checks it).
int trtvocab_fused_abi() { return 4; }

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
