// The vocab tree's (max, sum exp) nodes of one rank's logits, in one pass: the C++ half of
// trtvocab/sampling/treesum.py, which defines the tree and computes the same bits with torch ops.
//
// Built into the same library as fused.cpp (trtvocab/kernels). Bitwise equality with the
// torch path is the contract, so every step is the torch operation's own instruction or function:
//   max / min   _mm256_max_ps / _mm256_min_ps with NaN propagated (torch.maximum / minimum)
//   exp         the function torch's float exp calls on this machine: MKL's vmsExp (x86 wheels,
//               high-accuracy mode) or Sleef_expf8_u10; the Python side picks the one that matches
//               torch.exp bit for bit (trtvocab_tree_set_exp, kernels.tree_available), else none
//   sub, mul, add, compares and selects: one IEEE operation each, never fused (-ffp-contract=off)
// A node of 2**L logits (L <= BLOCK_LEVEL) is reduced level by level (adjacent pairs, as the tree
// does) in small buffers, one exp call per level; a larger node is 2**(L - BLOCK_LEVEL) such
// blocks, then the blocks' pairs level by level.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <vector>

#include "fused/contract.h"  // the library's one ISA tier macros (TRTVOCAB_AVX2: AVX2 + FMA + F16C)

#if TRTVOCAB_AVX2
// Weak: a torch build without one of them still loads this library (that exp is then unavailable).
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
extern "C" void vmsExp(int n, const float* a, float* r, long long mode) __attribute__((weak));
#endif

namespace {

#if TRTVOCAB_AVX2
constexpr int64_t BLOCK_LEVEL = 10;  // a block: 1024 logits, its buffers in L1
constexpr int64_t BLOCK = int64_t{1} << BLOCK_LEVEL;
constexpr long long MKL_HA_MODE = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE

int exp_mode = -1;  // 0 = Sleef, 1 = MKL; -1 = not chosen (the kernel refuses to run)

// e[i] = exp(d[i]) for i < n (d holds no NaN).
void exp_batch(const float* d, float* e, int64_t n) {
  if (exp_mode == 1) {
    vmsExp(static_cast<int>(n), d, e, MKL_HA_MODE);
    return;
  }
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(e + i, Sleef_expf8_u10(_mm256_loadu_ps(d + i)));
  if (i < n) {
    alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t k = i; k < n; ++k) t[k - i] = d[k];
    _mm256_store_ps(t, Sleef_expf8_u10(_mm256_load_ps(t)));
    for (int64_t k = i; k < n; ++k) e[k] = t[k - i];
  }
}

inline __m256 tmax(__m256 a, __m256 b) { return _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q)); }
inline __m256 tmin(__m256 a, __m256 b) { return _mm256_or_ps(_mm256_min_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q)); }
// nan_to_num(min - max, nan=0): NaN only when both sides are the same infinity.
inline __m256 exponent(__m256 lo, __m256 hi) {
  __m256 d = _mm256_sub_ps(lo, hi);
  return _mm256_blendv_ps(d, _mm256_setzero_ps(), _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
}

// 16 consecutive floats -> the 8 at even positions and the 8 at odd positions.
inline void deinterleave(const float* p, __m256& even, __m256& odd) {
  __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
  even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(v0, v1, 0x88)), 0xD8));
  odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(v0, v1, 0xDD)), 0xD8));
}

// The pairs (2j, 2j + 1), j < pairs, of src as two 8-lane vectors at step j (padded past `pairs`).
inline void load_pairs(const float* src, int64_t j, int64_t pairs, float pad, __m256& even, __m256& odd) {
  if (pairs >= 8) {
    deinterleave(src + 2 * j, even, odd);
    return;
  }
  alignas(32) float a[8], b[8];
  for (int64_t i = 0; i < 8; ++i) {
    a[i] = i < pairs ? src[2 * i] : pad;
    b[i] = i < pairs ? src[2 * i + 1] : pad;
  }
  even = _mm256_load_ps(a);
  odd = _mm256_load_ps(b);
}

inline void store_lanes(float* dst, int64_t j, int64_t pairs, __m256 v) {
  if (pairs >= 8) {
    _mm256_storeu_ps(dst + j, v);
    return;
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int64_t i = 0; i < pairs; ++i) dst[i] = t[i];
}

