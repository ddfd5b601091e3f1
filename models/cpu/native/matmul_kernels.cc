// int8 x int8 -> int32 matmul for few rows (decode): y[M, N] = x[M, K] . w[K, N], w row-major.
// Exact integer arithmetic (same result as XLA's s8 x s8 -> s32 dot).
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTileN = 32;  // columns per register tile: 2 zmm of int32 per row
constexpr int64_t kMaxM = 8;    // rows per register block
constexpr int64_t kBlockK = 16; // weight rows per pass over the columns (multiple of 4)

// One pass of `kb` weight rows (rows beyond kb read as zero) over the columns [n0, n1) for `M`
// rows of x. Per 4 weight rows and 16 columns: four 16-byte row loads form one zmm, vpermb
// transposes it to 16 lanes of (w[k..k+3][c]) bytes, xor 0x80 makes them unsigned (w + 128), and
// vpdpbusd accumulates (w + 128) . x per lane; the 128 * sum(x) excess is removed by the caller.
template <int M>
static void pass(const int32_t* __restrict xq, int64_t xq_stride, const int8_t* __restrict w,
                 int64_t N, int64_t kb, int64_t n0, int64_t n1, int32_t* __restrict y,
                 int64_t ldy, bool first, const int8_t* pf, int64_t pf_bytes, bool l1) {
  // Software prefetch of the next block of weight rows (contiguous), spread over this pass's
  // column tiles: with short rows the hardware prefetchers do not ramp up. Into L2 (T1) or L1
  // (T0, `l1`): which is faster depends on the machine (models/cpu_lowering.py measures it).
  const int64_t tiles = (n1 - n0) / kTileN;
  const int64_t pf_per_tile = tiles > 0 ? (pf_bytes / 64 + tiles - 1) / tiles : 0;
  const int8_t* pf_end = pf + pf_bytes;
  alignas(64) static const uint8_t kIdx[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51,
      4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54, 7, 23, 39, 55,
      8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i idx = _mm512_load_si512(kIdx);
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const __m128i zero = _mm_setzero_si128();
  for (int64_t n = n0; n < n1; n += kTileN) {
    if (l1) {
      for (int64_t i = 0; i < pf_per_tile && pf < pf_end; ++i, pf += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
    } else {
      for (int64_t i = 0; i < pf_per_tile && pf < pf_end; ++i, pf += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T1);
    }
    __m512i acc[M][2];
    for (int m = 0; m < M; ++m) {
      if (first) {
        acc[m][0] = _mm512_setzero_si512();
        acc[m][1] = _mm512_setzero_si512();
      } else {
        acc[m][0] = _mm512_loadu_si512(y + m * ldy + n);
        acc[m][1] = _mm512_loadu_si512(y + m * ldy + n + 16);
      }
    }
    for (int64_t k = 0; k < kb; k += 4) {
      const int8_t* wk = w + k * N + n;
      __m512i t[2];
      for (int s = 0; s < 2; ++s) {
        const int8_t* p = wk + 16 * s;
        __m128i r0 = _mm_loadu_si128((const __m128i*)p);
        __m128i r1 = k + 1 < kb ? _mm_loadu_si128((const __m128i*)(p + N)) : zero;
        __m128i r2 = k + 2 < kb ? _mm_loadu_si128((const __m128i*)(p + 2 * N)) : zero;
        __m128i r3 = k + 3 < kb ? _mm_loadu_si128((const __m128i*)(p + 3 * N)) : zero;
        __m512i v = _mm512_castsi128_si512(r0);
        v = _mm512_inserti32x4(v, r1, 1);
        v = _mm512_inserti32x4(v, r2, 2);
        v = _mm512_inserti32x4(v, r3, 3);
        t[s] = _mm512_xor_si512(_mm512_permutexvar_epi8(idx, v), flip);
      }
      const int32_t* xk = xq + k / 4;
      for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_set1_epi32(xk[m * xq_stride]);
        acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], t[0], xv);
        acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], t[1], xv);
      }
    }
    for (int m = 0; m < M; ++m) {
      _mm512_storeu_si512(y + m * ldy + n, acc[m][0]);
      _mm512_storeu_si512(y + m * ldy + n + 16, acc[m][1]);
    }
  }
}

