// fused/avx512_bf16.h: the AVX-512 BF16 (vdpbf16ps) kernels of batch 1..8 (wide_pairs_bf16, wide_nvfp4_bf16,
// wide_nvfp4_lanes_bf16, wide_nvfp4_runs_bf16) and the vdpbf16ps domain checks (use_dpbf16, x_fits_bf16).
// Part of fused.cpp's one translation unit (included there, in order, after the headers before it).
#pragma once

// ---- AVX-512 BF16: two chain steps per vdpbf16ps ------------------------------------------------------
// vdpbf16ps(acc, a, b) computes, per 32-bit lane i, acc = fma(a[2i+1], b[2i+1], acc) and then
// acc = fma(a[2i], b[2i], acc), each rounded to float32 (measured bitwise on Zen 5; dpbf16_matches_fma
// re-checks it once per process), except that it reads subnormal inputs as zero and flushes subnormal
// results. So a chain's steps s and s + 1 in one instruction (odd slot: step s, even slot: step s + 1)
// are the two FMAs of the chain (fused/contract.h), bit for bit, where every weight and x value is exact
// in bf16 (FP8 q * 2**-8 and e2m1 values are) and no operand or partial sum can be subnormal or overflow: every
// nonzero |x| in [2**-100, 2**100] (x_fits_bf16, checked per call) makes every product and partial sum
// a multiple of 2**-124 (x's LSB >= 2**-107, FP8's 2**-17, e2m1's 2**-1) and below 2**125. Otherwise
// the FMA kernels run: the choice never changes a bit. Dense bf16 weights have any exponent, so their
// domain is checked as they are read (Bf16Pairs): with x's nonzero exponents in [ex_lo, ex_hi], every
// nonzero weight's exponent in [-110 - ex_lo, 100 - ex_hi] keeps the same two bounds; a pass that meets
// one outside reruns on FMAs from the chains it started with.
#if TRTVOCAB_DPBF16

namespace {

inline __m512 dpbf16(__m512 acc, __m512 a, __m512 b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);  // vector casts: the same 64 bytes
}

// Adversarial lanes inside the domain the kernels use (weights: FP8 q * 2**-8, e2m1 values or bf16 of
// magnitude 2**-10 .. 2; x: zero or bf16 of magnitude 2**-100 .. 2**100; acc: multiples of 2**-124 below
// 2**100): signed zeros, exact cancellation, ties, the smallest and largest products, random values.
// vdpbf16ps against the two FMAs, once per process.
bool dpbf16_check() {
  alignas(64) uint16_t a[32], b[32];
  alignas(64) float acc[16], got[16], want[16];
  uint32_t seed = 12345u;
  auto rnd = [&seed]() {
    seed = seed * 1664525u + 1013904223u;
    return seed >> 8;
  };
  auto bf = [](float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<uint16_t>(u >> 16);
  };
  auto fl = [](uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    return v;
  };
  auto weight = [&]() {
    const uint32_t r = rnd();
    if ((r & 7) == 7)  // a dense bf16 weight, any mantissa, exponent -10 .. 0 (x's bounds: the same domain)
      return fl(static_cast<uint16_t>(((r & 8) << 12) | ((127 - (r >> 4) % 11) << 7) | ((r >> 9) & 0x7F)));
    if (r & 1) {  // e2m1
      const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
      return (r & 16) ? -mags[(r >> 1) & 7] : mags[(r >> 1) & 7];
    }
    const int q = static_cast<int>((r >> 1) & 0xFF), e = (q >> 3) & 0xF, m = q & 7;
    if ((q & 0x7F) == 0x7F) return 0.0f;
    const float mag = e ? std::ldexp(1.0f + m / 8.0f, e - 7 - 8) : std::ldexp(m / 8.0f, -6 - 8);
    return (q & 0x80) ? -mag : mag;
  };
  auto xval = [&]() {
    const uint32_t r = rnd();
    if ((r & 15) == 0) return (r & 16) ? -0.0f : 0.0f;
    const uint32_t e = 27 + (r >> 4) % 201;  // biased exponents of 2**-100 .. 2**100
    return fl(static_cast<uint16_t>(((r & 32) << 10) | (e << 7) | ((r >> 12) & 0x7F)));
  };
  for (int round = 0; round < 4096; ++round) {
    for (int i = 0; i < 16; ++i) {
      float a1 = weight(), b1 = xval(), a0 = weight(), b0 = xval();
      const int e = static_cast<int>(rnd() % 200) - 100;
      float c = std::ldexp(static_cast<float>(static_cast<int32_t>(rnd()) - (1 << 23)), e - 24);
      switch (rnd() % 8) {
        case 0: c = -(a1 * b1); break;  // exact cancellation, then a0 b0
        case 1: a1 = (i & 1) ? -0.0f : 0.0f; c = (i & 2) ? -0.0f : 0.0f; a0 = (i & 4) ? -0.0f : 0.0f; break;
        case 2: a1 = 0x1p-8f; b1 = (i & 1) ? 0x1p-16f : -0x1p-16f; c = (i & 2) ? 1.0f : 3.0f; break;  // ties
        case 3: a1 = 0x1p-17f; b1 = -0x1p-100f; c = 0x1p-100f; a0 = -0x1p-17f; b0 = 0x1p-100f; break;  // smallest
        case 4: a1 = 6.0f; b1 = 0x1p100f; a0 = -1.75f; b0 = 0x1p100f; c = 0x1p100f; break;   // largest
        case 5: c = -(a1 * b1) - a0 * b0; break;
        default: break;
      }
      a[2 * i + 1] = bf(a1), b[2 * i + 1] = bf(b1), a[2 * i] = bf(a0), b[2 * i] = bf(b0);
      acc[i] = c;
    }
    const __m512 va = _mm512_load_ps(reinterpret_cast<const float*>(a));
    const __m512 vb = _mm512_load_ps(reinterpret_cast<const float*>(b));
    _mm512_store_ps(got, dpbf16(_mm512_load_ps(acc), va, vb));
    for (int i = 0; i < 16; ++i)
      want[i] = std::fmaf(fl(a[2 * i]), fl(b[2 * i]), std::fmaf(fl(a[2 * i + 1]), fl(b[2 * i + 1]), acc[i]));
    if (std::memcmp(got, want, sizeof(got)) != 0) return false;
  }
  return true;
}
bool dpbf16_matches_fma() {
  static const bool ok = dpbf16_check();
  return ok;
}

