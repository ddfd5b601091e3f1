// AMX bf16 matmuls for decode batches (tens of rows): ys[g][M, N_g] (f32) = x[M, K] (bf16) .
// ws[g][K, N_g] (bf16, or int8 raw values: exact in bf16), f32 accumulation in the tiles.
//
// The weight stays as stored ([K, N] row-major). Each thread takes a contiguous range of column
// chunks over the group's weights; per chunk it streams the chunk's rows once, re-laying them
// into a panel of AMX B tiles (pairs of K rows interleaved, 16 columns x 32 K per tile, int8
// widened to bf16 on the way) that stays in L2, then runs every row block of x against the
// panel: 2 A tiles (32 rows of x) x 2 B tiles (32 columns) -> 4 C tiles accumulated over all of
// K, stored once. x is copied once per call into a zero-padded [Mp, Kp] bf16 buffer (Mp, Kp
// multiples of 32), so tiles never read past the data; padded rows and columns are never
// written to y.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
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

// One chunk's B tiles, kept in L2 (measured on the Xeon: 512 KB or 1 MB panels were no faster).
constexpr int64_t kPanelBytes = 192 * 1024;
// Weight rows prefetched ahead while re-laying a chunk, into L3 (_MM_HINT_T2): measured on the
// Xeon, 16 rows ahead into L3 streamed 15-19 GB/s per thread, 6 rows ahead into L1 14-16.
constexpr int64_t kPrefetchRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows x 64 bytes: tmm0-3 C (16 x 16 f32), tmm4-5 A (16 x 32 bf16), tmm6-7 B.
void configure_tiles() {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

struct Weight {
  const void* w;
  int64_t N;
  float* y;
};

struct Chunk {
  int g;
  int64_t c0, cw;  // columns [c0, c0 + cw) of weight g; cw a multiple of 32
};

// The panel of columns [c0, c0 + cw): for column tile t (16 columns) and K step s (32 rows),
// tile (t * S + s) holds row r = the pair (K rows s*32 + 2r, s*32 + 2r + 1) of its 16 columns,
// interleaved (column n: [w(k, n), w(k + 1, n)]). Rows past K and columns past N are zero.
void repack_bf16(const uint16_t* w, int64_t K, int64_t N, int64_t c0, int64_t cw, int64_t S,
                 uint16_t* panel) {
  alignas(64) uint16_t lo[32], hi[32];
  for (int i = 0; i < 16; ++i) {
    lo[2 * i] = i;
    lo[2 * i + 1] = 32 + i;
    hi[2 * i] = 16 + i;
    hi[2 * i + 1] = 48 + i;
  }
  const __m512i lo_idx = _mm512_load_si512(lo), hi_idx = _mm512_load_si512(hi);
  const int64_t Kp = S * 32;
  for (int64_t k = 0; k < Kp; k += 2) {
    const int64_t s = k / 32, r = (k % 32) / 2;
    for (int64_t j = 0; j < cw; j += 32) {
      const int64_t n = c0 + j;
      const int64_t valid = std::min<int64_t>(32, std::max<int64_t>(0, N - n));
      const __mmask32 m = valid >= 32 ? ~__mmask32(0) : ((__mmask32(1) << valid) - 1);
      const __m512i a = k < K ? _mm512_maskz_loadu_epi16(m, w + k * N + n) : _mm512_setzero_si512();
      const __m512i b =
          k + 1 < K ? _mm512_maskz_loadu_epi16(m, w + (k + 1) * N + n) : _mm512_setzero_si512();
      if (k + kPrefetchRows + 1 < K) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchRows) * N + n), _MM_HINT_T2);
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchRows + 1) * N + n), _MM_HINT_T2);
      }
      const int64_t t = j / 16;
      _mm512_store_si512(panel + ((t * S + s) * 16 + r) * 32, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_store_si512(panel + (((t + 1) * S + s) * 16 + r) * 32,
                         _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  }
}