using PassFn = void (*)(const int32_t*, int64_t, const int8_t*, int64_t, int64_t, int64_t, int64_t,
                        int32_t*, int64_t, bool, const int8_t*, int64_t, bool);
const PassFn kPass[kMaxM + 1] = {nullptr, pass<1>, pass<2>, pass<3>, pass<4>,
                                 pass<5>, pass<6>, pass<7>, pass<8>};

// Rows [k0, k1) of w (k0 even) into y (ldy = N), columns [0, nv) (nv a multiple of kTileN).
void partial(const int32_t* xp, int64_t kp, const int8_t* w, int64_t M, int64_t N, int64_t nv,
             int64_t k0, int64_t k1, int32_t* y, bool l1) {
  // k outer: a block of kBlockK weight rows is read from memory once and stays in cache while
  // every block of kMaxM x rows passes over it.
  for (int64_t k = k0; k < k1; k += kBlockK) {
    const int64_t kb = std::min<int64_t>(kBlockK, k1 - k);
    // Prefetch the next block during the first x block's pass (later ones hit the cache).
    const int64_t next = std::min<int64_t>(kBlockK, k1 - k - kb);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
      const int64_t mb = std::min<int64_t>(kMaxM, M - m0);
      kPass[mb](xp + m0 * kp + k / 4, kp, w + k * N, N, kb, 0, nv, y + m0 * N, N, k == k0,
                w + (k + kb) * N, m0 == 0 && next > 0 ? next * N : 0, l1);
    }
  }
}

// One weight of a group: several weights that share the activation (q / k / v, gate / up) are
// multiplied in one call, so one task per thread and one synchronisation cover them all.
template <typename W, typename Y>
struct Part {
  const W* w; int64_t N, nv;
  Y* y;                     // the result [M, N]
  std::vector<Y*> out;      // per K part: [M, N] partial sums (part 0 = the result buffer)
};

// Splits [0, K) into `parts` ranges aligned to `block`; part p is [k0, k1).
inline void k_range(int64_t K, int64_t block, int64_t parts, int64_t p, int64_t* k0,
                    int64_t* k1) {
  const int64_t blocks = (K + block - 1) / block;
  *k0 = block * (blocks * p / parts);
  *k1 = std::min(K, block * (blocks * (p + 1) / parts));
}

#include "run_parts.h"

// The K split of a group: ``parts`` (at most one per thread, each streaming at least
// ``min_part_bytes`` of the group's ``bytes``) K ranges aligned to ``block``; part p computes its
// rows of every weight with ``partial(w, k0, k1, out)`` into its own [M, N] partial sums (part
// 0 into the result), which are then added in part order. Columns [0, nv) only.
template <typename W, typename Y, typename Fn>
void split_k(ffi::ThreadPool& pool, std::vector<Part<W, Y>>& g, int64_t M, int64_t K,
             int64_t block, int64_t bytes, int64_t min_part_bytes, Fn partial) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, bytes / min_part_bytes));
  std::vector<std::vector<Y>> scratch(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    auto& w = g[i];
    scratch[i].resize((parts - 1) * M * w.N);
    w.out.assign(1, w.y);
    for (int64_t p = 1; p < parts; ++p) w.out.push_back(scratch[i].data() + (p - 1) * M * w.N);
  }
  run_parts(pool, parts, [&](int64_t p) {
    int64_t k0, k1;
    k_range(K, block, parts, p, &k0, &k1);
    for (auto& w : g) {
      if (w.nv == 0) continue;
      if (k1 > k0) {
        partial(w, k0, k1, w.out[p]);
      } else {
        for (int64_t m = 0; m < M; ++m) std::memset(w.out[p] + m * w.N, 0, w.nv * sizeof(Y));
      }
    }
  });
  for (auto& w : g)
    for (int64_t p = 1; p < parts; ++p)
      for (int64_t m = 0; m < M; ++m) {
        Y* dst = w.y + m * w.N;
        const Y* src = w.out[p] + m * w.N;
        for (int64_t n = 0; n < w.nv; ++n) dst[n] += src[n];
      }
}

