// fused/contract.h: the numerics contract, the ISA tiers (TRTVOCAB_AVX2 / AVX512 / DPBF16), 64-byte-line
// storage, constants, prefetch and L1 helpers, the row_tiles driver.
// Part of fused.cpp's one translation unit (included there first); gguf.cpp and probes.cpp include it too, for
// the same tiers (one set of ISA macros for the library).
#pragma once

// Every logit (x row n, weight row v) is one chain, computed the same way whatever the
// batch, the row range or the tile that holds it:
//   FP8    acc[8] = 0;  for step s = 0 .. S-1 (fixed order along H):  acc = fma(w_s, x_s, acc)
//   NVFP4  acc[8] = 0;  for group g:  part = 0;  for its 16 steps: part = fma(e2m1_s, x_s, part);
//                       acc = fma(part, block scales_g * 2**-8, acc)   (lane = block)
//   logit  = ((((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))) * 256) * scale + 0
// where a step is 8 weights decoded exactly to float32 (FP8: q * 2**-8, fused/vec8.h) and the 8
// matching inputs. Dense bf16 / fp16 / float32 rows run the FP8 chain with scale 1 and no 256 (DenseRows).
// The batch-1 kernel runs the chains of 8 (FP8, dense) or 1 (NVFP4, 4 lane groups per load)
// rows in registers; the direct kernel (batch 2..8) decodes each weight step once into registers
// for the chains of all x rows; the batched kernel (batch >= 9) decodes a tile of rows to float32
// once per K-chunk, keeps every chain's 8 lanes in memory between chunks (a float32 store is
// exact) and reuses the tile for all x rows.
// AVX-512 builds run 512-bit versions of these kernels with the same chains: a zmm holds two
// independent 8-lane chains (two weight rows, two NVFP4 lane groups, or, batch >= 9 (wide_batched),
// two x rows against one weight row's step broadcast to both halves), never one 16-lane chain. With
// AVX512-BF16 on AMD (dpbf16_pays_here), FP8 / NVFP4 at every batch and dense bf16 at batch 1..8 run two
// steps of each chain per vdpbf16ps, bitwise the two FMAs, wherever x and the weights fit (fused/avx512_bf16.h).

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>
#include <unistd.h>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <cpuid.h>
#include <immintrin.h>
#define TRTVOCAB_AVX2 1
#else
#define TRTVOCAB_AVX2 0
#endif
// The 512-bit kernels (batch 1..8: wide; batch >= 9: wide_batched): two independent 8-lane chains per
// zmm register (two weight rows, two NVFP4 lane groups, or two x rows), never one 16-lane chain.
#if TRTVOCAB_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define TRTVOCAB_AVX512 1
#else
#define TRTVOCAB_AVX512 0
#endif
// The vdpbf16ps kernels (FP8 / NVFP4 at every batch, where x fits): fused/avx512_bf16.h.
#if TRTVOCAB_AVX512 && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define TRTVOCAB_DPBF16 1
#else
#define TRTVOCAB_DPBF16 0
#endif