// Whether the vdpbf16ps kernels beat the FMA ones on this CPU: two chain steps per instruction pay only
// where a 512-bit vdpbf16ps issues about as often as a 512-bit FMA. AMD's Zen 4 and Zen 5 run it on their
// FMA pipes; Intel's Xeons issue it at a quarter of the FMA rate, and there the FMA kernels are faster.
// The AMX tdpbf16ps of those Xeons is no way out either: it is not two rounded FMAs per pair (most of its
// lanes differ from them, in either order). So: AMD only, unless trtvocab_fused_set_dpbf16 says otherwise
// (docs/kernels.md, K5).
bool dpbf16_pays_here() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return std::strcmp(vendor, "AuthenticAMD") == 0;
}
std::atomic<int> dpbf16_mode{-1};  // -1: dpbf16_pays_here; 0: never; 1: wherever dpbf16_matches_fma
bool use_dpbf16() {
  const int mode = dpbf16_mode.load(std::memory_order_relaxed);
  static const bool pays = dpbf16_pays_here();
  return mode != 0 && dpbf16_matches_fma() && (mode == 1 || pays);
}

// Whether every value of x [n][len] (row stride xs) is exact in bf16 (the low 16 bits zero) and zero or
// of magnitude in [2**-100, 2**100] (so finite).
inline bool x_fits_bf16(const float* x, int64_t n, int64_t xs, int64_t len) {
  const __m512i low = _mm512_set1_epi32(0xFFFF), abs = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i lo = _mm512_set1_epi32(0x0D800000), hi = _mm512_set1_epi32(0x71800000);  // 2**-100, 2**100
  for (int64_t r = 0; r < n; ++r) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(x + r * xs);
    int64_t i = 0;
    __mmask16 bad = 0;
    for (; i + 16 <= len; i += 16) {
      const __m512i v = _mm512_loadu_si512(p + i), m = _mm512_and_si512(v, abs);
      bad |= _mm512_test_epi32_mask(v, low) |
             (_mm512_cmpgt_epi32_mask(m, _mm512_setzero_si512()) &
              (_mm512_cmpgt_epi32_mask(lo, m) | _mm512_cmpgt_epi32_mask(m, hi)));
    }
    if (bad) return false;
    for (; i < len; ++i) {
      const uint32_t u = p[i], m = u & 0x7FFFFFFFu;
      if ((u & 0xFFFFu) || (m && (m < 0x0D800000u || m > 0x71800000u))) return false;
    }
  }
  return true;
}

// The biased exponents of x's nonzero values [n][len] (row stride xs): lo, hi (both 127 where all are zero).
inline void x_exponents(const float* x, int64_t n, int64_t xs, int64_t len, int& lo, int& hi) {
  lo = 255, hi = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < len; ++i) {
      uint32_t u;
      std::memcpy(&u, x + r * xs + i, 4);
      if (u & 0x7FFFFFFFu) {
        const int e = static_cast<int>((u >> 23) & 0xFF);
        lo = std::min(lo, e), hi = std::max(hi, e);
      }
    }
  if (lo > hi) lo = hi = 127;
}

// x rows side by side as bf16 step pairs: pair t of x row n (steps 2t, 2t + 1 of `step(n, s)`, 8 floats
// each) at [t][n][C][8] (C copies: 2 lay out the zmm that bcast_pair would build, for a plain load): the
// high 16 bits (x exact in bf16) of step 2t, then those of step 2t + 1; word i from value order[i] of the steps.
template <int N, int C = 1, class Step>
inline Words bf16_pairs(int64_t pairs, const Step& step, __m256i order = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)) {
  Words xb(static_cast<size_t>(std::max<int64_t>(1, pairs * N * C * LANES)));
  for (int64_t t = 0; t < pairs; ++t)
    for (int n = 0; n < N; ++n) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step(n, 2 * t)));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step(n, 2 * t + 1)));
      const __m256i v = _mm256_permutevar8x32_epi32(
          _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))), _mm256_srli_epi32(b, 16)),
          order);
      for (int c = 0; c < C; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb.data() + ((t * N + n) * C + c) * LANES), v);
    }
  return xb;
}
inline __m512 bcast_pair(const uint32_t* p) {
  return _mm512_castsi512_ps(_mm512_broadcast_i32x8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

// e4m3 codes -> bf16 pairs by table: byte tables lo / hi of the bf16 bits of every magnitude's q * 2**-8
// (from fp8_decode8, so bitwise its values), looked up by vpermi2b (7-bit index: the sign bit is
// ignored, then ORed in). spread puts the 32 codes of steps s, s + 1 of rows a | b (a 32-byte load of
// two 16-byte runs) in both bytes of their words: lane i's high word step s, its low word step s + 1.
// Fewer cycles than the float32 decode and merge (docs/kernels.md, K6).
struct Fp8Bf16Tables {
  __m512i lo0, lo1, hi0, hi1, spread, sign;
};
inline const Fp8Bf16Tables& fp8_bf16_tables() {
  static const Fp8Bf16Tables t = [] {
    alignas(64) uint8_t lo[128], hi[128], spread[64];
    for (int m = 0; m < 128; m += 8) {
      uint8_t codes[LANES];
      alignas(32) float v[LANES];
      for (int i = 0; i < LANES; ++i) codes[i] = static_cast<uint8_t>(m + i);
      vstore(v, fp8_decode8(codes));
      for (int i = 0; i < LANES; ++i) {
        uint32_t u;
        std::memcpy(&u, &v[i], 4);
        lo[m + i] = static_cast<uint8_t>(u >> 16);
        hi[m + i] = static_cast<uint8_t>(u >> 24);
      }
    }
    for (int i = 0; i < 16; ++i) {  // lane i: row a (bytes 0-15) below 8, row b (16-31) from 8
      const int row = i < 8 ? 0 : 16, c = i % 8;
      spread[4 * i] = spread[4 * i + 1] = static_cast<uint8_t>(row + 8 + c);  // low word: step s + 1
      spread[4 * i + 2] = spread[4 * i + 3] = static_cast<uint8_t>(row + c);  // high word: step s
    }
    return Fp8Bf16Tables{_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi),
                         _mm512_load_si512(hi + 64), _mm512_load_si512(spread),
                         _mm512_set1_epi16(static_cast<short>(0x8000))};
  }();
  return t;
}
inline __m512 fp8_pairs_bf16(const uint8_t* a, const uint8_t* b, const Fp8Bf16Tables& t) {
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  const __m512i d = _mm512_permutexvar_epi8(t.spread, _mm512_zextsi256_si512(v));
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, d, t.lo1), hi = _mm512_permutex2var_epi8(t.hi0, d, t.hi1);
  const __m512i w = _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, lo, hi);  // odd bytes: the high ones
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(w, d, t.sign, 0xF8));  // w | (d & sign)
}