// ys[g][M, N_g] = xs[M, K] . ws[g][K, N_g] in int32, for every weight g of the group.
void int8_matmul_group(ffi::ThreadPool& pool, const int8_t* xs, std::vector<Part<int8_t, int32_t>>& g,
                       int64_t M, int64_t K, bool l1 = false) {
  if (M == 0) return;
  if (K == 0) {
    for (auto& w : g) std::memset(w.y, 0, M * w.N * 4);
    return;
  }
  // x as quads of int8 (x[k..k+3], zero beyond K) in one int32: [M, ceil(K / 4)]; and the
  // 128 * sum(x) excess that the unsigned (w + 128) weights add to every column.
  const int64_t kp = (K + 3) / 4;
  std::vector<int32_t> xp(M * kp, 0);
  std::vector<int32_t> excess(M);
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(reinterpret_cast<int8_t*>(xp.data() + m * kp), xs + m * K, K);
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += xs[m * K + k];
    excess[m] = 128 * sum;
  }
  int64_t bytes = 0;
  for (auto& w : g) {
    w.nv = (w.N / kTileN) * kTileN;
    bytes += K * w.nv;
    for (int64_t n = w.nv; n < w.N; ++n)  // scalar tail columns
      for (int64_t m = 0; m < M; ++m) {
        int32_t s = 0;
        for (int64_t k = 0; k < K; ++k) s += int32_t(xs[m * K + k]) * int32_t(w.w[k * w.N + n]);
        w.y[m * w.N + n] = s;
      }
  }
  if (bytes == 0) return;
  // Split K over threads only when each part streams enough weight bytes to pay for a task.
  split_k(pool, g, M, K, kBlockK, bytes, 128 * 1024,
          [&](const Part<int8_t, int32_t>& w, int64_t k0, int64_t k1, int32_t* out) {
            partial(xp.data(), kp, w.w, M, w.N, w.nv, k0, k1, out, l1);
          });
  for (auto& w : g)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < w.nv; ++n) w.y[m * w.N + n] -= excess[m];
}

// ys[M, N] = xs[M, K] . ws[K, N] in int32.
void int8_matmul(ffi::ThreadPool& pool, const int8_t* xs, const int8_t* ws, int32_t* ys,
                 int64_t M, int64_t K, int64_t N, bool l1 = false) {
  if (N == 0) return;
  std::vector<Part<int8_t, int32_t>> g(1);
  g[0].w = ws; g[0].N = N; g[0].y = ys;
  int8_matmul_group(pool, xs, g, M, K, l1);
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                          ffi::ResultBuffer<ffi::S32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("phaseserve_int8_matmul: want x [M, K], w [K, N]");
  int8_matmul(pool, x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[1]);
  return ffi::Error::Success();
}

// The W8A8 activation quantization, exactly as XLA compiles models/quant.py's formula: per row,
// scale = amax * (1 / 127) (1 where amax == 0), q = clip(round_half_even(x / scale), +-127).
void quantize_rows(const float* xs, int64_t M, int64_t K, int8_t* xq, float* row_scale) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xs + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    // amax * (1 / 127), not amax / 127: XLA's simplifier rewrites a division by a constant
    // into a multiplication by its reciprocal (they differ in the last bit for some amax).
    const float scale = amax > 0.f ? amax * (1.0f / 127.0f) : 1.0f;
    row_scale[m] = scale;
    for (int64_t k = 0; k < K; ++k) {
      const float q = std::nearbyint(xr[k] / scale);
      xq[m * K + k] = int8_t(std::min(127.f, std::max(-127.f, q)));
    }
  }
}

