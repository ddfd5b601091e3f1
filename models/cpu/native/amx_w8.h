// AMX products of bf16 activations with weight-only int8 weights, both in int8 tiles, for
// amx_matmul.cc (inlined by models.cpu.build.source; needs its scratch and amx_tiled.h's
// over_column_pairs and tiled_operands). Half the bytes of the bf16 tiles streamed, and no widening of the weights:
//
// * Weights: kernels.tile_weight_quads(w) [T, K / 4, 64] int8, [t, q, 4c + j] = w[4q + j, 16t + c],
//   which for K % 64 == 0 is a sequence of AMX int8 B tiles: tile (t, s) is quad rows
//   16 s .. 16 s + 15 of column tile t (K rows 64 s .. 64 s + 63), 1 KB contiguous.
// * Activations: each row of x is quantized to 16 bits, q = rint(x * 32767 / amax) (amax the
//   row's largest |x|; f32 product, round half to even), and split into q = 256 hi + lo with hi
//   signed and lo unsigned 8 bits. Per K step two products, hi . w (tdpbssd) and lo . w
//   (tdpbusd), accumulate exactly in int32; y = amax / 32767 * (256 sum_hi + sum_lo). The
//   caller applies the weights' scales.
// 16 rows x 2 column tiles a block: C tiles 0-3 (hi / lo x two columns), A 4-5, B 6-7.

constexpr int64_t kW8PrefetchSteps = 8;  // K steps (1 KB a stream) prefetched ahead

struct W8Weight {
  const int8_t* tiles;  // [T, S * 16, 64]
  int64_t N, T;
  float* y;  // [M, N]
};

// x [M, K] bf16 -> hi, lo [Mp, K] (rows past M zero) and each row's dequantization step.
void split_rows(const uint16_t* x, int64_t M, int64_t K, int64_t Mp, int8_t* hi, uint8_t* lo,
                float* step) {
  for (int64_t m = 0; m < Mp; ++m) {
    int8_t* h = hi + m * K;
    uint8_t* l = lo + m * K;
    if (m >= M) {
      std::memset(h, 0, K);
      std::memset(l, 0, K);
      step[m] = 0.f;
      continue;
    }
    const uint16_t* xr = x + m * K;
    auto widen = [&](int64_t k) {  // 16 bf16 -> f32
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + k));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    };
    __m512 amax_v = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) amax_v = _mm512_max_ps(amax_v, _mm512_abs_ps(widen(k)));
    const float amax = _mm512_reduce_max_ps(amax_v);
    step[m] = amax / 32767.f;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(widen(k), inv));  // half to even
      const __m512i qc = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)),
                                          _mm512_set1_epi32(-32767));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + k),
                       _mm512_cvtepi32_epi8(_mm512_srai_epi32(qc, 8)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(l + k),
                       _mm512_cvtepi32_epi8(_mm512_and_si512(qc, _mm512_set1_epi32(255))));
    }
  }
}

// Rows [m0, m0 + 16) x column tiles t .. t + C - 1 (C <= 2) of w over its S K steps.
template <int C>
void w8_block(const int8_t* hi, const uint8_t* lo, int64_t K, int64_t m0, int64_t M,
              const float* step, const W8Weight& w, int64_t t, int64_t S, bool prefetch) {
  _tile_zero(0);
  _tile_zero(2);
  if (C == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const int8_t* b0 = w.tiles + t * S * 1024;
  const int8_t* b1 = b0 + S * 1024;
  const int8_t* h = hi + m0 * K;
  const uint8_t* l = lo + m0 * K;
  for (int64_t s = 0; s < S; ++s) {
    if (prefetch && s + kW8PrefetchSteps < S)
      for (int64_t c = 0; c < 1024; c += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(b0 + (s + kW8PrefetchSteps) * 1024) + c,
                     _MM_HINT_T0);
        if (C == 2)
          _mm_prefetch(reinterpret_cast<const char*>(b1 + (s + kW8PrefetchSteps) * 1024) + c,
                       _MM_HINT_T0);
      }
    _tile_loadd(6, b0 + s * 1024, 64);
    if (C == 2) _tile_loadd(7, b1 + s * 1024, 64);
    _tile_loadd(4, h + s * 64, K);
    _tile_loadd(5, l + s * 64, K);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbusd(2, 5, 6);
    if (C == 2) {
      _tile_dpbssd(1, 4, 7);
      _tile_dpbusd(3, 5, 7);
    }
  }
  alignas(64) int32_t cb[4][16 * 16];
  _tile_stored(0, cb[0], 64);
  _tile_stored(2, cb[2], 64);
  if (C == 2) {
    _tile_stored(1, cb[1], 64);
    _tile_stored(3, cb[3], 64);
  }
  const int64_t rows = std::min<int64_t>(16, M - m0);
  for (int64_t c = 0; c < C; ++c) {
    const int64_t col = (t + c) * 16;
    const int64_t cols = std::min<int64_t>(16, w.N - col);
    for (int64_t r = 0; r < rows; ++r) {
      float* y = w.y + (m0 + r) * w.N + col;
      const double sc = step[m0 + r];
      for (int64_t j = 0; j < cols; ++j)
        y[j] = float(sc * (256.0 * cb[c][r * 16 + j] + double(cb[2 + c][r * 16 + j])));
    }
  }
}

// ys[g] = x . w_g for the group's int8 quad tiles (K % 64 == 0): the group's column-tile pairs
// (over_column_pairs), each pair's tiles streamed once for every 16-row block.
void amx_w8_group(ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K,
                  const std::vector<W8Weight>& ws) {
  if (M == 0) return;
  const int64_t S = K / 64, Mp = (M + 15) / 16 * 16;
  uint8_t* buf = reinterpret_cast<uint8_t*>(scratch(0, 2 * Mp * K + 4 * Mp + 64));
  int8_t* hi = reinterpret_cast<int8_t*>(buf);
  uint8_t* lo = buf + Mp * K;
  float* step = reinterpret_cast<float*>(buf + 2 * Mp * K);
  split_rows(x, M, K, Mp, hi, lo, step);
  over_column_pairs(pool, ws, [&](const W8Weight& w, int64_t t) {
    for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
      const bool first = m0 == 0;  // later row blocks find the tiles in cache
      if (t + 1 < w.T) w8_block<2>(hi, lo, K, m0, M, step, w, t, S, first);
      else w8_block<1>(hi, lo, K, m0, M, step, w, t, S, first);
    }
  });
}

// Operands: x [M, K] bf16 (K % 64 == 0), then G int8 quad tiles [ceil(N_g / 16), K / 4, 64];
// results: G f32 [M, N_g] (the raw values' products: the caller applies the scales).
ffi::Error AmxW8GroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::RemainingArgs args, ffi::RemainingRets rets) {
  std::vector<W8Weight> ws;
  if (!tiled_operands(x, args, rets, ffi::S8, 64, 4, 64, ws))
    return ffi::Error::InvalidArgument(
        "phaseserve_amx_w8_group: want x [M, K] bf16 (K % 64 == 0), G int8 tiles "
        "[ceil(N/16), K/4, 64], G f32 results [M, N]");
  amx_w8_group(pool, reinterpret_cast<const uint16_t*>(x.untyped_data()), x.dimensions()[0],
               x.dimensions()[1], ws);
  return ffi::Error::Success();
}
