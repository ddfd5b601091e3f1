// W8A8 matmuls for decode batches on AVX512-VNNI, weights in column tiles of K quads:
// ys[g][M, N_g] (f32) = quant(x)[M, K] . w_g * x_scale[M], the caller applies w_g's scales.
// x (bf16 or f32) is quantized here, per row: amax / 127 is the row's scale and each value is
// rounded half to even to an int8 in [-127, 127] (models.cpu.lowering.quantize_activations).
// w_g is stored as [T, Q, 16, 4] uint8 = int8 + 128 (T = ceil(N / 16) tiles of 16 columns,
// Q = ceil(K / 4) quads of rows; [t, q, c, j] is w[4q + j, 16t + c] + 128, 128 past the weight):
// a tile's K x 16 bytes are one contiguous stream, half the bytes of a bf16 tile.
//
// The rows of x are the vector lanes: the quantized x is laid out once in quads, xt[q, m] = the
// four int8 x[m, 4q .. 4q + 3] (32 bits), rows padded to a multiple of 8; vectors of V = 16 rows
// (a zmm), the last 1-8 rows in one of V = 8 (a ymm). For a tile and a vector of V rows, 16 int32
// accumulators (one a column) take, per quad q, one vpdpbusd of the column's biased weight quad
// broadcast from memory (unsigned) with the rows' quad vector (signed): 64 products an
// instruction, twice vdpbf16ps's. The bias adds 128 * sum_k x[m, k] to row m, removed exactly
// when the 16 x V block is transposed out. Integer sums are exact: the result equals XLA's
// int8 x int8 -> int32 dot of the same quantized values, times x's scale.
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
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

// scratch slot 0: x's quads
#include "scratch.h"

// 16 values of x from k (lanes past K: zero), as f32.
inline __m512 load16(const uint16_t* x, __mmask16 m) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }

// Quantizes row m of x into xt[q * ld + m] (zeros for rows in [M, ld) and past K); bias[m] =
// 128 * sum of the row's int8 values, scale[m] its scale.
template <typename X>
void quantize_rows(const X* x, int64_t M, int64_t K, int64_t Q, int64_t ld, int8_t* xt,
                   int32_t* bias, float* scale) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  auto* xt32 = reinterpret_cast<int32_t*>(xt);
  for (int64_t m = 0; m < M; ++m) {
    const X* row = x + m * K;
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mk = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
      vmax = _mm512_max_ps(vmax, _mm512_andnot_ps(sign, load16(row + k, mk)));
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    const float s = amax > 0.f ? amax / 127.0f : 1.0f;
    const __m512 vs = _mm512_set1_ps(s);
    __m512i vsum = _mm512_setzero_si512();
    for (int64_t k = 0; k < 4 * Q; k += 16) {
      const __mmask16 mk = K - k >= 16 ? __mmask16(0xFFFF)
                           : K > k ? __mmask16((1u << (K - k)) - 1) : __mmask16(0);
      // x / s rounded half to even (the default MXCSR mode), clamped to [-127, 127]
      __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(load16(row + k, mk), vs));
      v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      vsum = _mm512_add_epi32(vsum, v);
      alignas(16) int32_t quads[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(quads), _mm512_cvtepi32_epi8(v));
      const int64_t q0 = k / 4;
      for (int i = 0; i < 4 && q0 + i < Q; ++i) xt32[(q0 + i) * ld + m] = quads[i];
    }
    bias[m] = 128 * _mm512_reduce_add_epi32(vsum);
    scale[m] = s;
  }
  for (int64_t q = 0; q < Q; ++q) std::memset(xt32 + q * ld + M, 0, (ld - M) * 4);
}

// acc += u8 quads of a . s8 quads of b, per 32-bit lane. Inline asm ties acc to its register:
// GCC 12 compiles the intrinsics' 16-accumulator loop with a register copy per product and
// stack spills (its vpdpbusd builtin does not tie the accumulator), ~2x slower.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// Prefetch distance in quads (64-byte lines) ahead of the dot products.
constexpr int64_t kAhead = 64;