struct Scratch {
  alignas(32) float d[BLOCK / 2], big[BLOCK / 2], small[BLOCK / 2];
};

// treesum._leaf_pairs over 2 * pairs leaves x -> (m, s), pairs <= BLOCK / 2.
void leaf_level(const float* x, int64_t pairs, float* m, float* s, Scratch& w) {
  for (int64_t j = 0; j < pairs; j += 8) {
    __m256 a, b;
    load_pairs(x, j, pairs, -INFINITY, a, b);
    __m256 mo = tmax(a, b);
    store_lanes(m, j, pairs, mo);
    store_lanes(w.d, j, pairs, exponent(tmin(a, b), mo));
  }
  exp_batch(w.d, w.d, pairs);
  for (int64_t j = 0; j < pairs; j += 8) {
    __m256 mo, e;
    if (pairs >= 8) {
      mo = _mm256_loadu_ps(m + j);
      e = _mm256_loadu_ps(w.d + j);
    } else {
      alignas(32) float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < pairs; ++i) a[i] = m[i], b[i] = w.d[i];
      mo = _mm256_load_ps(a);
      e = _mm256_load_ps(b);
    }
    __m256 one_plus = _mm256_add_ps(e, _mm256_set1_ps(1.0f));
    __m256 none = _mm256_cmp_ps(mo, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    store_lanes(s, j, pairs, _mm256_blendv_ps(one_plus, _mm256_setzero_ps(), none));
  }
}

// treesum.merge over `pairs` adjacent pairs of (m, s), the parents written to the front (in place).
void merge_level(float* m, float* s, int64_t pairs, Scratch& w) {
  for (int64_t j = 0; j < pairs; j += 8) {
    __m256 m1, m2, s1, s2;
    load_pairs(m, j, pairs, -INFINITY, m1, m2);
    load_pairs(s, j, pairs, 0.0f, s1, s2);
    __m256 mo = tmax(m1, m2);
    __m256 first = _mm256_cmp_ps(m1, m2, _CMP_GE_OQ);
    store_lanes(w.d, j, pairs, exponent(tmin(m1, m2), mo));
    store_lanes(w.big, j, pairs, _mm256_blendv_ps(s2, s1, first));
    store_lanes(w.small, j, pairs, _mm256_blendv_ps(s1, s2, first));
    store_lanes(m, j, pairs, mo);
  }
  exp_batch(w.d, w.d, pairs);
  for (int64_t j = 0; j < pairs; j += 8) {
    if (pairs >= 8) {
      __m256 e = _mm256_loadu_ps(w.d + j);
      _mm256_storeu_ps(s + j, _mm256_add_ps(_mm256_loadu_ps(w.big + j), _mm256_mul_ps(_mm256_loadu_ps(w.small + j), e)));
    } else {
      for (int64_t i = 0; i < pairs; ++i) s[i] = w.big[i] + w.small[i] * w.d[i];  // not contracted
    }
  }
}

// (m, s) of `count` (a power of two) nodes, reduced level by level to m[0], s[0] (count <= BLOCK).
void reduce(float* m, float* s, int64_t count, Scratch& w) {
  for (int64_t pairs = count / 2; pairs >= 1; pairs /= 2) merge_level(m, s, pairs, w);
}

// The node of 2**L logits at x (L <= BLOCK_LEVEL; L = 0 is a leaf).
void block(const float* x, int64_t L, float& m_out, float& s_out, Scratch& w) {
  if (L == 0) {
    m_out = x[0];
    s_out = x[0] != -INFINITY ? 1.0f : 0.0f;
    return;
  }
  alignas(32) float m[BLOCK / 2], s[BLOCK / 2];
  const int64_t pairs = int64_t{1} << (L - 1);
  leaf_level(x, pairs, m, s, w);
  reduce(m, s, pairs, w);
  m_out = m[0];
  s_out = s[0];
}
#endif

struct Node {
  int64_t level, offset;  // 2**level logits from local column `offset`
  int64_t first_block, blocks;
};

}  // namespace

