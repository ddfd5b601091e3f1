// AVX512-BF16 matmuls for decode batches on weights laid out in column tiles of K pairs:
// ys[g][M, N_g] (f32) = x[M, K] (bf16) . w_g, with w_g stored as [T, P, 16, 2] bf16 or int8
// (T = ceil(N / 16) tiles of 16 columns, P = ceil(K / 2) pairs of rows; [t, p, c, j] is
// w[2p + j, 16t + c], zeros past the weight): a tile's K x 16 values are one contiguous stream.
// An int8 tile (raw values: the caller applies the scales) is widened to bf16 (exact) into a
// per-thread buffer once, then read as a bf16 one: half the bytes from memory.
//
// The rows of x are the vector lanes: x is transposed once into pairs, xt[p, m] = (x[m, 2p],
// x[m, 2p + 1]) (32 bits), rows padded to a multiple of 8; vectors of V = 16 rows (a zmm), the
// last 1-8 rows in one of V = 8 (a ymm). For a tile and a vector of V rows, 16 accumulators (one a column) take, per pair p, one vdpbf16ps of the
// rows' pair vector with the column's weight pair broadcast from memory: no shuffles in the
// loop, one 4-byte load a dot product. The 16 x V block is transposed once at the end. A tile is
// streamed from memory for the first row vector and read again from L2 for the others.
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#include "run_parts.h"
#include "tile_parts.h"

// scratch slots (0: x's pairs, 1: a widened int8 tile)
#include "scratch.h"

// xt[p * ld + m] = (x[m, 2p], x[m, 2p + 1]) for m < M (zeros for m in [M, ld) and past K).
void pair_rows(const uint16_t* x, int64_t M, int64_t K, int64_t P, int64_t ld, uint32_t* xt) {
  for (int64_t p = 0; p < P; ++p) {
    uint32_t* row = xt + p * ld;
    const int64_t k = 2 * p;
    for (int64_t m = 0; m < M; ++m) {
      const uint32_t lo = x[m * K + k], hi = k + 1 < K ? x[m * K + k + 1] : 0;
      row[m] = lo | (hi << 16);
    }
    for (int64_t m = M; m < ld; ++m) row[m] = 0;
  }
}

// A tile's stream is prefetched this many pairs (64-byte lines) ahead of the dot products
// (into the next tile at a tile's end; AMD EPYC Zen 4: 64 lines measured 1.2-1.3x faster than no
// prefetch at 8-32 rows, 16 to 128 within noise of each other).
constexpr int64_t kAhead = 64;

// One tile (16 columns, P pairs: wt[p * 16 + c]) times rows [r0, r0 + V) of xt (row stride ld
// uint32), written to y[r, n0 + c] for r < rows, c < cols (row stride ldy).
template <int V>
void tile_block(const uint32_t* __restrict xt, int64_t ld, int64_t r0, int64_t P,
                const uint32_t* __restrict wt, float* __restrict y, int64_t ldy, int64_t rows,
                int64_t cols) {
  alignas(64) float out[16][V];
  if constexpr (V == 16) {
    __m512 a[16];
    for (int c = 0; c < 16; ++c) a[c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xt + p * ld + r0);
      const uint32_t* w = wt + p * 16;
      _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kAhead), _MM_HINT_T0);
      for (int c = 0; c < 16; ++c)
        a[c] = _mm512_dpbf16_ps(a[c], xv, (__m512bh)_mm512_set1_epi32(int(w[c])));
    }
    for (int c = 0; c < 16; ++c) _mm512_store_ps(out[c], a[c]);
  } else {
    __m256 a[16];
    for (int c = 0; c < 16; ++c) a[c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
      const __m256bh xv = (__m256bh)_mm256_loadu_si256((const __m256i*)(xt + p * ld + r0));
      const uint32_t* w = wt + p * 16;
      _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kAhead), _MM_HINT_T0);
      for (int c = 0; c < 16; ++c)
        a[c] = _mm256_dpbf16_ps(a[c], xv, (__m256bh)_mm256_set1_epi32(int(w[c])));
    }
    for (int c = 0; c < 16; ++c) _mm256_store_ps(out[c], a[c]);
  }
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                          5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(V));
  const __mmask16 cm = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  for (int64_t r = 0; r < rows; ++r)
    _mm512_mask_storeu_ps(y + r * ldy, cm, _mm512_i32gather_ps(idx, &out[0][r], 4));
}