// The same for int8 weights: each value widened to f32 (exact), whose top 16 bits are its bf16.
void repack_s8(const int8_t* w, int64_t K, int64_t N, int64_t c0, int64_t cw, int64_t S,
               uint16_t* panel) {
  const int64_t Kp = S * 32;
  for (int64_t k = 0; k < Kp; k += 2) {
    const int64_t s = k / 32, r = (k % 32) / 2;
    for (int64_t j = 0; j < cw; j += 32) {
      const int64_t n = c0 + j;
      const int64_t valid = std::min<int64_t>(32, std::max<int64_t>(0, N - n));
      const __mmask32 m = valid >= 32 ? ~__mmask32(0) : ((__mmask32(1) << valid) - 1);
      const __m256i a = k < K ? _mm256_maskz_loadu_epi8(m, w + k * N + n) : _mm256_setzero_si256();
      const __m256i b =
          k + 1 < K ? _mm256_maskz_loadu_epi8(m, w + (k + 1) * N + n) : _mm256_setzero_si256();
      if (k + kPrefetchRows + 1 < K) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchRows) * N + n), _MM_HINT_T2);
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchRows + 1) * N + n), _MM_HINT_T2);
      }
      const int64_t t = j / 16;
      for (int h = 0; h < 2; ++h) {
        const __m128i ah = h ? _mm256_extracti128_si256(a, 1) : _mm256_castsi256_si128(a);
        const __m128i bh = h ? _mm256_extracti128_si256(b, 1) : _mm256_castsi256_si128(b);
        const __m512i fa = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ah)));
        const __m512i fb = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bh)));
        const __m512i pair = _mm512_mask_mov_epi16(_mm512_srli_epi32(fa, 16), 0xAAAAAAAA, fb);
        _mm512_store_si512(panel + (((t + h) * S + s) * 16 + r) * 32, pair);
      }
    }
  }
}