// FP8 codes of steps s, s + 1 of rows a | b as bf16 pairs (fp8_pairs_bf16); FP8 weights are always in the
// vdpbf16ps domain.
struct Fp8Pairs {
  // x's pairs in two copies (a plain zmm load, no broadcast): faster for FP8; bf16 rows, which read twice
  // the bytes, were slower with them and keep one (docs/kernels.md, K7).
  static constexpr int kXCopies = 2;
  const Fp8Bf16Tables& t = fp8_bf16_tables();
  __m512 operator()(const uint8_t* a, const uint8_t* b) { return fp8_pairs_bf16(a, b, t); }
  bool in_domain() const { return true; }
  template <int P, int N>
  static bool chains_in_domain(const __m512 (&)[P][N]) { return true; }
};

// Dense bf16 steps s, s + 1 of rows a | b (16 values of each) as bf16 pairs: one vpermw over the two rows'
// 32 bytes (lane i < 8: row a's value i of step s in the high word, of step s + 1 in the low one; i >= 8: row
// b's). Each weight's magnitude bits u = w << 1 are folded into a running max (u) and min (u - 1: a zero
// wraps to the top, so zeros always pass): in_domain says whether every nonzero weight read so far has a
// biased exponent in [lo, hi] (the vdpbf16ps domain for this call's x, see above).
struct Bf16Pairs {
  static constexpr int kXCopies = 1;
  __m512i idx, one = _mm512_set1_epi16(1), umax = _mm512_setzero_si512(), tmin = _mm512_set1_epi32(-1);
  uint16_t u_lo, u_end;  // nonzero u must lie in [u_lo, u_end)
  Bf16Pairs(int lo, int hi) : u_lo(static_cast<uint16_t>(lo << 8)), u_end(static_cast<uint16_t>((hi + 1) << 8)) {
    alignas(64) uint16_t w[32];
    for (int i = 0; i < 16; ++i) {
      const int base = i < 8 ? 0 : 16, l = i % 8;
      w[2 * i] = static_cast<uint16_t>(base + 8 + l);  // low word: step s + 1
      w[2 * i + 1] = static_cast<uint16_t>(base + l);  // high word: step s
    }
    idx = _mm512_load_si512(w);
  }
  __m512 operator()(const uint16_t* a, const uint16_t* b) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
    const __m512i u = _mm512_slli_epi16(v, 1);
    umax = _mm512_max_epu16(umax, u);
    tmin = _mm512_min_epu16(tmin, _mm512_sub_epi16(u, one));
    return _mm512_castsi512_ps(_mm512_permutexvar_epi16(idx, v));
  }
  bool in_domain() const {
    return !(_mm512_cmpge_epu16_mask(umax, _mm512_set1_epi16(static_cast<short>(u_end))) |
             _mm512_cmplt_epu16_mask(tmin, _mm512_set1_epi16(static_cast<short>(u_lo - 1))));
  }
  // A K-chunk's chains as it starts: a pass that reran on FMAs may have left one subnormal (which
  // vdpbf16ps would read as zero), off the 2**-124 grid or past 2**125; such rows stay on FMAs. Nonzero
  // chains in [2**-100, 2**125) are safe (their ulp is at least 2**-124).
  template <int P, int N>
  static bool chains_in_domain(const __m512 (&a)[P][N]) {
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), lo = _mm512_set1_epi32(0x0D800000);
    const __m512i end = _mm512_set1_epi32(0x7E000000);
    __mmask16 bad = 0;
    for (int p = 0; p < P; ++p)
      for (int n = 0; n < N; ++n) {
        const __m512i m = _mm512_and_si512(_mm512_castps_si512(a[p][n]), abs);
        bad |= _mm512_test_epi32_mask(m, m) & (_mm512_cmplt_epu32_mask(m, lo) | _mm512_cmpge_epu32_mask(m, end));
      }
    return bad == 0;
  }
};