extern "C" {

// Whether this build has the tree kernel (AVX2 + FMA, where torch's exp is Sleef_expf8_u10).
int trtvocab_tree_isa() { return TRTVOCAB_AVX2; }

// Choose the exp: 0 = Sleef_expf8_u10, 1 = MKL vmsExp, -1 = none (the kernel refuses to run);
// 2 when this torch build lacks it.
int trtvocab_tree_set_exp(int mode) {
#if TRTVOCAB_AVX2
  if (mode == -1) {
    exp_mode = -1;
    return 0;
  }
  if ((mode == 0 && Sleef_expf8_u10 == nullptr) || (mode == 1 && vmsExp == nullptr) || mode < 0 || mode > 1) return 2;
  exp_mode = mode;
  return 0;
#else
  (void)mode;
  return 2;
#endif
}

// out[i] = exp(nan_to_num(d[i], nan=0)) with the chosen exp (what the self-check compares with torch).
int trtvocab_tree_exp(const float* d, int64_t n, float* out) {
#if TRTVOCAB_AVX2
  if (exp_mode < 0) return 4;
  at::parallel_for(0, (n + 1023) / 1024, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = 1024 * b, len = std::min<int64_t>(1024, n - lo);
      for (int64_t i = 0; i < len; ++i) out[lo + i] = std::isnan(d[lo + i]) ? 0.0f : d[lo + i];
      exp_batch(out + lo, out + lo, len);
    }
  });
  return 0;
#else
  (void)d; (void)n; (void)out;
  return 2;
#endif
}

// The nodes of treesum.aligned_nodes(first_id, first_id + n) for each of `rows` rows of logits
// x[r * x_stride + j] (j < n): out_m[r * out_stride + k], out_s[...] for node k in id order.
int trtvocab_tree_nodes(const float* x, int64_t rows, int64_t x_stride, int64_t n, int64_t first_id, float* out_m,
                        float* out_s, int64_t out_stride) {
#if TRTVOCAB_AVX2
  if (exp_mode < 0) return 4;
  try {
    std::vector<Node> nodes;
    std::vector<int64_t> block_offset, block_level;  // every block of every node, in id order
    for (int64_t pos = first_id; pos < first_id + n;) {
      int64_t L = 0;
      while (pos % (int64_t{2} << L) == 0 && pos + (int64_t{2} << L) <= first_id + n) ++L;
      const int64_t bl = L < BLOCK_LEVEL ? L : BLOCK_LEVEL;
      const int64_t blocks = int64_t{1} << (L - bl);
      if (blocks > BLOCK) return 5;  // a node of more than 2**20 logits: the torch path
      nodes.push_back({L, pos - first_id, static_cast<int64_t>(block_offset.size()), blocks});
      for (int64_t b = 0; b < blocks; ++b) {
        block_offset.push_back(pos - first_id + (b << bl));
        block_level.push_back(bl);
      }
      pos += int64_t{1} << L;
    }
    if (static_cast<int64_t>(nodes.size()) > out_stride) return 3;
    const int64_t total_blocks = static_cast<int64_t>(block_offset.size());
    std::vector<float> bm(rows * total_blocks), bs(rows * total_blocks);
    // Phase 1: every block of every row (independent: any thread, any order).
    at::parallel_for(0, rows * total_blocks, 16, [&](int64_t t0, int64_t t1) {
      Scratch w;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r = t / total_blocks, b = t % total_blocks;
        block(x + r * x_stride + block_offset[b], block_level[b], bm[t], bs[t], w);
      }
    });
    // Phase 2: each node's blocks, level by level, to its pair.
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      Scratch w;
      for (int64_t r = r0; r < r1; ++r) {
        for (size_t j = 0; j < nodes.size(); ++j) {
          const Node& node = nodes[j];
          float* m = bm.data() + r * total_blocks + node.first_block;
          float* s = bs.data() + r * total_blocks + node.first_block;
          reduce(m, s, node.blocks, w);
          out_m[r * out_stride + static_cast<int64_t>(j)] = m[0];
          out_s[r * out_stride + static_cast<int64_t>(j)] = s[0];
        }
      }
    });
    return 0;
  } catch (...) {
    return 1;
  }
#else
  (void)x; (void)rows; (void)x_stride; (void)n; (void)first_id; (void)out_m; (void)out_s; (void)out_stride;
  return 2;
#endif
}

}  // extern "C"