// One tile (16 columns, Q quads: wt[q * 16 + c]) times rows [r0, r0 + V) of xt (row stride ld
// int32), written to y[r, n0 + c] for r < rows, c < cols (row stride ldy).
template <int V>
void tile_block(const int32_t* __restrict xt, int64_t ld, int64_t r0, int64_t Q,
                const int32_t* __restrict wt, const int32_t* bias, const float* scale,
                float* __restrict y, int64_t ldy, int64_t rows, int64_t cols) {
  alignas(64) int32_t out[16][V];
  if constexpr (V == 16) {
    __m512i a[16];
    for (int c = 0; c < 16; ++c) a[c] = _mm512_setzero_si512();
    for (int64_t q = 0; q < Q; ++q) {
      const __m512i xv = _mm512_loadu_si512(xt + q * ld + r0);
      const int32_t* w = wt + q * 16;
      _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kAhead), _MM_HINT_T0);
      for (int c = 0; c < 16; ++c) a[c] = dpbusd(a[c], _mm512_set1_epi32(w[c]), xv);
    }
    for (int c = 0; c < 16; ++c) _mm512_store_si512(out[c], a[c]);
  } else {
    __m256i a[16];
    for (int c = 0; c < 16; ++c) a[c] = _mm256_setzero_si256();
    for (int64_t q = 0; q < Q; ++q) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + q * ld + r0));
      const int32_t* w = wt + q * 16;
      _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kAhead), _MM_HINT_T0);
      for (int c = 0; c < 16; ++c) a[c] = dpbusd(a[c], _mm256_set1_epi32(w[c]), xv);
    }
    for (int c = 0; c < 16; ++c) _mm256_store_si256(reinterpret_cast<__m256i*>(out[c]), a[c]);
  }
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                          5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(V));
  const __mmask16 cm = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i acc = _mm512_sub_epi32(_mm512_i32gather_epi32(idx, &out[0][r], 4),
                                         _mm512_set1_epi32(bias[r0 + r]));
    _mm512_mask_storeu_ps(y + r * ldy, cm, _mm512_mul_ps(_mm512_cvtepi32_ps(acc),
                                                         _mm512_set1_ps(scale[r0 + r])));
  }
}

struct Tiled {
  const int32_t* w;  // [T, Q, 16] quads of biased int8
  int64_t N, T;
  float* y;  // [M, N]
};

template <typename X>
void group(ffi::ThreadPool& pool, const X* x, int64_t M, int64_t K, const std::vector<Tiled>& ws) {
  if (M == 0) return;
  const int64_t Q = (K + 3) / 4, ld = (M + 7) / 8 * 8;
  auto* xt = static_cast<int8_t*>(scratch(0, Q * ld * 4));
  std::vector<int32_t> bias(M);
  std::vector<float> scale(M);
  quantize_rows(x, M, K, Q, ld, xt, bias.data(), scale.data());
  const auto* xq = reinterpret_cast<const int32_t*>(xt);
  std::vector<int64_t> counts;
  for (const auto& w : ws) counts.push_back(w.T);
  for_each_tile(pool, counts, [&](size_t g, int64_t local) {
    const Tiled& w = ws[g];
    const int64_t n0 = 16 * local;
    const int32_t* wt = w.w + local * Q * 16;
    const int64_t cols = std::min<int64_t>(16, w.N - n0);
    for (int64_t r0 = 0; r0 < M;) {
      const int64_t rows = std::min<int64_t>(16, M - r0);
      float* y = w.y + r0 * w.N + n0;
      if (rows > 8)
        tile_block<16>(xq, ld, r0, Q, wt, bias.data(), scale.data(), y, w.N, rows, cols);
      else
        tile_block<8>(xq, ld, r0, Q, wt, bias.data(), scale.data(), y, w.N, rows, cols);
      r0 += rows > 8 ? 16 : 8;
    }
  });
}

// Operands: x [M, K] bf16 or f32, then G tiled weights [T_g, Q, 64] uint8 (Q = ceil(K / 4));
// results: G f32 [M, N_g] with T_g = ceil(N_g / 16).
ffi::Error GroupImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs args,
                     ffi::RemainingRets rets) {
  constexpr const char* kWant =
      "phaseserve_tiled_w8a8_group: want x [M, K] bf16 or f32, G uint8 tiles [ceil(N/16), "
      "ceil(K/4), 64], G f32 results [M, N]";
  auto xd = x.dimensions();
  const size_t G = rets.size();
  if (xd.size() != 2 || G == 0 || args.size() != G ||
      (x.element_type() != ffi::BF16 && x.element_type() != ffi::F32))
    return ffi::Error::InvalidArgument(kWant);
  const int64_t M = xd[0], K = xd[1], Q = (K + 3) / 4;
  std::vector<Tiled> ws;
  for (size_t i = 0; i < G; ++i) {
    auto w = args.get<ffi::Buffer<ffi::U8>>(i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(kWant);
    auto wd = w->dimensions();
    auto yd = (*y)->dimensions();
    if (wd.size() != 3 || wd[1] != Q || wd[2] != 64 || yd.size() != 2 || yd[0] != M ||
        (yd[1] + 15) / 16 != wd[0])
      return ffi::Error::InvalidArgument(kWant);
    ws.push_back({reinterpret_cast<const int32_t*>(w->typed_data()), yd[1], wd[0],
                  (*y)->typed_data()});
  }
  if (x.element_type() == ffi::BF16)
    group(pool, reinterpret_cast<const uint16_t*>(x.untyped_data()), M, K, ws);
  else
    group(pool, reinterpret_cast<const float*>(x.untyped_data()), M, K, ws);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveTiledW8A8Group, GroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets());