// W8A8 with the activation quantization fused in, exactly as models/quant.py writes it in XLA:
// per row, scale = amax / 127 (1 where amax == 0), q = clip(round_half_even(x / scale), +-127);
// y = float(q . w) * scale * w_scale[n].
struct W8A8Weight { const int8_t* w; const float* scale; float* y; int64_t N; };

// The W8A8 formula for every weight of a group sharing x: x quantized once.
void w8a8_group(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K,
                const std::vector<W8A8Weight>& ws, bool l1) {
  std::vector<int8_t> xq(M * K);
  std::vector<float> row_scale(M);
  quantize_rows(x, M, K, xq.data(), row_scale.data());
  std::vector<std::vector<int32_t>> acc(ws.size());
  std::vector<Part<int8_t, int32_t>> g(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    acc[i].resize(M * ws[i].N);
    g[i].w = ws[i].w; g[i].N = ws[i].N; g[i].y = acc[i].data();
  }
  int8_matmul_group(pool, xq.data(), g, M, K, l1);
  for (size_t i = 0; i < ws.size(); ++i) {
    const int64_t N = ws[i].N;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n)
        ws[i].y[m * N + n] = float(acc[i][m * N + n]) * row_scale[m] * ws[i].scale[n];
  }
}

ffi::Error W8A8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> w_scale, ffi::ResultBuffer<ffi::F32> y,
                          int32_t prefetch_l1) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || w_scale.element_count() != wd[1])
    return ffi::Error::InvalidArgument(
        "phaseserve_w8a8_matmul: want x [M, K], w [K, N], w_scale [N]");
  w8a8_group(pool, x.typed_data(), xd[0], xd[1],
             {{w.typed_data(), w_scale.typed_data(), y->typed_data(), wd[1]}}, prefetch_l1 != 0);
  return ffi::Error::Success();
}

