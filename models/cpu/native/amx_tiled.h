// AMX products on weights already laid out as B tiles, for amx_matmul.cc (inlined by
// models.cpu.build.source; needs its padded_x, configure_tiles and run_parts). tiled_block
// also serves amx_matmul.cc's whole-K panels, which hold a chunk's tiles in the same order.
//
// The tiled copy of a bf16 weight (models.quant.TiledArray, kernels.tile_weight: [T, P, 32],
// [t, p, 2c + j] = w[2p + j, 16t + c]) is, for K % 32 == 0, a sequence of AMX B tiles: tile
// (t, s) is rows 16 s .. 16 s + 15 of column tile t, 1 KB contiguous, and column tile t's K
// steps follow one another. So nothing is re-laid per call: the tiles stream from memory
// straight into the tile registers (two contiguous streams a column pair, prefetched ahead),
// C blocks stay in their tiles over all of K and are written once to y.

constexpr int64_t kTilePrefetchSteps = 8;  // K steps (1 KB a stream) prefetched ahead

struct TiledWeight {
  const uint16_t* tiles;  // [T, S * 16, 32]
  int64_t N, T;
  float* y;  // [M, N]
};

// C rows [m0, m0 + 16 A) x column tiles t .. t + C - 1 (C <= 2) of w over its S K steps,
// written to y's columns from col0 + 16 t (col0: where w's tiles start in y).
template <int A, int C>
void tiled_block(const uint16_t* xb, int64_t Kp, int64_t m0, int64_t M, const TiledWeight& w,
                 int64_t t, int64_t S, bool prefetch, int64_t col0 = 0) {
  _tile_zero(0);
  if (C == 2) _tile_zero(1);
  if (A == 2) {
    _tile_zero(2);
    if (C == 2) _tile_zero(3);
  }
  const uint16_t* b0 = w.tiles + t * S * 512;
  const uint16_t* b1 = b0 + S * 512;
  const uint16_t* a0 = xb + m0 * Kp;
  const uint16_t* a1 = a0 + 16 * Kp;
  for (int64_t s = 0; s < S; ++s) {
    if (prefetch && s + kTilePrefetchSteps < S)
      for (int64_t c = 0; c < 1024; c += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(b0 + (s + kTilePrefetchSteps) * 512) + c,
                     _MM_HINT_T0);
        if (C == 2)
          _mm_prefetch(reinterpret_cast<const char*>(b1 + (s + kTilePrefetchSteps) * 512) + c,
                       _MM_HINT_T0);
      }
    _tile_loadd(6, b0 + s * 512, 64);
    if (C == 2) _tile_loadd(7, b1 + s * 512, 64);
    _tile_loadd(4, a0 + s * 32, Kp * 2);
    _tile_dpbf16ps(0, 4, 6);
    if (C == 2) _tile_dpbf16ps(1, 4, 7);
    if (A == 2) {
      _tile_loadd(5, a1 + s * 32, Kp * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (C == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t col = col0 + t * 16;
  if (m0 + 16 * A <= M && col + 16 * C <= w.N) {
    float* c = w.y + m0 * w.N + col;
    _tile_stored(0, c, w.N * 4);
    if (C == 2) _tile_stored(1, c + 16, w.N * 4);
    if (A == 2) {
      _tile_stored(2, c + 16 * w.N, w.N * 4);
      if (C == 2) _tile_stored(3, c + 16 * w.N + 16, w.N * 4);
    }
    return;
  }
  alignas(64) float cb[32 * 32];
  _tile_stored(0, cb, 128);
  if (C == 2) _tile_stored(1, cb + 16, 128);
  if (A == 2) {
    _tile_stored(2, cb + 16 * 32, 128);
    if (C == 2) _tile_stored(3, cb + 16 * 32 + 16, 128);
  }
  const int64_t rows = std::min<int64_t>(16 * A, M - m0);
  const int64_t cols = std::min<int64_t>(16 * C, w.N - col);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(w.y + (m0 + r) * w.N + col, cb + r * 32, cols * 4);
}

// Column tiles t .. t + C - 1 of w for every row block of x.
template <int C>
void tiled_columns(const uint16_t* xb, int64_t Kp, int64_t M, int64_t Mp, const TiledWeight& w,
                   int64_t t, int64_t S) {
  for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
    const bool first = m0 == 0;  // later row blocks find the tiles in cache
    if (Mp - m0 >= 32) tiled_block<2, C>(xb, Kp, m0, M, w, t, S, first);
    else tiled_block<1, C>(xb, Kp, m0, M, w, t, S, first);
  }
}

// fn(w, t) for every column-tile pair (weight w, first column tile t) of the group, the pairs
// split evenly over the threads, each thread's tiles configured (also amx_w8.h's driver).
template <typename W, typename Fn>
void over_column_pairs(ffi::ThreadPool& pool, const std::vector<W>& ws, Fn fn) {
  std::vector<std::pair<int64_t, int64_t>> pairs;  // (weight, first column tile)
  for (size_t g = 0; g < ws.size(); ++g)
    for (int64_t t = 0; t < ws[g].T; t += 2) pairs.push_back({int64_t(g), t});
  const int64_t n = int64_t(pairs.size());
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  run_parts(pool, parts, [&](int64_t p) {
    configure_tiles();
    for (int64_t i = n * p / parts; i < n * (p + 1) / parts; ++i)
      fn(ws[pairs[i].first], pairs[i].second);
    _tile_release();
  });
}

// ys[g] = x . w_g for the group's tiled weights (K % 32 == 0).
void amx_tiled_group(ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K,
                     const std::vector<TiledWeight>& ws) {
  if (M == 0) return;
  const int64_t S = K / 32, Mp = (M + 15) / 16 * 16;
  const uint16_t* xb = padded_x(x, M, K, Mp, K);
  over_column_pairs(pool, ws, [&](const TiledWeight& w, int64_t t) {
    if (t + 1 < w.T) tiled_columns<2>(xb, K, M, Mp, w, t, S);
    else tiled_columns<1>(xb, K, M, Mp, w, t, S);
  });
}

// A tiled call's operands: x [M, K] bf16 with K % k_step == 0, then G weights' tiles
// [ceil(N_g / 16), K / k_rows, width] of dtype et, and G f32 results [M, N_g], into ws (W:
// TiledWeight, or amx_w8.h's W8Weight); false on any mismatch.
template <typename W>
bool tiled_operands(const ffi::Buffer<ffi::BF16>& x, ffi::RemainingArgs& args,
                    ffi::RemainingRets& rets, ffi::DataType et, int64_t k_step, int64_t k_rows,
                    int64_t width, std::vector<W>& ws) {
  auto xd = x.dimensions();
  const size_t G = rets.size();
  if (xd.size() != 2 || G == 0 || args.size() != G || xd[1] % k_step != 0) return false;
  const int64_t M = xd[0], K = xd[1];
  for (size_t i = 0; i < G; ++i) {
    auto w = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return false;
    auto wd = w->dimensions();
    auto yd = (*y)->dimensions();
    if (w->element_type() != et || wd.size() != 3 || wd[1] != K / k_rows || wd[2] != width ||
        yd.size() != 2 || yd[0] != M || (yd[1] + 15) / 16 != wd[0])
      return false;
    ws.push_back({static_cast<decltype(W::tiles)>(w->untyped_data()), yd[1], wd[0],
                  (*y)->typed_data()});
  }
  return true;
}

// Operands: x [M, K] bf16 (K % 32 == 0), then G tiled weights [ceil(N_g / 16), K / 2, 32] bf16;
// results: G f32 [M, N_g].
ffi::Error AmxTiledGroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                             ffi::RemainingArgs args, ffi::RemainingRets rets) {
  std::vector<TiledWeight> ws;
  if (!tiled_operands(x, args, rets, ffi::BF16, 32, 2, 32, ws))
    return ffi::Error::InvalidArgument(
        "phaseserve_amx_tiled_group: want x [M, K] bf16 (K % 32 == 0), G tiles "
        "[ceil(N/16), K/2, 32] bf16, G f32 results [M, N]");
  amx_tiled_group(pool, reinterpret_cast<const uint16_t*>(x.untyped_data()),
                  x.dimensions()[0], x.dimensions()[1], ws);
  return ffi::Error::Success();
}