struct Tiled {
  const void* w;  // [T, P, 16] pairs of bf16 (or of int8)
  int64_t N, T;
  float* y;  // [M, N]
};

// An int8 tile's P pairs of 16 columns (32 bytes a pair) as bf16 pairs, into out.
void widen(const int8_t* __restrict w, int64_t P, uint32_t* __restrict out) {
  for (int64_t p = 0; p < P; ++p) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * p));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    _mm512_store_si512(out + 16 * p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// Rows in vectors of 16, the last 1-8 in one of 8 (a ymm: twice the instructions a cycle, so
// 24 rows cost about three quarters of 32).
template <typename W>
void group(ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K,
           const std::vector<Tiled>& ws) {
  if (M == 0) return;
  const int64_t P = (K + 1) / 2, ld = (M + 7) / 8 * 8;
  auto* xt = static_cast<uint32_t*>(scratch(0, P * ld * 4));
  pair_rows(x, M, K, P, ld, xt);
  std::vector<int64_t> counts;
  for (const auto& w : ws) counts.push_back(w.T);
  for_each_tile(pool, counts, [&](size_t g, int64_t local) {
    const Tiled& w = ws[g];
    const int64_t n0 = 16 * local;
    const uint32_t* wt;
    if constexpr (sizeof(W) == 1) {
      auto* buf = static_cast<uint32_t*>(scratch(1, P * 64));
      widen(static_cast<const int8_t*>(w.w) + local * P * 32, P, buf);
      wt = buf;
    } else {
      wt = static_cast<const uint32_t*>(w.w) + local * P * 16;
    }
    const int64_t cols = std::min<int64_t>(16, w.N - n0);
    for (int64_t r0 = 0; r0 < M;) {
      const int64_t rows = std::min<int64_t>(16, M - r0);
      if (rows > 8)
        tile_block<16>(xt, ld, r0, P, wt, w.y + r0 * w.N + n0, w.N, rows, cols);
      else
        tile_block<8>(xt, ld, r0, P, wt, w.y + r0 * w.N + n0, w.N, rows, cols);
      r0 += rows > 8 ? 16 : 8;
    }
  });
}

// Operands: x [M, K] bf16, then G tiled weights [T_g, P, 32] of one dtype, bf16 or int8
// (P = ceil(K / 2)); results: G f32 [M, N_g] with T_g = ceil(N_g / 16).
ffi::Error GroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::RemainingArgs args,
                     ffi::RemainingRets rets) {
  constexpr const char* kWant =
      "phaseserve_tiled_matmul_group: want x [M, K] bf16, G tiles [ceil(N/16), ceil(K/2), 32] of "
      "one dtype (bf16 or int8), G f32 results [M, N]";
  auto xd = x.dimensions();
  const size_t G = rets.size();
  if (xd.size() != 2 || G == 0 || args.size() != G) return ffi::Error::InvalidArgument(kWant);
  const int64_t M = xd[0], K = xd[1], P = (K + 1) / 2;
  std::vector<Tiled> ws;
  ffi::DataType type = ffi::DataType::INVALID;
  for (size_t i = 0; i < G; ++i) {
    auto w = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(kWant);
    auto wd = w->dimensions();
    auto yd = (*y)->dimensions();
    if (i == 0) type = w->element_type();
    if (w->element_type() != type || (type != ffi::BF16 && type != ffi::S8) || wd.size() != 3 ||
        wd[1] != P || wd[2] != 32 || yd.size() != 2 || yd[0] != M || (yd[1] + 15) / 16 != wd[0])
      return ffi::Error::InvalidArgument(kWant);
    ws.push_back({w->untyped_data(), yd[1], wd[0], (*y)->typed_data()});
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  if (type == ffi::S8)
    group<int8_t>(pool, xp, M, K, ws);
  else
    group<uint16_t>(pool, xp, M, K, ws);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveTiledMatmulGroup, GroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .RemainingRets());