// Steps [s0, s1) (s0 even) of P row pairs for N x rows (FP8 or dense bf16 rows, decoded by D: Fp8Pairs /
// Bf16Pairs): full step pairs by vdpbf16ps (step s in the high half of each 32-bit lane), the rest by
// wide_steps; a pass whose weights left D's domain reruns whole by wide_steps from the chains it started
// with (still in acc). xb: bf16_pairs of x; xt: x for wide_steps; acc: [P][N][16].
template <int N, int P, class F, class D>
inline void wide_steps_bf16(const F& f, D dec, const float* xt, const uint32_t* xb, const int64_t* pr, int64_t s0,
                            int64_t s1, float* acc) {
  __m512 a[P][N];
  load_chains(acc, a);
  if (!D::chains_in_domain(a)) {  // an earlier pass of these rows ran on FMAs and left a chain outside
    wide_steps<N, P>(f, xt, pr, s0, s1, acc);
    return;
  }
  const int64_t full = std::min(s1, f.full_steps());
  constexpr int64_t kBytes = static_cast<int64_t>(sizeof(*f.w));
  // The next pass's lines, fetched a pass ahead: into L2 where a pass reads more than half an L1.
  const bool far = 2 * P * (s1 - s0) * LANES * kBytes > l1d_bytes() / 2;
  int64_t s = s0;
  for (; s + 1 < full; s += 2) {
    if (((s * kBytes) & 7) == 0)  // a new 64-byte line of each row: fetch it for the next P pairs
      for (int i = 0; i < 2 * P; ++i) f.prefetch_row(pr[2 * P + i], s, far);
    __m512 w[P];
    for (int p = 0; p < P; ++p)
      w[p] = dec(f.w + pr[2 * p] * f.w_stride + s * LANES, f.w + pr[2 * p + 1] * f.w_stride + s * LANES);
    for (int n = 0; n < N; ++n) {
      const uint32_t* xp = xb + ((s / 2) * N + n) * D::kXCopies * LANES;
      const __m512 xv = D::kXCopies == 2 ? _mm512_loadu_ps(reinterpret_cast<const float*>(xp)) : bcast_pair(xp);
      for (int p = 0; p < P; ++p) a[p][n] = dpbf16(a[p][n], w[p], xv);
    }
  }
  if (!dec.in_domain()) {
    wide_steps<N, P>(f, xt, pr, s0, s1, acc);
    return;
  }
  store_chains(a, acc);
  if (s < s1) wide_steps<N, P>(f, xt, pr, s, s1, acc);
}

// FP8 / dense bf16, batch N = 1..8, by vdpbf16ps: wide_direct's tiles, passes and chains; D: the pair decoder.
template <int N, class F, class D>
void wide_pairs_bf16(const F& f, const D& dec, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  // Row pairs per pass: P * N zmm chains, P weight steps, x and the decoder's registers in the 32
  // (the fastest P of each batch: docs/kernels.md, K8).
  constexpr int P = N <= 2 ? 8 : (N <= 6 ? 4 : 2);
  const int64_t steps = f.steps();
  // Whole rows while x's bf16 pairs fit in L2 (a row pair's pass then reads them from L2 at half the
  // weights' bytes): faster than chunks of kDirectChunk steps (docs/kernels.md, K9).
  const Floats xt = rows_side_by_side<N>(x, xs, steps);
  const Words xb = bf16_pairs<N, D::kXCopies>(
      f.full_steps() / 2, [&](int n, int64_t s) { return x + n * xs + s * LANES; });
  const int64_t x_bytes = static_cast<int64_t>(xb.size() * sizeof(uint32_t));
  int64_t KC = x_bytes <= X_IN_L2_BYTES ? steps : F::kDirectChunk;  // even
  // Two row pairs a pass (B = 7, 8) take 32 bytes of x's pairs (two copies) per vdpbf16ps: from L2 that
  // held FP8 back. Where K-chunks of FP8_L1_CHUNK steps keep them in L1 with 16 KiB to spare (N * 4 KiB:
  // Zen 5's 48 KiB L1D, not Zen 4's 32 KiB), they run in those (docs/kernels.md, K10).
  constexpr int64_t FP8_L1_CHUNK = 128;
  if constexpr (D::kXCopies == 2 && P == 2) {
    const int64_t chunk_bytes = FP8_L1_CHUNK / 2 * N * D::kXCopies * LANES * 4;
    if (steps > FP8_L1_CHUNK && chunk_bytes <= x_chunk_in_l1_bytes()) KC = FP8_L1_CHUNK;
  }
  pair_tiles<N, P>(
      rows, steps, KC,
      [&](auto p, const int64_t* prp, int64_t c0, int64_t c1, float* acc) {
        wide_steps_bf16<N, decltype(p)::value>(f, dec, xt.data(), xb.data(), prp, c0, c1, acc);
      },
      [&](int64_t v, int n, V chain) { out[n * os + v] = finish(chain, f.row_scale(v), F::kUnbias); });
}

// The bf16 bits of the 16 e2m1 values (code 8: -0.0), twice over: vpermw reads a word's low 5 bits.
inline __m512i e2m1_bf16_table() {
  return _mm512_set_epi16(
      static_cast<short>(0xC0C0), static_cast<short>(0xC080), static_cast<short>(0xC040), static_cast<short>(0xC000),
      static_cast<short>(0xBFC0), static_cast<short>(0xBF80), static_cast<short>(0xBF00), static_cast<short>(0x8000),
      0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0x0000, static_cast<short>(0xC0C0),
      static_cast<short>(0xC080), static_cast<short>(0xC040), static_cast<short>(0xC000), static_cast<short>(0xBFC0),
      static_cast<short>(0xBF80), static_cast<short>(0xBF00), static_cast<short>(0x8000), 0x40C0, 0x4080, 0x4040,
      0x4000, 0x3FC0, 0x3F80, 0x3F00, 0x0000);
}

