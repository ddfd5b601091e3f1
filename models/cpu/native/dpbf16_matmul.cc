// AVX512-BF16 matmuls for decode batches (AMD Zen 4 / Zen 5, Intel Cooper Lake and later):
// ys[g][M, N_g] (f32) = x[M, K] (bf16) . ws[g][K, N_g] (bf16, or int8 raw values: exact in
// bf16), and y[M, N] = x . w[N, K]^T (a tied unembedding). vdpbf16ps multiplies pairs of bf16
// (exact in f32) and adds them to f32 lanes: twice the products per instruction of f32 FMAs.
//
// [K, N] weights stay as stored. The group's 32-column tiles are split evenly over the threads;
// for a tile, a block of up to kMaxRows rows of x keeps 2 x rows accumulators of 16 columns in
// registers over all of K. Per pair of weight rows (k, k + 1) the tile's two 32-value rows are
// interleaved in registers (unpacklo / unpackhi of 16-bit lanes: columns come out permuted within
// 128-bit lanes, put back in order when stored); x's pair (x[m, k], x[m, k + 1]) is one 32-bit
// broadcast. With more rows than one block, the first block writes the interleaved tile to a
// per-thread panel (K x 64 bytes, in L2) that the next blocks read instead of the weight.
//
// [N, K] weights: blocks of 4 weight rows x up to 4 rows of x, 16 accumulators of 16 lanes over
// K (32 values per vdpbf16ps, both operands contiguous), reduced to the 16 outputs at the end.
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <utility>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#include "run_parts.h"

constexpr int kMaxRows = 12;  // rows of x per register block: 24 accumulators + 2 weight vectors

// scratch slots (0: padded x, 1: the panel)
#include "scratch.h"

// 32 values of a weight row from p (the first lanes of mask m; zeros past them) as bf16 bits.
inline __m512i row32(const uint16_t* p, __mmask32 m) { return _mm512_maskz_loadu_epi16(m, p); }
inline __m512i row32(const int8_t* p, __mmask32 m) {
  // int8 -> int32 -> f32 (exact) -> bf16 (exact: |v| <= 128 needs 8 significant bits).
  const __m256i b = _mm256_maskz_loadu_epi8(m, p);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

inline __m512 dp(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}

inline __mmask16 mask16(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// After unpacklo / unpackhi of rows k and k + 1, accumulator `lo` holds columns {0-3, 8-11,
// 16-19, 24-27} of the tile and `hi` {4-7, 12-15, 20-23, 28-31}: these indices of
// permutex2var(lo, idx, hi) put columns 0-15 (kOut0) and 16-31 (kOut1) back in order.
struct Order {
  __m512i out0, out1;
  Order() {
    alignas(64) int32_t idx[32];
    for (int c = 0; c < 32; ++c) {
      const int j = c / 8, r = c % 8;
      idx[c] = r < 4 ? 4 * j + r : 16 + 4 * j + (r - 4);
    }
    const int32_t* a = idx;
    const int32_t* b = idx + 16;
    out0 = _mm512_load_si512(a);
    out1 = _mm512_load_si512(b);
  }
};

// One pass of weight rows [0, kb) (kb even, or the weight's last odd row paired with zeros when
// `odd`) over the column tiles [0, nt) of w (row stride N; the last tile `last` columns wide)
// for rows [0, R) of x (row stride ldx, column offset at the pass's first row). The
// accumulators, in unpack order (lo then hi per tile: acc + r * lda + 32 t), are started at
// zero when `first`, else loaded, and stored back. `pf_bytes` of the next pass's rows from
// `pf` are prefetched, spread over the tiles.
template <int R, typename W>
void dpass(const uint16_t* __restrict x, int64_t ldx, const W* __restrict w, int64_t N,
           int64_t kb, bool odd, int64_t nt, int64_t last, float* __restrict acc, int64_t lda,
           bool first, const char* pf, int64_t pf_bytes) {
  const int64_t pf_per_tile = nt > 0 ? (pf_bytes / 64 + nt - 1) / nt : 0;
  const char* pf_end = pf + pf_bytes;
  const int64_t pairs = kb / 2;
  for (int64_t t = 0; t < nt; ++t) {
    for (int64_t i = 0; i < pf_per_tile && pf < pf_end; ++i, pf += 64)
      _mm_prefetch(pf, _MM_HINT_T1);
    const int64_t nv = t + 1 < nt ? 32 : last;
    const __mmask32 cols = nv >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << nv) - 1);
    const W* wt = w + 32 * t;
    __m512 a[R][2];
    for (int r = 0; r < R; ++r) {
      if (first) {
        a[r][0] = a[r][1] = _mm512_setzero_ps();
      } else {
        a[r][0] = _mm512_load_ps(acc + r * lda + 32 * t);
        a[r][1] = _mm512_load_ps(acc + r * lda + 32 * t + 16);
      }
    }
    // Weight rows u (k = 2 p) and v (k + 1) interleaved, times x's pair at k, into a.
    auto add = [&](__m512i u, __m512i v, int64_t p) __attribute__((always_inline)) {
      const __m512i lo = _mm512_unpacklo_epi16(u, v), hi = _mm512_unpackhi_epi16(u, v);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + 2 * p, 4);
        const __m512i xv = _mm512_set1_epi32(pair);
        a[r][0] = dp(a[r][0], lo, xv);
        a[r][1] = dp(a[r][1], hi, xv);
      }
    };
    for (int64_t p = 0; p < pairs; ++p)
      add(row32(wt + (2 * p) * N, cols), row32(wt + (2 * p + 1) * N, cols), p);
    if (odd) add(row32(wt + (2 * pairs) * N, cols), _mm512_setzero_si512(), pairs);
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(acc + r * lda + 32 * t, a[r][0]);
      _mm512_store_ps(acc + r * lda + 32 * t + 16, a[r][1]);
    }
  }
}