// Operands: x [M, K] f32, then G int8 weights [K, N_g], then their G f32 scales [N_g]; results:
// G f32 [M, N_g].
ffi::Error W8A8MatmulGroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::RemainingArgs args, ffi::RemainingRets rets,
                               int32_t prefetch_l1) {
  constexpr const char* kWant =
      "phaseserve_w8a8_matmul_group: want x [M, K], G int8 w [K, N], G f32 scales [N], G f32 "
      "results [M, N]";
  auto xd = x.dimensions();
  const size_t G = rets.size();
  if (xd.size() != 2 || G == 0 || args.size() != 2 * G) return ffi::Error::InvalidArgument(kWant);
  std::vector<W8A8Weight> ws;
  for (size_t i = 0; i < G; ++i) {
    auto w = args.get<ffi::Buffer<ffi::S8>>(i);
    auto sc = args.get<ffi::Buffer<ffi::F32>>(G + i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !sc.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument(kWant);
    auto wd = w->dimensions();
    if (wd.size() != 2 || wd[0] != xd[1] || sc->element_count() != wd[1] ||
        (*y)->element_count() != xd[0] * wd[1])
      return ffi::Error::InvalidArgument(kWant);
    ws.push_back({w->typed_data(), sc->typed_data(), (*y)->typed_data(), wd[1]});
  }
  w8a8_group(pool, x.typed_data(), xd[0], xd[1], ws, prefetch_l1 != 0);
  return ffi::Error::Success();
}

// ---- W8A8 with the weight laid out [N, K] (a tied [V, D] embedding used as the unembedding):
// y[m, n] = float(sum_k xq[m, k] * w[n, k]) * row_scale[m] * w_scale[n]. Each weight row is
// contiguous: a block of 16 rows (16 * K bytes) is streamed from memory once and every activation
// row passes over it from L1. Per 64 bytes of K: vpdpbusd of (w + 128) (unsigned) with x (signed)
// into one accumulator per weight row; at the end a transpose-reduce turns the 16 accumulators
// into one vector of 16 row sums, minus 128 * sum(x[m]).
constexpr int64_t kNKBlock = 16;

// 16 vectors of 16 int32 -> one vector whose lane i is the sum of v[i]'s lanes.
static inline __m512i hsum16(const __m512i* v) {
  __m512i t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j)
    u[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * j], t[2 * j + 1]),
                            _mm512_unpackhi_epi64(t[2 * j], t[2 * j + 1]));
  for (int l = 0; l < 2; ++l)
    w[l] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * l], u[2 * l + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(u[2 * l], u[2 * l + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Weight rows [n0, n1) for all M activation rows.
void nk_rows(const int8_t* __restrict xq, const int32_t* excess, const float* row_scale,
             const int8_t* __restrict w, const float* ws, int64_t M, int64_t K, int64_t N,
             int64_t n0, int64_t n1, float* __restrict y) {
  const int64_t kv = (K / 64) * 64;
  const int64_t rem = K - kv;
  const __mmask64 tail = rem ? (~0ULL >> (64 - rem)) : 0;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t n = n0; n < n1; n += kNKBlock) {
    const int64_t nb = std::min<int64_t>(kNKBlock, n1 - n);
    const __mmask16 out_mask = __mmask16((1u << nb) - 1);
    // Rows past the end repeat the last row (their sums are computed and dropped by the mask).
    const int8_t* rows[kNKBlock];
    for (int64_t i = 0; i < kNKBlock; ++i) rows[i] = w + std::min(n + i, n1 - 1) * K;
    // Prefetch of the next block into L2, spread over the first activation row's pass.
    const char* pf = reinterpret_cast<const char*>(w + (n + nb) * K);
    const int64_t pf_bytes = n + nb < n1 ? std::min<int64_t>(kNKBlock, n1 - n - nb) * K : 0;
    const int64_t steps = std::max<int64_t>(1, kv / 64);
    const int64_t pf_per_step = (pf_bytes / 64 + steps - 1) / steps;
    const char* pf_end = pf + pf_bytes;
    const __m512 wsv = _mm512_maskz_loadu_ps(out_mask, ws + n);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xr = xq + m * K;
      __m512i acc[kNKBlock];
      for (int i = 0; i < kNKBlock; ++i) acc[i] = _mm512_setzero_si512();
      for (int64_t k = 0; k < kv; k += 64) {
        if (m == 0)
          for (int64_t i = 0; i < pf_per_step && pf < pf_end; ++i, pf += 64)
            _mm_prefetch(pf, _MM_HINT_T1);
        const __m512i xv = _mm512_loadu_si512(xr + k);
        for (int i = 0; i < kNKBlock; ++i) {
          const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(rows[i] + k), flip);
          acc[i] = _mm512_dpbusd_epi32(acc[i], wv, xv);
        }
      }
      if (rem) {
        const __m512i xv = _mm512_maskz_loadu_epi8(tail, xr + kv);
        for (int i = 0; i < kNKBlock; ++i) {
          const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(tail, rows[i] + kv), flip);
          acc[i] = _mm512_dpbusd_epi32(acc[i], wv, xv);
        }
      }
      const __m512i sums = _mm512_sub_epi32(hsum16(acc), _mm512_set1_epi32(excess[m]));
      // (float(acc) * row_scale) * w_scale: the XLA formula's order, no FMA.
      const __m512 f = _mm512_mul_ps(
          _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(row_scale[m])), wsv);
      _mm512_mask_storeu_ps(y + m * N + n, out_mask, f);
    }
  }
}

ffi::Error W8A8NKMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> w_scale,
                            ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || w_scale.element_count() != wd[0])
    return ffi::Error::InvalidArgument(
        "phaseserve_w8a8_nk_matmul: want x [M, K], w [N, K], w_scale [N]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  std::vector<int8_t> xq(M * K);
  std::vector<float> row_scale(M);
  quantize_rows(x.typed_data(), M, K, xq.data(), row_scale.data());
  std::vector<int32_t> excess(M);
  for (int64_t m = 0; m < M; ++m) {
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += xq[m * K + k];
    excess[m] = 128 * sum;
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, (N * K) / (128 * 1024)));
  const float* ws = w_scale.typed_data();
  float* ys = y->typed_data();
  run_parts(pool, parts, [&](int64_t p) {
    int64_t n0, n1;
    k_range(N, kNKBlock, parts, p, &n0, &n1);
    if (n1 > n0)
      nk_rows(xq.data(), excess.data(), row_scale.data(), w.typed_data(), ws, M, K, N, n0, n1, ys);
  });
  return ffi::Error::Success();
}