// NVFP4 row pairs by vdpbf16ps, decoded with one shuffle per 32 weights. Byte k of a block holds steps 2k
// (low nibble) and 2k + 1 (high nibble), one bf16 pair. The 8 bytes of a group's k of rows a and b are
// broadcast to the low and high four qwords (8-byte broadcast loads), qword m shifted right by 8m: its
// dwords then start at bytes m and m + 4, so lanes 2m, 2m + 1 of a row hold blocks m, m + 4 (SPREAD_ORDER).
// Shifts and a vpternlogd put the low nibble in the high word and the high nibble in the low word, and one
// vpermw maps each word's low 5 bits through the e2m1 bf16 table (twice over: bit 4 ignored). x's pairs
// and the block scales are laid out in that lane order, and the totals are put back in block order before
// the reduction tree (unspread): the chains are nvfp4_row_pairs', lane for lane. Why: every shuffle takes
// one of vdpbf16ps's two pipes on Zen 5, and the four-shuffle decode (vpmovzxbd, vpmultishiftqb, vpermw
// and the 16-byte merge) held a loop of two row pairs at batch 8 to 0.73 of the vdpbf16ps rate, this one
// to 0.92 (weights and x in L1, one thread).
alignas(32) constexpr int32_t SPREAD_ORDER[LANES] = {0, 4, 1, 5, 2, 6, 3, 7};  // lane -> block of the group
// SPREAD_ORDER as vpermd indices (x's pairs into lane order); its inverse (a chain back to block order).
inline __m256i spread_order() { return _mm256_load_si256(reinterpret_cast<const __m256i*>(SPREAD_ORDER)); }
constexpr std::array<int32_t, LANES> spread_inverse_table() {
  std::array<int32_t, LANES> inv{};
  for (int i = 0; i < LANES; ++i) inv[static_cast<size_t>(SPREAD_ORDER[i])] = i;
  return inv;
}
alignas(32) constexpr std::array<int32_t, LANES> SPREAD_INVERSE = spread_inverse_table();
inline __m256i spread_inverse() { return _mm256_load_si256(reinterpret_cast<const __m256i*>(SPREAD_INVERSE.data())); }
struct SpreadPairs {
  __m512i shift = _mm512_set_epi64(24, 16, 8, 0, 24, 16, 8, 0);
  __m512i low_words = _mm512_set1_epi32(0xFFFF);
  __m512i table = e2m1_bf16_table();
  // The block scales' vpshufb: rows a | b (bytes 0-7 | 8-15), each in SPREAD_ORDER.
  __m128i bytes = [] {
    alignas(16) uint8_t b[16];
    for (int i = 0; i < 16; ++i) b[i] = static_cast<uint8_t>(i / LANES * LANES + SPREAD_ORDER[i % LANES]);
    return _mm_load_si128(reinterpret_cast<const __m128i*>(b));
  }();
  // 8 bytes of row a, 8 of row b -> qword m (row a: m < 4, b: m >= 4) = the row's bytes from byte m % 4.
  __m512i spread(const uint8_t* a, const uint8_t* b) const {
    int64_t u;
    std::memcpy(&u, a, 8);
    const __m512i v = _mm512_mask_broadcastq_epi64(_mm512_set1_epi64(u), 0xF0,
                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
    return _mm512_srlv_epi64(v, shift);
  }
  __m512 operator()(const uint8_t* a, const uint8_t* b) const {
    const __m512i q = spread(a, b);
    const __m512i idx = _mm512_ternarylogic_epi32(_mm512_slli_epi32(q, 16), _mm512_srli_epi32(q, 4), low_words, 0xD8);
    return _mm512_castsi512_ps(_mm512_permutexvar_epi16(idx, table));  // 0xD8: low words from srli, high from slli
  }
  // 8 block scales at a, 8 at b (lanes 0-7 | 8-15) in lane order: fp8_decode16 with the bytes in SPREAD_ORDER.
  __m512 scales(const uint8_t* a, const uint8_t* b) const { return fp8_decode16(_mm_shuffle_epi8(two_steps(a, b), bytes)); }
  // Block scales of group g of rows a | b in lane order.
  __m512 scales(const NVFP4Rows& f, int64_t a, int64_t b, int64_t g) const {
    return scales(f.bscale + a * f.bs_stride + g * LANES, f.bscale + b * f.bs_stride + g * LANES);
  }
};
// A chain's 8 lanes in SPREAD_ORDER -> block order.
inline V unspread(V a) { return {_mm256_permutevar8x32_ps(a.v, spread_inverse())}; }

// G groups at a time (their block sums interleaved, added to the totals in group order), then single
// groups. xb: [groups][8 k][N][16] bf16 pairs in SPREAD_ORDER (two copies: a plain zmm load); acc_mem:
// [P][N][16], the totals in SPREAD_ORDER (load, fma, store per group: P * N of them do not fit in registers
// beside P * G * N block sums); groups [g0, g1), all full.
template <int N, int P, int G>
inline void nvfp4_row_pairs_bf16(const NVFP4Rows& f, const SpreadPairs& dec, const uint32_t* xb, const int64_t* pr,
                                 int64_t g0, int64_t g1, float* acc_mem) {
  const int64_t nb = f.blocks();
  const uint8_t* ra[P];
  const uint8_t* rb[P];
  pair_rows(f, pr, ra, rb);
  int64_t g = g0;
  for (; g + G <= g1; g += G) {
    for (int j = 0; j < G; ++j) {
      if (((g + j) & 7) == 0)  // a 64-byte line of each run serves 8 groups: fetch it for the next P pairs
        for (int i = 0; i < 2 * P; ++i) f.prefetch_lines(pr[2 * P + i], g + j);
    }
    __m512 part[P][G][N];
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < G; ++j)
        for (int n = 0; n < N; ++n) part[p][j][n] = _mm512_setzero_ps();
    for (int64_t k = 0; k < LANES; ++k) {
      __m512 w[P][G];
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < G; ++j) {
          const int64_t o = k * nb + (g + j) * LANES;
          w[p][j] = dec(ra[p] + o, rb[p] + o);
        }
      for (int j = 0; j < G; ++j) {
        const uint32_t* xk = xb + ((g + j) * LANES + k) * N * 2 * LANES;
        for (int n = 0; n < N; ++n) {
          const __m512 xv = _mm512_load_ps(reinterpret_cast<const float*>(xk + n * 2 * LANES));
          for (int p = 0; p < P; ++p) part[p][j][n] = dpbf16(part[p][j][n], w[p][j], xv);
        }
      }
    }
    for (int j = 0; j < G; ++j)
      for (int p = 0; p < P; ++p) {
        const __m512 bs = dec.scales(f, pr[2 * p], pr[2 * p + 1], g + j);
        for (int n = 0; n < N; ++n) {
          float* a = acc_mem + (p * N + n) * 16;
          _mm512_store_ps(a, _mm512_fmadd_ps(part[p][j][n], bs, _mm512_load_ps(a)));
        }
      }
  }
  if constexpr (G > 1) {
    if (g < g1) nvfp4_row_pairs_bf16<N, P, 1>(f, dec, xb, pr, g, g1, acc_mem);
  }
}