template <typename W>
using PassFn = void (*)(const uint16_t*, int64_t, const W*, int64_t, int64_t, bool, int64_t,
                        int64_t, float*, int64_t, bool, const char*, int64_t);

template <typename W, int... R>
constexpr auto pass_table(std::integer_sequence<int, R...>) {
  return std::array<PassFn<W>, sizeof...(R)>{dpass<R + 1, W>...};
}

template <typename W>
PassFn<W> pass_fn(int rows) {
  static constexpr auto table = pass_table<W>(std::make_integer_sequence<int, kMaxRows>{});
  return table[rows - 1];
}

#include "group_args.h"

// x [M, K] with K even, or copied into this thread's zero-padded [M, K + 1] buffer.
const uint16_t* even_x(const uint16_t* x, int64_t M, int64_t K, int64_t* ldx) {
  if (K % 2 == 0) {
    *ldx = K;
    return x;
  }
  *ldx = K + 1;
  auto* xb = static_cast<uint16_t*>(scratch(0, M * (K + 1) * 2));
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(xb + m * (K + 1), x + m * K, K * 2);
    xb[m * (K + 1) + K] = 0;
  }
  return xb;
}

// Weight rows per pass: the accumulators are loaded and stored once per pass.
constexpr int64_t kBlockK = 16;
// Each thread streams at least this many weight bytes (fewer threads for small groups).
constexpr int64_t kMinPartBytes = 256 * 1024;

// Rows [k0, k1) of weight w (k0 even) for all M rows of x, into acc [M, lda] (unpack order).
template <typename W>
void dpartial(const uint16_t* x, int64_t ldx, const W* w, int64_t N, int64_t K, int64_t M,
              int64_t k0, int64_t k1, float* acc, int64_t lda) {
  const int64_t nt = (N + 31) / 32, last = N - 32 * (nt - 1);
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;  // rows of x, near-equal blocks
  for (int64_t k = k0; k < k1; k += kBlockK) {
    const int64_t kb = std::min<int64_t>(kBlockK, k1 - k);
    const int64_t next = std::min<int64_t>(kBlockK, k1 - k - kb);
    const bool odd = (kb & 1) != 0;  // only the weight's last row (k1 == K, K odd)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r0 = M * b / blocks, r1 = M * (b + 1) / blocks;
      pass_fn<W>(int(r1 - r0))(x + r0 * ldx + k, ldx, w + k * N, N, kb - (odd ? 1 : 0), odd,
                               nt, last, acc + r0 * lda, lda, k == k0,
                               reinterpret_cast<const char*>(w + (k + kb) * N),
                               b == 0 && next > 0 ? next * N * int64_t(sizeof(W)) : 0);
    }
  }
}