// ---- float: y[M, N] (f32) = x[M, K] (f32) . w[K, N] (f32 or bf16), f32 accumulation ----------

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {  // bf16 -> f32: the bits, shifted up 16
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 load16(const int8_t* p) {  // int8 -> f32 (exact): weight-only int8
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline float scalar(float v) { return v; }
static inline float scalar(int8_t v) { return float(v); }
static inline float scalar(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Columns [0, nv) (multiple of kTileN), weight rows [0, kb) of this block, M rows of x.
template <int M, typename W>
static void fpass(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t N,
                  int64_t kb, int64_t nv, float* __restrict y, int64_t ldy, bool first,
                  const char* pf, int64_t pf_bytes) {
  const int64_t tiles = nv / kTileN;
  const int64_t pf_per_tile = tiles > 0 ? (pf_bytes / 64 + tiles - 1) / tiles : 0;
  const char* pf_end = pf + pf_bytes;
  for (int64_t n = 0; n < nv; n += kTileN) {
    for (int64_t i = 0; i < pf_per_tile && pf < pf_end; ++i, pf += 64)
      _mm_prefetch(pf, _MM_HINT_T1);
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) {
      if (first) {
        acc[m][0] = _mm512_setzero_ps();
        acc[m][1] = _mm512_setzero_ps();
      } else {
        acc[m][0] = _mm512_loadu_ps(y + m * ldy + n);
        acc[m][1] = _mm512_loadu_ps(y + m * ldy + n + 16);
      }
    }
    for (int64_t k = 0; k < kb; ++k) {
      const __m512 w0 = load16(w + k * N + n);
      const __m512 w1 = load16(w + k * N + n + 16);
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
        acc[m][0] = _mm512_fmadd_ps(w0, xv, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, xv, acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m) {
      _mm512_storeu_ps(y + m * ldy + n, acc[m][0]);
      _mm512_storeu_ps(y + m * ldy + n + 16, acc[m][1]);
    }
  }
}

template <typename W>
using FPassFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, int64_t, float*,
                         int64_t, bool, const char*, int64_t);
template <typename W>
const FPassFn<W> kFPass[kMaxM + 1] = {nullptr, fpass<1, W>, fpass<2, W>, fpass<3, W>,
                                      fpass<4, W>, fpass<5, W>, fpass<6, W>, fpass<7, W>,
                                      fpass<8, W>};

// Float weight rows are 2-4x longer in bytes than int8 ones: fewer rows per pass keep the number
// of pages streamed at once (and the y traffic per row) in balance.
constexpr int64_t kFBlockK = 8;

template <typename W>
void fpartial(const float* x, const W* w, int64_t M, int64_t K, int64_t N, int64_t nv,
              int64_t k0, int64_t k1, float* y) {
  for (int64_t k = k0; k < k1; k += kFBlockK) {
    const int64_t kb = std::min<int64_t>(kFBlockK, k1 - k);
    const int64_t next = std::min<int64_t>(kFBlockK, k1 - k - kb);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
      const int64_t mb = std::min<int64_t>(kMaxM, M - m0);
      kFPass<W>[mb](x + m0 * K + k, K, w + k * N, N, kb, nv, y + m0 * N, N, k == k0,
                    reinterpret_cast<const char*>(w + (k + kb) * N),
                    m0 == 0 && next > 0 ? next * N * int64_t(sizeof(W)) : 0);
    }
  }
}

// y_g[M, N_g] = x[M, K] . w_g[K, N_g] for every weight g of the group (one dtype W).
template <typename W>
void float_matmul_group(ffi::ThreadPool& pool, const float* xs, std::vector<Part<W, float>>& g,
                        int64_t M, int64_t K) {
  if (M == 0) return;
  int64_t bytes = 0;
  for (auto& w : g) {
    w.nv = (w.N / kTileN) * kTileN;
    bytes += K * w.nv * int64_t(sizeof(W));
    for (int64_t n = w.nv; n < w.N; ++n)  // scalar tail columns
      for (int64_t m = 0; m < M; ++m) {
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += xs[m * K + k] * scalar(w.w[k * w.N + n]);
        w.y[m * w.N + n] = s;
      }
    if (K == 0)
      for (int64_t m = 0; m < M; ++m) std::memset(w.y + m * w.N, 0, w.nv * 4);
  }
  if (bytes == 0) return;
  split_k(pool, g, M, K, kFBlockK, bytes, 256 * 1024,
          [&](const Part<W, float>& w, int64_t k0, int64_t k1, float* out) {
            fpartial<W>(xs, w.w, M, K, w.N, w.nv, k0, k1, out);
          });
}

// Decodes the weights of a float group (all f32, all bf16 or all int8) and runs it.
template <typename W>
ffi::Error float_group_typed(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K,
                             const std::vector<ffi::AnyBuffer>& ws, const std::vector<float*>& ys) {
  std::vector<Part<W, float>> g(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    g[i].w = reinterpret_cast<const W*>(ws[i].untyped_data());
    g[i].N = ws[i].dimensions()[1];
    g[i].y = ys[i];
  }
  float_matmul_group<W>(pool, x, g, M, K);
  return ffi::Error::Success();
}

ffi::Error float_group(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K,
                       const std::vector<ffi::AnyBuffer>& ws, const std::vector<float*>& ys,
                       const char* name) {
  const auto t = ws[0].element_type();
  for (const auto& w : ws)
    if (w.element_type() != t)
      return ffi::Error::InvalidArgument(std::string(name) + ": weights of one dtype");
  if (t == ffi::F32) return float_group_typed<float>(pool, x, M, K, ws, ys);
  if (t == ffi::BF16) return float_group_typed<uint16_t>(pool, x, M, K, ws, ys);
  if (t == ffi::S8) return float_group_typed<int8_t>(pool, x, M, K, ws, ys);
  return ffi::Error::InvalidArgument(std::string(name) + ": w must be f32, bf16 or int8");
}

ffi::Error FloatMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("phaseserve_float_matmul: want x [M, K], w [K, N]");
  return float_group(pool, x.typed_data(), xd[0], xd[1], {w}, {y->typed_data()},
                     "phaseserve_float_matmul");
}