// NVFP4, batch 3..8, by vdpbf16ps: P row pairs, G lane groups of each interleaved (P * G * N independent
// block sums for the latency of vdpbf16ps).
template <int N>
void wide_nvfp4_bf16(const NVFP4Rows& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  // Two row pairs (each x load serves two vdpbf16ps), G groups in flight: 12-16 block sums in registers.
  // x's pairs in two copies: a 32-byte broadcast load takes one of vdpbf16ps's two pipes on Zen 5, a
  // 64-byte load on a 64-byte line does not (faster than one row pair with broadcasts, or with the two
  // copies: docs/kernels.md, K11).
  constexpr int P = 2, G = N <= 5 ? 2 : 1;
  const int64_t full = f.blocks() / LANES;
  const SpreadPairs dec;
  const Words xb = bf16_pairs<N, 2>(
      full * LANES, [&](int n, int64_t s) { return x + n * xs + s * LANES; }, spread_order());
  // Every row pair reads all of x: chunks of as many groups as keep x's pairs in L1 with 16 KiB to spare
  // (the totals kept in memory between chunks; faster where x was read from L2 for every pair:
  // docs/kernels.md, K12).
  const int64_t group_bytes = LANES * N * 2 * LANES * static_cast<int64_t>(sizeof(uint32_t));
  const int64_t CG = std::max<int64_t>(1, std::min(full, x_chunk_in_l1_bytes() / group_bytes));
  pair_tiles<N, P>(
      rows, full, CG,
      [&](auto p, const int64_t* prp, int64_t c0, int64_t c1, float* acc) {
        nvfp4_row_pairs_bf16<N, decltype(p)::value, G>(f, dec, xb.data(), prp, c0, c1, acc);
      },
      [&](int64_t v, int n, V total) {
        total = unspread(total);
        for (int64_t g = full; g < f.groups(); ++g) total = nvfp4_groups<1>(f, x + n * xs, v, g, total);
        out[n * os + v] = finish(total, f.row_scale(v), NVFP4Rows::kUnbias);
      });
}

// NVFP4 by vdpbf16ps with a row's 16 blocks per zmm (wide_nvfp4_pairs' layout: pair q of a row is byte k
// of blocks 16q .. 16q + 15, 16 contiguous bytes per k; lane i = block 16q + i). One vpermi2b spreads the
// 16 bytes and the same bytes shifted right by 4 over the 16 lanes (even word: the high nibble, odd
// word: the low one, which vdpbf16ps multiplies first), one vpermw maps each word's low 5 bits through
// the e2m1 bf16 table (bit 4 ignored): two shuffles per 32 weights, where the FMA kernel spends three and
// two FMAs. Each group's block sums run from zero and are added as acc = fma(sum, block scales, acc) on
// the row's 8-lane totals, group after group (lanes 0-7 of a pair: group 2q, lanes 8-15: group 2q + 1):
// wide_nvfp4_pairs' chains, so nvfp4_groups<1>'s. xb: [pairs][8 k][N][16] bf16 pairs (lane i: step 2k of
// block 16q + i in the high word, step 2k + 1 in the low one); acc: the row's N totals ([N][8]).
struct E2m1Lanes {
  // vpermb: byte i into all four bytes of lane i; vpsrlvw: the even word (the high nibble's) right by 4.
  __m512i idx = _mm512_set_epi32(0x0F0F0F0F, 0x0E0E0E0E, 0x0D0D0D0D, 0x0C0C0C0C, 0x0B0B0B0B, 0x0A0A0A0A, 0x09090909,
                                 0x08080808, 0x07070707, 0x06060606, 0x05050505, 0x04040404, 0x03030303, 0x02020202,
                                 0x01010101, 0x00000000);
  __m512i shift = _mm512_set1_epi32(4);
  __m512i table = e2m1_bf16_table();
  // 16 bytes of packed e2m1 -> lane i: the low nibble of byte i (high word), its high nibble (low word).
  __m512 operator()(const uint8_t* p) const {
    const __m512i b = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_permutexvar_epi16(_mm512_srlv_epi16(_mm512_permutexvar_epi8(idx, b), shift), table));
  }
};