// y rows [m0, m0 + 16 * A), columns [n0, n0 + 32) of the chunk's column tiles t, t + 1.
template <int A>
void tile_block(const uint16_t* xb, int64_t Kp, int64_t m0, const uint16_t* panel, int64_t t,
                int64_t S, float* cbuf) {
  _tile_zero(0);
  _tile_zero(1);
  if (A == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* b0 = panel + t * S * 512;
  const uint16_t* b1 = b0 + S * 512;
  const uint16_t* a0 = xb + m0 * Kp;
  const uint16_t* a1 = a0 + 16 * Kp;
  for (int64_t s = 0; s < S; ++s) {
    _tile_loadd(6, b0 + s * 512, 64);
    _tile_loadd(7, b1 + s * 512, 64);
    _tile_loadd(4, a0 + s * 32, Kp * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (A == 2) {
      _tile_loadd(5, a1 + s * 32, Kp * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 128);
  _tile_stored(1, cbuf + 16, 128);
  if (A == 2) {
    _tile_stored(2, cbuf + 16 * 32, 128);
    _tile_stored(3, cbuf + 16 * 32 + 16, 128);
  }
}

template <typename W>
void run_chunk(const uint16_t* xb, int64_t M, int64_t Mp, int64_t K, int64_t S, const Weight& wt,
               const Chunk& c, uint16_t* panel, float* cbuf) {
  if (sizeof(W) == 2)
    repack_bf16(static_cast<const uint16_t*>(wt.w), K, wt.N, c.c0, c.cw, S, panel);
  else
    repack_s8(static_cast<const int8_t*>(wt.w), K, wt.N, c.c0, c.cw, S, panel);
  const int64_t Kp = S * 32;
  for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
    const int rows_a = Mp - m0 >= 32 ? 2 : 1;
    const int64_t mv = std::min<int64_t>(16 * rows_a, M - m0);
    for (int64_t t = 0; t < c.cw / 16; t += 2) {
      const int64_t n = c.c0 + t * 16;
      const int64_t nv = std::min<int64_t>(32, wt.N - n);
      if (nv <= 0) break;
      if (rows_a == 2)
        tile_block<2>(xb, Kp, m0, panel, t, S, cbuf);
      else
        tile_block<1>(xb, Kp, m0, panel, t, S, cbuf);
      for (int64_t i = 0; i < mv; ++i)
        std::memcpy(wt.y + (m0 + i) * wt.N + n, cbuf + i * 32, nv * sizeof(float));
    }
  }
}

// Runs `fn(p)` for p in [0, parts) on the pool (this thread takes a share) and waits.
template <typename Fn>
void run_parts(ffi::ThreadPool& pool, int64_t parts, Fn fn) {
  struct Sync { std::atomic<int64_t> next{0}; std::atomic<int64_t> done{0}; };
  auto sync = std::make_shared<Sync>();
  auto body = [sync, parts, fn] {
    while (true) {
      const int64_t p = sync->next.fetch_add(1);
      if (p >= parts) return;
      fn(p);
      sync->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i + 1 < parts; ++i) pool.Schedule([body] { body(); });
  body();
  while (sync->done.load(std::memory_order_acquire) < parts) _mm_pause();
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// This thread's 64-byte aligned buffer `slot` (0: x, 1: the panel) of at least `bytes`, kept
// across calls (a fresh allocation per call would page-fault its pages in every time).
uint16_t* scratch(int slot, int64_t bytes) {
  thread_local std::unique_ptr<uint16_t, FreeDeleter> buf[2];
  thread_local int64_t size[2] = {0, 0};
  if (size[slot] < bytes) {
    const int64_t rounded = (bytes + 4095) / 4096 * 4096;
    buf[slot].reset(static_cast<uint16_t*>(std::aligned_alloc(64, rounded)));
    size[slot] = rounded;
  }
  return buf[slot].get();
}

template <typename W>
void amx_group(ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K,
               const std::vector<Weight>& ws) {
  if (M == 0) return;
  const int64_t S = (K + 31) / 32, Kp = S * 32, Mp = (M + 15) / 16 * 16;
  uint16_t* xb = scratch(0, Mp * Kp * 2);
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(xb + m * Kp, x + m * K, K * 2);
    std::memset(xb + m * Kp + K, 0, (Kp - K) * 2);
  }
  std::memset(xb + M * Kp, 0, (Mp - M) * Kp * 2);
  // The group's columns (each weight's rounded up to 32) split evenly over the parts, each
  // part's share cut into chunks as wide as the panel allows, of near-equal widths.
  const int64_t cw_max = std::max<int64_t>(32, kPanelBytes / (Kp * 2) / 32 * 32);
  int64_t total = 0;
  for (const auto& w : ws) total += (w.N + 31) / 32;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, total));
  std::vector<std::vector<Chunk>> work(parts);
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t a = 32 * (total * p / parts), b = 32 * (total * (p + 1) / parts);
    int64_t offset = 0;
    for (size_t g = 0; g < ws.size(); ++g) {
      const int64_t width = (ws[g].N + 31) / 32 * 32;
      const int64_t lo = std::max(a, offset) - offset, hi = std::min(b, offset + width) - offset;
      offset += width;
      if (hi <= lo) continue;
      const int64_t blocks = (hi - lo) / 32, n_chunks = (hi - lo + cw_max - 1) / cw_max;
      for (int64_t i = 0; i < n_chunks; ++i) {
        const int64_t c0 = lo + 32 * (blocks * i / n_chunks);
        const int64_t c1 = lo + 32 * (blocks * (i + 1) / n_chunks);
        if (c1 > c0) work[p].push_back({int(g), c0, c1 - c0});
      }
    }
  }
  run_parts(pool, parts, [&](int64_t p) {
    uint16_t* panel = scratch(1, Kp * 2 * cw_max);
    alignas(64) float cbuf[32 * 32];
    configure_tiles();
    for (const Chunk& c : work[p]) run_chunk<W>(xb, M, Mp, K, S, ws[c.g], c, panel, cbuf);
    _tile_release();
  });
}

// Operands: x [M, K] bf16, then G weights [K, N_g] of one dtype (bf16 or int8); results: G f32
// [M, N_g].
ffi::Error AmxMatmulGroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                              ffi::RemainingArgs args, ffi::RemainingRets rets) {
  constexpr const char* kWant =
      "phaseserve_amx_matmul_group: want x [M, K] bf16, G w [K, N] of one dtype (bf16 or int8), "
      "G f32 results [M, N]";
  auto xd = x.dimensions();
  const size_t G = rets.size();
  if (xd.size() != 2 || G == 0 || args.size() != G) return ffi::Error::InvalidArgument(kWant);
  std::vector<Weight> ws;
  ffi::DataType type = ffi::DataType::INVALID;
  for (size_t i = 0; i < G; ++i) {
    auto w = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(kWant);
    auto wd = w->dimensions();
    if (wd.size() != 2 || wd[0] != xd[1] || (*y)->element_count() != xd[0] * wd[1])
      return ffi::Error::InvalidArgument(kWant);
    if (i == 0) type = w->element_type();
    if (w->element_type() != type || (type != ffi::BF16 && type != ffi::S8))
      return ffi::Error::InvalidArgument(kWant);
    ws.push_back({w->untyped_data(), wd[1], (*y)->typed_data()});
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  if (type == ffi::BF16)
    amx_group<uint16_t>(pool, xp, xd[0], xd[1], ws);
  else
    amx_group<int8_t>(pool, xp, xd[0], xd[1], ws);
  return ffi::Error::Success();
}

}  // namespace

// Asks the kernel for this process's permission to use the AMX tile data (Linux
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); 0 on success. Call before any kernel runs.
extern "C" int phaseserve_amx_init() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 0 : -1;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveAmxMatmulGroup, AmxMatmulGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .RemainingRets());