// Operands: x [M, K] f32, then G weights [K, N_g] of one dtype (f32, bf16 or int8); results:
// G f32 [M, N_g].
ffi::Error FloatMatmulGroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                ffi::RemainingArgs args, ffi::RemainingRets rets) {
  constexpr const char* kWant =
      "phaseserve_float_matmul_group: want x [M, K], G w [K, N], G f32 results [M, N]";
  auto xd = x.dimensions();
  const size_t G = rets.size();
  if (xd.size() != 2 || G == 0 || args.size() != G) return ffi::Error::InvalidArgument(kWant);
  std::vector<ffi::AnyBuffer> ws;
  std::vector<float*> ys;
  for (size_t i = 0; i < G; ++i) {
    auto w = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(kWant);
    auto wd = w->dimensions();
    if (wd.size() != 2 || wd[0] != xd[1] || (*y)->element_count() != xd[0] * wd[1])
      return ffi::Error::InvalidArgument(kWant);
    ws.push_back(*w);
    ys.push_back((*y)->typed_data());
  }
  return float_group(pool, x.typed_data(), xd[0], xd[1], ws, ys, "phaseserve_float_matmul_group");
}

// ---- float x [N, K] weights: y[M, N] = x[M, K] . w[N, K]^T (tied unembedding), f32 ---------
// R weight rows at a time (R * M independent accumulators hide the FMA latency: R = 8 for one
// activation row, fewer for more) against up to kMaxM activation rows, 16 columns of K per FMA,
// one horizontal sum per output at the end.