template <int N, int G>
inline void nvfp4_block_lanes_bf16(const NVFP4Rows& f, const uint32_t* xb, int64_t r, int64_t q0, int64_t q1,
                                   float* acc_mem, int64_t ahead) {
  const E2m1Lanes decode;
  lane_pairs<N, G>(f, r, q0, q1, acc_mem, ahead, [&](const uint8_t* b, int64_t q, int64_t k, __m512 (&part)[N]) {
    const __m512 w = decode(b);
    const uint32_t* xq = xb + (q * LANES + k) * N * 16;
    for (int n = 0; n < N; ++n) part[n] = dpbf16(part[n], w, _mm512_castsi512_ps(_mm512_loadu_si512(xq + n * 16)));
  });
}

// The bytes of x's bf16 pairs in the block-lanes layout ([pairs][8 k][N][16] 32-bit words).
inline int64_t lanes_x_bytes(const NVFP4Rows& f, int n) { return f.blocks() / 16 * LANES * n * 16 * 4; }

// x's bf16 pairs for the kernels with a row's 16 blocks per zmm: [pairs][8 k][N][16] 32-bit words, word i
// of pair q = step 2k (high half) and 2k + 1 (low half) of block 16q + i.
template <int N>
inline Words block_lane_pairs(const float* x, int64_t xs, int64_t pairs) {
  Words xb(static_cast<size_t>(std::max<int64_t>(1, pairs * LANES * N * 16)));
  for (int64_t q = 0; q < pairs; ++q)
    for (int64_t k = 0; k < LANES; ++k)
      for (int n = 0; n < N; ++n)
        for (int64_t i = 0; i < 16; ++i) {
          uint32_t a, b;
          // x is in step order (gemm.py nvfp4_x): step 2k + h of block 8g + l at 128 g + 16 k + 8 h + l.
          const float* e = x + n * xs + (2 * q + i / LANES) * 128 + 16 * k + i % LANES;
          std::memcpy(&a, e, 4);
          std::memcpy(&b, e + LANES, 4);
          xb[static_cast<size_t>(((q * LANES + k) * N + n) * 16 + i)] = (a & 0xFFFF0000u) | (b >> 16);
        }
  return xb;
}

// NVFP4, batch 2..NVFP4_LANES_MAX (batch 1 runs row runs: the same chains), by nvfp4_block_lanes_bf16: tiles
// of WIDE_TILE rows, a row at a time, x's pairs read whole while they fit in L1 (x_in_l1_bytes), else in
// K-chunks of pairs for all the tile's rows (the totals wait in memory between chunks: a float32 store is exact).
template <int N>
void wide_nvfp4_lanes_bf16(const NVFP4Rows& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  // G * N independent block sums per k (the fastest G: docs/kernels.md, K13).
  constexpr int G = N == 2 ? 2 : 4;
  const int64_t pairs = f.blocks() / 16;
  const Words xb = block_lane_pairs<N>(x, xs, pairs);
  const int64_t pair_bytes = N * LANES * 16 * 4;
  const int64_t CP = lanes_x_bytes(f, N) <= x_in_l1_bytes() ? std::max<int64_t>(1, pairs)
                                                             : std::max<int64_t>(G, x_in_l1_bytes() / pair_bytes / G * G);
  row_tiles<WIDE_TILE, N * LANES>(rows, pairs, CP, [&](int64_t v0, int64_t tr, int64_t c0, int64_t c1, float* acc) {
    lane_pair_rows<N, G>(rows, v0, tr, c0, c1, acc, [&](auto g, int64_t r, int64_t q0, int64_t q1, float* a, int64_t ahead) {
      nvfp4_block_lanes_bf16<N, decltype(g)::value>(f, xb.data(), r, q0, q1, a, ahead);
    });
  }, [&](int64_t v0, int64_t tr, const float* acc) { finish_nvfp4_tile<N>(f, x, xs, pairs, v0, tr, acc, out, os); });
}

// NVFP4, batch 1 (NVFP4_RUNS_MAX), by vdpbf16ps, each row read in address order: run k (byte k of every
// block, nb contiguous bytes) for all of a chunk's block pairs, then run k + 1, so that a row is one forward
// stream of lines (and a thread's rows one stream) instead of 8 runs advancing side by side: faster than
// block lanes at batch 1, slower at batch 2 (half the pairs per chunk), so it runs batch 1 only. A pair q
// (blocks 16q .. 16q + 15, 16 bytes of run k) is decoded by E2m1Lanes (the one-shuffle SpreadPairs, with more
// instructions, was slower); its block sums stay in registers across the 8 runs (Q zmm, a chunk of
// Q <= RUNS_REGS pairs). A chunk's sums are then scaled and added to the row's totals in group order
// (nvfp4_block_lanes_bf16's chains, lane for lane), but during the next chunk's runs: that chain of 2 Q
// FMAs is serial, and at the end of its own chunk it held up the next row's loads (docs/kernels.md, K14).
constexpr int RUNS_REGS = 20;  // block sums in registers (32 zmm: the decoder's 3 constants, w, x)
constexpr int NVFP4_RUNS_MAX = 1;
// The chunk whose block sums wait to be scaled and added (row < 0: none), and the row it finishes.
struct RunsPending {
  alignas(64) float part[RUNS_REGS][16];  // pair q's sums, lane i = block 16q + i (E2m1Lanes)
  int64_t row = -1, q0 = 0, cnt = 0;
  V acc;                                  // the totals of `row`, the pending chunk not yet added
  int64_t done = -1;                      // a row whose totals are complete (in done_acc), or -1
  V done_acc;
};