// The group's K is split over the threads (each streams a contiguous run of every weight);
// part p accumulates into its own [M, 32 * tiles] buffer per weight, in unpack order; a second
// parallel pass adds the parts and writes y in column order.
template <typename W>
void group(ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K,
           const std::vector<Weight>& ws) {
  if (M == 0) return;
  if (K == 0) {
    for (const auto& w : ws) std::memset(w.y, 0, M * w.N * 4);
    return;
  }
  static const Order order;
  int64_t ldx;
  const uint16_t* xe = even_x(x, M, K, &ldx);
  int64_t bytes = 0, cols = 0;
  std::vector<int64_t> offset;  // each weight's accumulators in a part's buffer
  for (const auto& w : ws) {
    bytes += K * w.N * int64_t(sizeof(W));
    offset.push_back(M * cols);
    cols += 32 * ((w.N + 31) / 32);
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, bytes / kMinPartBytes));
  auto* buf = static_cast<float*>(scratch(1, parts * M * cols * 4));
  run_parts(pool, parts, [&](int64_t p) {
    // K range of this part: whole pairs, near-equal.
    const int64_t pairs = (K + 1) / 2;
    const int64_t k0 = 2 * (pairs * p / parts), k1 = std::min(K, 2 * (pairs * (p + 1) / parts));
    float* mine = buf + p * M * cols;
    for (size_t g = 0; g < ws.size(); ++g) {
      const int64_t lda = 32 * ((ws[g].N + 31) / 32);
      if (k1 > k0)
        dpartial(xe, ldx, static_cast<const W*>(ws[g].w), ws[g].N, K, M, k0, k1,
                 mine + offset[g], lda);
      else
        std::memset(mine + offset[g], 0, M * lda * 4);
    }
  });
  // Rows of y (all weights) split over the threads: sum the parts, back to column order.
  const int64_t rparts = std::max<int64_t>(1, std::min<int64_t>(threads, M));
  run_parts(pool, rparts, [&](int64_t q) {
    const int64_t m0 = M * q / rparts, m1 = M * (q + 1) / rparts;
    for (size_t g = 0; g < ws.size(); ++g) {
      const int64_t N = ws[g].N, lda = 32 * ((N + 31) / 32);
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = 0; n < N; n += 32) {
          const float* a = buf + offset[g] + m * lda + n;
          __m512 lo = _mm512_load_ps(a), hi = _mm512_load_ps(a + 16);
          for (int64_t p = 1; p < parts; ++p) {
            lo = _mm512_add_ps(lo, _mm512_load_ps(a + p * M * cols));
            hi = _mm512_add_ps(hi, _mm512_load_ps(a + p * M * cols + 16));
          }
          float* y = ws[g].y + m * N + n;
          _mm512_mask_storeu_ps(y, mask16(N - n), _mm512_permutex2var_ps(lo, order.out0, hi));
          _mm512_mask_storeu_ps(y + 16, mask16(N - n - 16),
                                _mm512_permutex2var_ps(lo, order.out1, hi));
        }
    }
  });
}

// ---- [N, K] weights: y[m, n] = sum_k x[m, k] w[n, k] ----------------------------------------

// One round of the reduction tree: a and b's lanes paired and added (S: the round, 0-3).
template <int S>
inline __m512 fold(__m512 a, __m512 b) {
  if constexpr (S == 0) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  } else if constexpr (S == 1) {
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  } else {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
}

// 16 vectors -> one whose lane i is the sum of v_i's lanes (all values: no array in memory).
inline __m512 hsum16(__m512 v0, __m512 v1, __m512 v2, __m512 v3, __m512 v4, __m512 v5,
                     __m512 v6, __m512 v7, __m512 v8, __m512 v9, __m512 v10, __m512 v11,
                     __m512 v12, __m512 v13, __m512 v14, __m512 v15) {
  const __m512 a0 = fold<0>(v0, v1), a1 = fold<0>(v2, v3), a2 = fold<0>(v4, v5),
               a3 = fold<0>(v6, v7), a4 = fold<0>(v8, v9), a5 = fold<0>(v10, v11),
               a6 = fold<0>(v12, v13), a7 = fold<0>(v14, v15);
  const __m512 b0 = fold<1>(a0, a1), b1 = fold<1>(a2, a3), b2 = fold<1>(a4, a5),
               b3 = fold<1>(a6, a7);
  return fold<3>(fold<2>(b0, b1), fold<2>(b2, b3));
}