namespace {

// std::vector storage on 64-byte lines, so that no vector load of a re-laid-out x or a decoded tile spans
// two lines (malloc's 16-byte alignment split every other zmm load of x's pairs, a third slower where its
// address fell that way: docs/kernels.md, K1).
template <class T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
using Words = std::vector<uint32_t, LineAligned<uint32_t>>;
using Floats = std::vector<float, LineAligned<float>>;

constexpr int64_t LANES = 8;
constexpr int64_t BATCH_BLOCK = 64;   // x rows per pass over a decoded tile
constexpr float UNBIAS = 256.0f;      // decoded weights (FP8) and block scales (NVFP4) are q * 2**-8
constexpr int64_t PREFETCH_BYTES = 1024;  // how far ahead in a row the NVFP4 decoder prefetches

// A weight line the kernel reads soon (FP8 and dense rows: one stream per row): into L1, or into L2 only
// where it is read more than half an L1 of data later (`far`: fetched into L1 that early, it is evicted
// before use: docs/kernels.md, K2).
inline void prefetch(const void* p, bool far = false) {
#if defined(__GNUC__) || defined(__clang__)
  if (far) {
    __builtin_prefetch(p, 0, 2);
  } else {
    __builtin_prefetch(p, 0, 3);
  }
#else
  (void)p;
  (void)far;
#endif
}

// This CPU's L1D in bytes (sysconf; 32 KiB where unknown).
inline int64_t l1d_bytes() {
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL1_DCACHE_SIZE  // glibc
    const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
#else
    const long l1 = 0;
#endif
    return static_cast<int64_t>(l1 >= 16 * 1024 && l1 <= 1024 * 1024 ? l1 : 32 * 1024);
  }();
  return bytes;
}
// The bytes of x a pass keeps in L1: this CPU's L1D less 8 KiB for the weight lines in flight (48 KiB
// on Zen 5 and Intel from Ice Lake on, 32 KiB on Zen 4 and Cooper Lake).
inline int64_t x_in_l1_bytes() { return l1d_bytes() - 8 * 1024; }
// The bytes of x a K-chunk of the two-pair vdpbf16ps kernels keeps in L1: 16 KiB to spare (their passes
// read twice the weight lines, and their totals wait in memory).
inline int64_t x_chunk_in_l1_bytes() { return l1d_bytes() - 16 * 1024; }

// The NVFP4 decoders read 8 runs of 8 bytes per row and group (more streams than hardware prefetchers
// follow, a row at a time at batch 1, a tile's worth batched), so they ask ahead. The 512-bit kernels on
// an L1D under 48 KiB fetch the lines into L2 only: fetched into L1 a row or a pass ahead, they evicted
// x's chunk and each other before use. The 8-lane kernels there (compute bound, they want the lines in
// L1) and every kernel on a 48 KiB L1D keep L1 prefetches (docs/kernels.md, K3).
inline bool prefetch_to_l2() { return TRTVOCAB_AVX512 && l1d_bytes() < 48 * 1024; }
// The line at p, into L2 only where to_l2 (prefetch_to_l2, asked by the caller outside its loop: the guard of
// a function-local static is a possible call, and around one the compiler spills every live vector register,
// the block sums of a kernel that keeps them across its loads).
inline void prefetch_line(const void* p, bool to_l2) {
#if defined(__GNUC__) || defined(__clang__)
  if (to_l2) {
    __builtin_prefetch(p, 0, 2);
  } else {
    __builtin_prefetch(p, 0, 3);
  }
#else
  (void)p, (void)to_l2;
#endif
}
inline void prefetch_runs(const void* p) {
  static const bool to_l2 = prefetch_to_l2();
  prefetch_line(p, to_l2);
}

// The tile loop of the kernels that keep a tile's chains in memory between K-chunks (direct<N>, wide_nvfp4<N>,
// wide_nvfp4_lanes_bf16<N>): tiles of TILE weight rows on torch's threads; per tile, its chains `acc` (ACC floats
// a row) zeroed, passes over the chunks [c0, c1) (of `chunk`) of [0, extent), each pass(v0, tr, c0, c1, acc) over
// the tile's tr rows from row v0, then finish(v0, tr, acc). The pair kernels' loop is pair_tiles (avx512.h).
template <int64_t TILE, int64_t ACC, class Pass, class Finish>
inline void row_tiles(int64_t rows, int64_t extent, int64_t chunk, const Pass& pass, const Finish& finish) {
  const int64_t tiles = (rows + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[TILE * ACC];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t v0 = t * TILE, tr = std::min(TILE, rows - v0);
      std::fill(acc, acc + tr * ACC, 0.0f);
      for (int64_t c0 = 0; c0 < extent; c0 += chunk) pass(v0, tr, c0, std::min(extent, c0 + chunk), acc);
      finish(v0, tr, static_cast<const float*>(acc));
    }
  });
}

}  // namespace