template <int M>
constexpr int kNKRows = M <= 2 ? 8 : (M <= 4 ? 4 : 2);

template <int M, typename W>
static void nkf_block(const float* __restrict x, int64_t K, const W* __restrict w, int64_t n,
                      int64_t nb, float* __restrict y, int64_t ldy) {
  constexpr int R = kNKRows<M>;
  const int64_t kv = (K / 16) * 16;
  const W* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = w + (n + std::min<int64_t>(i, nb - 1)) * K;
  __m512 acc[R][M];
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kv; k += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int i = 0; i < R; ++i) {
      const __m512 wv = load16(rows[i] + k);
      for (int m = 0; m < M; ++m) acc[i][m] = _mm512_fmadd_ps(wv, xv[m], acc[i][m]);
    }
  }
  for (int i = 0; i < nb; ++i)
    for (int m = 0; m < M; ++m) {
      float sum = _mm512_reduce_add_ps(acc[i][m]);
      for (int64_t k = kv; k < K; ++k) sum += x[m * K + k] * scalar(rows[i][k]);
      y[m * ldy + n + i] = sum;
    }
}

template <typename W>
using NKFBlockFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int64_t);
template <typename W>
const NKFBlockFn<W> kNKF[kMaxM + 1] = {nullptr, nkf_block<1, W>, nkf_block<2, W>,
                                       nkf_block<3, W>, nkf_block<4, W>, nkf_block<5, W>,
                                       nkf_block<6, W>, nkf_block<7, W>, nkf_block<8, W>};
constexpr int kNKFBlock = 8;  // output rows per unit of work (a multiple of every kNKRows)

template <typename W>
void float_nk_matmul(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t M,
                     int64_t K, int64_t N) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t bytes = N * K * int64_t(sizeof(W));
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, bytes / (256 * 1024)));
  static constexpr int kRows[kMaxM + 1] = {0, kNKRows<1>, kNKRows<2>, kNKRows<3>, kNKRows<4>,
                                           kNKRows<5>, kNKRows<6>, kNKRows<7>, kNKRows<8>};
  run_parts(pool, parts, [&](int64_t p) {
    int64_t n0, n1;
    k_range(N, kNKFBlock, parts, p, &n0, &n1);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
      const int64_t mb = std::min<int64_t>(kMaxM, M - m0);
      const int64_t r = kRows[mb];
      for (int64_t n = n0; n < n1; n += r)
        kNKF<W>[mb](x + m0 * K, K, w, n, std::min<int64_t>(r, n1 - n), y + m0 * N, N);
    }
  });
}

ffi::Error FloatNKMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("phaseserve_float_nk_matmul: want x [M, K], w [N, K]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (w.element_type() == ffi::F32) {
    float_nk_matmul<float>(pool, x.typed_data(), w.typed_data<float>(), y->typed_data(), M, K, N);
  } else if (w.element_type() == ffi::BF16) {
    float_nk_matmul<uint16_t>(pool, x.typed_data(),
                              reinterpret_cast<const uint16_t*>(w.untyped_data()),
                              y->typed_data(), M, K, N);
  } else if (w.element_type() == ffi::S8) {
    float_nk_matmul<int8_t>(pool, x.typed_data(),
                            reinterpret_cast<const int8_t*>(w.untyped_data()), y->typed_data(),
                            M, K, N);
  } else {
    return ffi::Error::InvalidArgument("phaseserve_float_nk_matmul: w must be f32, bf16 or int8");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveW8A8Matmul, W8A8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("prefetch_l1"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveW8A8NKMatmul, W8A8NKMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveFloatMatmul, FloatMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveFloatMatmulGroup, FloatMatmulGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveW8A8MatmulGroup, W8A8MatmulGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("prefetch_l1"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveFloatNKMatmul, FloatNKMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
