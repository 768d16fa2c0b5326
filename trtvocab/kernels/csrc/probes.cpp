// The machine probes of trtvocab's kernel library (trtvocab/kernels/probes.py): what benchmarks/bandwidth.py and
// benchmarks/gguf_head.py measure the heads against. No head calls them.
//
// Built into the same library as fused.cpp (trtvocab/kernels/compile.py), on the same tiers (fused/contract.h)
// and 8-lane vectors (fused/vec8.h). Threads: at::parallel_for (torch's intra-op pool).

#include "fused/contract.h"
#include "fused/vec8.h"

namespace {

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

// The chain probe of benchmarks/gguf_head.py: how fast a thread runs gguf.cpp's chain at B = 1 with no
// format to unpack and no memory to wait for. Per item (one a thread: at::parallel_for over get_num_threads()
// items), 4 rows of 768 int8 codes, a float32 scale per 8 and one x row (7.5 KiB, in L1), `rounds` times: per 8
// weights of a row the decode of a Q8_0 chunk's step (vpmovsxbd, vcvtdq2ps, times a broadcast scale) and the chain's product and sum, the ymm ops of tile_avx2's
// 4-row B = 1 tile (the portable build: the same in scalar C++). x is `x0` everywhere (0: every chain stays
// exactly 0; 1: every product a multiple of 2^-6, the sums exact below 2^18); their sum goes to `sink`.
// Returns the weights multiplied: rounds * 4 * 768 per item.
int64_t trtvocab_gguf_chain_probe(int64_t rounds, float x0, float* sink) {
  constexpr int ROWS = 4, H = 768;
  const int threads = at::get_num_threads();
  std::vector<float> sums(static_cast<size_t>(threads) + 1, 0.0f);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) int8_t q[ROWS][H];
    alignas(64) float sc[ROWS][H / 8];
    alignas(64) float xv[H];
    for (int r = 0; r < ROWS; ++r) {
      for (int i = 0; i < H; ++i) q[r][i] = static_cast<int8_t>((i * 7 + r) % 64 - 32);
      for (int i = 0; i < H / 8; ++i) sc[r][i] = 0.015625f * static_cast<float>(1 + (i + r) % 7);
    }
    for (int i = 0; i < H; ++i) xv[i] = x0;
    float total = 0.0f;
    for (int64_t t = t0; t < t1; ++t) {
#if TRTVOCAB_AVX2
      __m256 acc[ROWS];
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t k = 0; k < rounds; ++k)
        for (int s = 0; s < H / 8; ++s) {
          const __m256 x8 = _mm256_load_ps(xv + 8 * s);
          for (int r = 0; r < ROWS; ++r) {
            const __m256 w = _mm256_mul_ps(_mm256_broadcast_ss(&sc[r][s]),
                                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[r] + 8 * s)))));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(w, x8));
          }
        }
      for (int r = 0; r < ROWS; ++r) total += vhsum(V{acc[r]}) + 0.0f;
#else
      float acc[ROWS][8] = {};
      for (int64_t k = 0; k < rounds; ++k)
        for (int s = 0; s < H / 8; ++s)
          for (int r = 0; r < ROWS; ++r)
            for (int l = 0; l < 8; ++l) {
              const float w = sc[r][s] * static_cast<float>(q[r][8 * s + l]);
              acc[r][l] = acc[r][l] + w * xv[8 * s + l];
            }
      for (int r = 0; r < ROWS; ++r) total += tree8(acc[r]) + 0.0f;
#endif
    }
    sums[static_cast<size_t>(at::get_thread_num())] += total;
  });
  float total = 0.0f;
  for (float v : sums) total += v;
  *sink = total;
  return rounds * ROWS * H * threads;
}

}  // extern "C"