// Chunk [q0, q0 + Q) of row r, while adding the pending chunk; then this chunk is the pending one.
template <int Q>
void nvfp4_row_runs_bf16(const NVFP4Rows& f, const E2m1Lanes& dec, const uint32_t* xb, int64_t r, int64_t q0,
                         int64_t ahead, bool to_l2, RunsPending& pend) {
  const int64_t nb = f.blocks();
  const uint8_t* row = f.packed + r * f.p_stride + q0 * 16;
  const uint8_t* next = f.packed + ahead * f.p_stride + q0 * 16;
  // prefetch_line, not prefetch_runs: with prefetch_runs the block sums were spilled and reloaded per run.
  const auto lines = [to_l2](const uint8_t* a, int64_t bytes) {
    const uintptr_t end = reinterpret_cast<uintptr_t>(a) + static_cast<uintptr_t>(bytes);
    for (uintptr_t l = reinterpret_cast<uintptr_t>(a) & ~uintptr_t{63}; l < end; l += 64)
      prefetch_line(reinterpret_cast<const void*>(l), to_l2);
  };
  lines(f.bscale + ahead * f.bs_stride + q0 * 16, Q * 16);
  const bool adding = pend.row >= 0;
  const uint8_t* psrow = adding ? f.bscale + pend.row * f.bs_stride + pend.q0 * 16 : nullptr;
  V acc = pend.acc;
  __m512 part[Q];
  _Pragma("GCC unroll 32") for (int q = 0; q < Q; ++q) part[q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < LANES; ++k) {
    lines(next + k * nb, Q * 16);
    _Pragma("GCC unroll 32") for (int q = 0; q < Q; ++q) {
      const uint8_t* b = row + k * nb + q * 16;
      const __m512 w = dec(b);
      const uint32_t* xq = xb + ((q0 + q) * LANES + k) * 16;
      part[q] = dpbf16(part[q], w, _mm512_load_ps(reinterpret_cast<const float*>(xq)));
    }
    if (adding)  // an eighth of the pending chunk's pairs, in order
      for (int64_t q = k * pend.cnt / LANES; q < (k + 1) * pend.cnt / LANES; ++q)
        add_pair_sums<1>(psrow + q * 16, [&](int) { return _mm512_load_ps(pend.part[q]); }, &acc);
  }
  pend.done = -1;
  if (adding && pend.row != r) {  // the pending chunk was its row's last
    pend.done = pend.row;
    pend.done_acc = acc, acc = vzero();
  }
  _Pragma("GCC unroll 32") for (int q = 0; q < Q; ++q) _mm512_store_ps(pend.part[q], part[q]);
  pend.acc = acc;  // zero after a finished row (and before the first)
  pend.row = r, pend.q0 = q0, pend.cnt = Q;
}
// The pending chunk's sums scaled and added to its row's totals, at once (after a thread's last chunk).
inline V runs_add_pending(const NVFP4Rows& f, const RunsPending& pend) {
  const uint8_t* srow = f.bscale + pend.row * f.bs_stride + pend.q0 * 16;
  V acc = pend.acc;
  for (int64_t q = 0; q < pend.cnt; ++q)
    add_pair_sums<1>(srow + q * 16, [&](int) { return _mm512_load_ps(pend.part[q]); }, &acc);
  return acc;
}
// nvfp4_row_runs_bf16<Q> for Q = 1 .. RUNS_REGS, by a table built at compile time.
using RowRuns = void (*)(const NVFP4Rows&, const E2m1Lanes&, const uint32_t*, int64_t, int64_t, int64_t, bool,
                         RunsPending&);
template <size_t... Q>
constexpr std::array<RowRuns, sizeof...(Q)> row_runs_table(std::index_sequence<Q...>) {
  return {&nvfp4_row_runs_bf16<static_cast<int>(Q) + 1>...};
}

// N: wide<N>'s batch, NVFP4_RUNS_MAX (1) only.
template <int N>
void wide_nvfp4_runs_bf16(const NVFP4Rows& f, const float* x, int64_t xs, int64_t rows, float* out, int64_t os) {
  static_assert(N == NVFP4_RUNS_MAX, "row runs hold one x row's totals");
  constexpr int QMAX = RUNS_REGS;
  static constexpr auto table = row_runs_table(std::make_index_sequence<QMAX>{});
  const int64_t pairs = f.blocks() / 16;
  const E2m1Lanes dec;
  const Words xb = block_lane_pairs<1>(x, xs, pairs);
  // Equal chunks of at most QMAX pairs (a row of H = 5120: one chunk of 20).
  const int64_t chunks = std::max<int64_t>(1, (pairs + QMAX - 1) / QMAX), per = (pairs + chunks - 1) / chunks;
  // Rows ahead to prefetch: a row (2880 bytes at H = 5120) takes about 100 ns at batch 1.
  constexpr int64_t AHEAD = 3;
  const bool to_l2 = prefetch_to_l2();
  const auto finish_row = [&](int64_t r, V a) {
    for (int64_t g = 2 * pairs; g < f.groups(); ++g) a = nvfp4_groups<1>(f, x, r, g, a);
    out[r] = finish(a, f.row_scale(r), NVFP4Rows::kUnbias);
  };
  at::parallel_for(0, rows, WIDE_TILE, [&](int64_t r0, int64_t r1) {
    RunsPending pend;
    pend.acc = vzero();
    const auto call = [&](int64_t r, int64_t q0, int64_t cnt) {
      table[static_cast<size_t>(cnt - 1)](f, dec, xb.data(), r, q0, std::min(rows - 1, r + AHEAD), to_l2, pend);
      if (pend.done >= 0) finish_row(pend.done, pend.done_acc);
    };
    for (int64_t r = r0; r < r1; ++r) {
      if (pairs == 0) {
        finish_row(r, vzero());
        continue;
      }
      for (int64_t q0 = 0; q0 < pairs; q0 += per) call(r, q0, std::min(per, pairs - q0));
    }
    if (pend.row >= 0) finish_row(pend.row, runs_add_pending(f, pend));  // the range's last chunk
  });
}

}  // namespace
#endif  // TRTVOCAB_DPBF16