// Weight rows [n, n + RN) x rows [0, RM) of x, over all K (32 values per step, masked tail);
// `pf_bytes` from `pf` (the next block's weight rows) prefetched, spread over the steps.
template <int RN, int RM, typename W>
void nk_block(const uint16_t* __restrict x, int64_t K, const W* __restrict w, float* __restrict y,
              int64_t ldy, const char* pf, int64_t pf_bytes) {
  __m512 acc[RN * RM];
  for (int i = 0; i < RN * RM; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t steps = (K + 31) / 32;
  const int64_t pf_per_step = (pf_bytes / 64 + steps - 1) / steps;
  const char* pf_end = pf + pf_bytes;
  for (int64_t k = 0; k < K; k += 32) {
    for (int64_t i = 0; i < pf_per_step && pf < pf_end; ++i, pf += 64)
      _mm_prefetch(pf, _MM_HINT_T0);
    const __mmask32 m = K - k >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (K - k)) - 1);
    __m512i xv[RM];
    for (int j = 0; j < RM; ++j) xv[j] = _mm512_maskz_loadu_epi16(m, x + j * K + k);
    for (int i = 0; i < RN; ++i) {
      const __m512i wv = row32(w + i * K + k, m);
      for (int j = 0; j < RM; ++j) acc[i * RM + j] = dp(acc[i * RM + j], wv, xv[j]);
    }
  }
  // One reduction tree for any block (missing accumulators are zeros): a per-output
  // reduce_add would cost a tree each.
  const __m512 z = _mm512_setzero_ps();
  auto a = [&](int i) { return i < RN * RM ? acc[i] : z; };
  alignas(64) float out[16];
  _mm512_store_ps(out, hsum16(a(0), a(1), a(2), a(3), a(4), a(5), a(6), a(7), a(8), a(9),
                              a(10), a(11), a(12), a(13), a(14), a(15)));
  for (int i = 0; i < RN; ++i)
    for (int j = 0; j < RM; ++j) y[j * ldy + i] = out[i * RM + j];
}

template <typename W>
using NKFn = void (*)(const uint16_t*, int64_t, const W*, float*, int64_t, const char*, int64_t);

template <typename W>
NKFn<W> nk_fn(int rn, int rm) {
  static const NKFn<W> table[4][4] = {
      {nk_block<1, 1, W>, nk_block<1, 2, W>, nk_block<1, 3, W>, nk_block<1, 4, W>},
      {nk_block<2, 1, W>, nk_block<2, 2, W>, nk_block<2, 3, W>, nk_block<2, 4, W>},
      {nk_block<3, 1, W>, nk_block<3, 2, W>, nk_block<3, 3, W>, nk_block<3, 4, W>},
      {nk_block<4, 1, W>, nk_block<4, 2, W>, nk_block<4, 3, W>, nk_block<4, 4, W>}};
  return table[rn - 1][rm - 1];
}

template <typename W>
void nk(ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K, const W* w, int64_t N,
        float* y) {
  if (M == 0 || N == 0) return;
  // Weight rows in blocks of 4 (streamed once, in L1 while every block of x's rows passes).
  const int64_t nb = (N + 3) / 4;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), nb));
  run_parts(pool, parts, [&](int64_t part) {
    const int64_t b0 = nb * part / parts, b1 = nb * (part + 1) / parts;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = 4 * b, rn = std::min<int64_t>(4, N - n);
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t rm = std::min<int64_t>(4, M - m);
        // The first block of x's rows prefetches the next block of weight rows.
        const int64_t next = m == 0 ? std::min<int64_t>(4, N - n - rn) : 0;
        nk_fn<W>(int(rn), int(rm))(x + m * K, K, w + n * K, y + m * N + n, N,
                                   reinterpret_cast<const char*>(w + (n + rn) * K),
                                   next > 0 ? next * K * int64_t(sizeof(W)) : 0);
      }
    }
  });
}

ffi::Error NKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer w,
                  ffi::ResultBuffer<ffi::F32> y) {
  constexpr const char* kWant =
      "phaseserve_dpbf16_matmul_nk: want x [M, K] bf16, w [N, K] bf16 or int8, f32 result [M, N]";
  return nk_args(x, w, y, kWant, [&](auto... a) { nk(pool, a...); });
}

// Operands: x [M, K] bf16, then G weights [K, N_g] of one dtype (bf16 or int8); results: G f32
// [M, N_g].
ffi::Error GroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::RemainingArgs args,
                     ffi::RemainingRets rets) {
  constexpr const char* kWant =
      "phaseserve_dpbf16_matmul_group: want x [M, K] bf16, G w [K, N] of one dtype (bf16 or "
      "int8), G f32 results [M, N]";
  return group_args(x, args, rets, kWant, [&](auto w, const uint16_t* xp, int64_t M, int64_t K,
                                               const std::vector<Weight>& ws) {
    group<decltype(w)>(pool, xp, M, K, ws);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveDpbf16MatmulGroup, GroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveDpbf16MatmulNK, NKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
