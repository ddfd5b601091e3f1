// AMX bf16 matmuls for decode batches (tens of rows): ys[g][M, N_g] (f32) = x[M, K] (bf16) .
// ws[g][K, N_g] (bf16, or int8 raw values: exact in bf16), f32 accumulation in the tiles.
//
// The weight stays as stored ([K, N] row-major). The group's columns are split evenly over the
// threads, and each thread's share into chunks of up to kChunkColumns columns. A chunk's rows
// are streamed in K blocks (as many 32-row K steps as fit kPanelBytes), each block re-laid into
// a panel of AMX B tiles in L2 (pairs of K rows interleaved, 16 columns x 32 K per tile, int8
// widened to bf16 on the way) and multiplied: 2 A tiles (32 rows of x) x 2 B tiles (32 columns)
// -> 4 C tiles, loaded from and stored to an f32 accumulator between K blocks, which is copied
// to y at the end. x is copied once per call into a zero-padded [Mp, Kp] bf16 buffer (Mp a
// multiple of 16, Kp of 32), so tiles never read past the data; padded rows and columns are
// never written to y.
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

// One K block's B tiles, kept in L2, and the widest chunk of columns (its rows are read as
// contiguous runs of up to this many values). Measured on the Xeon (SmolLM2's seven weights x 30
// layers, 16 / 64 rows): 384 KB x 2,048 columns 11.5 / 18.4 ms; 192 KB x 1,024 13.0 / 20.0;
// 768 KB x 1,024 13.1 / 21.5; a whole-K panel of <= 192 KB per chunk (no K blocks) 14.5 / 23.2.
// Prefetching the next K block during the tile steps was slower (13.6 / 20.4).
constexpr int64_t kPanelBytes = 384 * 1024;
constexpr int64_t kChunkColumns = 2048;

// From this many rows (padded) a chunk's whole K is re-laid into the panel at once and each
// C block stays in its tiles over all of K (run_chunk_whole_k): the K-blocked loop's f32
// accumulator ([Mp, 2048] columns: 4 MB at 512 rows) no longer fits L2. Measured on the Xeon
// (SmolLM2's gate / up, o / k / v and down: 1536 + 576 columns of K 576 and 576 of K 1536):
// 512 rows 3.07 -> 2.33 ms, 256 rows 1.57 -> 1.49, 128-130 rows 0.92 / 0.96 -> 0.89 / 1.01.
constexpr int64_t kWholeKRows = 256;

// Weight rows prefetched ahead while re-laying a chunk, into L3 (_MM_HINT_T2): measured on the
// Xeon, 16 rows ahead into L3 streamed 15-19 GB/s per thread, 6 rows ahead into L1 14-16.
constexpr int64_t kPrefetchRows = 16;

// Tiles: tmm0-3 C, tmm4-5 A, tmm6-7 B.
#include "amx_tile_config.h"

#include "group_args.h"

#include "run_parts.h"

const uint16_t* padded_x(const uint16_t* x, int64_t M, int64_t K, int64_t Mp, int64_t Kp);
uint16_t* scratch(int slot, int64_t bytes);

#include "amx_tiled.h"
#include "amx_w8.h"

struct Chunk {
  int g;
  int64_t c0, cw;  // columns [c0, c0 + cw) of weight g; cw a multiple of 32
};

// The permutations that interleave two rows of 32 16-bit values into the pairs of columns 0-15
// (kLo) and 16-31 (kHi): [a0, b0, a1, b1, ...].
struct Interleave {
  __m512i lo, hi;
  Interleave() {
    alignas(64) uint16_t l[32], h[32];
    for (int i = 0; i < 16; ++i) {
      l[2 * i] = i;
      l[2 * i + 1] = 32 + i;
      h[2 * i] = 16 + i;
      h[2 * i + 1] = 48 + i;
    }
    lo = _mm512_load_si512(l);
    hi = _mm512_load_si512(h);
  }
};

// 32 values of a row from p (the first `m` of them; zeros past them) as 32 bf16 bit patterns.
inline __m512i row32(const uint16_t* p, __mmask32 m) { return _mm512_maskz_loadu_epi16(m, p); }
inline __m512i row32(const int8_t* p, __mmask32 m) {
  // int8 -> int16 -> fp16 (exact) -> bf16 by moving the exponent's bias (15 -> 127) and dropping
  // three mantissa bits that are zero for |v| <= 256; zero stays zero.
  const __m512i h = _mm512_castph_si512(
      _mm512_cvtepi16_ph(_mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, p))));
  const __m512i mag = _mm512_and_si512(h, _mm512_set1_epi16(0x7FFF));
  const __m512i bf = _mm512_maskz_add_epi16(_mm512_test_epi16_mask(mag, mag),
                                            _mm512_srli_epi16(mag, 3), _mm512_set1_epi16(0x3800));
  return _mm512_or_si512(bf, _mm512_and_si512(h, _mm512_set1_epi16(int16_t(0x8000))));
}

// The panel of columns [c0, c0 + cw) (cw a multiple of 32) and weight rows [k0, k0 + 32 S): for
// column tile t (16 columns) and K step s, tile (t * S + s) holds in its row r the pair of
// weight rows (k0 + 32 s + 2 r, + 1) of its 16 columns, interleaved ([w(k, n), w(k + 1, n)] per
// column n), as bf16. Rows past K and columns past N are zero. The rows kPrefetchRows ahead
// are prefetched.
template <typename W>
void repack(const W* w, int64_t K, int64_t N, int64_t c0, int64_t cw, int64_t k0, int64_t S,
            uint16_t* panel) {
  static const Interleave il;
  for (int64_t kk = 0; kk < S * 32; kk += 2) {
    const int64_t k = k0 + kk, s = kk / 32, r = (kk % 32) / 2;
    for (int64_t j = 0; j < cw; j += 32) {
      const int64_t n = c0 + j;
      const int64_t valid = std::min<int64_t>(32, std::max<int64_t>(0, N - n));
      const __mmask32 m = valid >= 32 ? ~__mmask32(0) : ((__mmask32(1) << valid) - 1);
      const __m512i a = row32(w + k * N + n, k < K ? m : 0);
      const __m512i b = row32(w + (k + 1) * N + n, k + 1 < K ? m : 0);
      if (k + kPrefetchRows + 1 < K) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchRows) * N + n), _MM_HINT_T2);
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchRows + 1) * N + n),
                     _MM_HINT_T2);
      }
      const int64_t t = j / 16;
      _mm512_store_si512(panel + ((t * S + s) * 16 + r) * 32, _mm512_permutex2var_epi16(a, il.lo, b));
      _mm512_store_si512(panel + (((t + 1) * S + s) * 16 + r) * 32,
                         _mm512_permutex2var_epi16(a, il.hi, b));
    }
  }
}

// C rows [m0, m0 + 16 * A) x the 32 columns of the panel's column tiles t, t + 1, over the
// panel's S K steps (x's columns from xb, already offset to the panel's first K row), added to
// acc (row stride lda floats) or, when `first`, written to it.
template <int A>
void tile_block(const uint16_t* xb, int64_t Kp, int64_t m0, const uint16_t* panel, int64_t t,
                int64_t S, float* acc, int64_t lda, bool first) {
  float* c = acc + m0 * lda + t * 16;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    if (A == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, c, lda * 4);
    _tile_loadd(1, c + 16, lda * 4);
    if (A == 2) {
      _tile_loadd(2, c + 16 * lda, lda * 4);
      _tile_loadd(3, c + 16 * lda + 16, lda * 4);
    }
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
  _tile_stored(0, c, lda * 4);
  _tile_stored(1, c + 16, lda * 4);
  if (A == 2) {
    _tile_stored(2, c + 16 * lda, lda * 4);
    _tile_stored(3, c + 16 * lda + 16, lda * 4);
  }
}

// A chunk of a prefill-sized product (Mp >= kWholeKRows): its whole K re-laid into the panel
// once, then every 32-row block of x times every pair of column tiles, each C block kept in its
// tiles over all of K and written once to y (amx_tiled.h's tiled_block on the panel).
template <typename W>
void run_chunk_whole_k(const uint16_t* xb, int64_t M, int64_t Mp, int64_t K, int64_t S,
                       const Weight& wt, const Chunk& c, uint16_t* panel) {
  const int64_t Kp = S * 32;
  repack<W>(static_cast<const W*>(wt.w), K, wt.N, c.c0, c.cw, 0, S, panel);
  const TiledWeight pw{panel, wt.N, c.cw / 16, wt.y};  // the panel holds the chunk's tiles
  for (int64_t m0 = 0; m0 < Mp; m0 += 32)
    for (int64_t t = 0; t < c.cw / 16; t += 2) {
      if (Mp - m0 >= 32) tiled_block<2, 2>(xb, Kp, m0, M, pw, t, S, false, c.c0);
      else tiled_block<1, 2>(xb, Kp, m0, M, pw, t, S, false, c.c0);
    }
}

// One chunk: its columns' rows streamed in K blocks as tall as the panel allows (whole rows of
// the chunk, so the weight is read in long contiguous runs), each block re-laid into the panel
// and multiplied into the f32 accumulator acc [Mp, cw]; then acc's valid part copied to y.
template <typename W>
void run_chunk(const uint16_t* xb, int64_t M, int64_t Mp, int64_t K, int64_t S, const Weight& wt,
               const Chunk& c, uint16_t* panel, float* acc) {
  const int64_t Kp = S * 32;
  const int64_t steps = std::max<int64_t>(1, kPanelBytes / (c.cw * 64));  // K steps per block
  for (int64_t s0 = 0; s0 < S; s0 += steps) {
    const int64_t sb = std::min(steps, S - s0);
    repack<W>(static_cast<const W*>(wt.w), K, wt.N, c.c0, c.cw, s0 * 32, sb, panel);
    for (int64_t m0 = 0; m0 < Mp; m0 += 32)
      for (int64_t t = 0; t < c.cw / 16; t += 2) {
        if (Mp - m0 >= 32)
          tile_block<2>(xb + s0 * 32, Kp, m0, panel, t, sb, acc, c.cw, s0 == 0);
        else
          tile_block<1>(xb + s0 * 32, Kp, m0, panel, t, sb, acc, c.cw, s0 == 0);
      }
  }
  const int64_t nv = std::min(c.cw, wt.N - c.c0);
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(wt.y + m * wt.N + c.c0, acc + m * c.cw, nv * sizeof(float));
}


struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// This thread's 64-byte aligned buffer `slot` (0: x, 1: the panel, 2: the accumulator) of at least `bytes`, kept
// across calls (a fresh allocation per call would page-fault its pages in every time).
uint16_t* scratch(int slot, int64_t bytes) {
  thread_local std::unique_ptr<uint16_t, FreeDeleter> buf[3];
  thread_local int64_t size[3] = {0, 0, 0};
  if (size[slot] < bytes) {
    const int64_t rounded = (bytes + 4095) / 4096 * 4096;
    buf[slot].reset(static_cast<uint16_t*>(std::aligned_alloc(64, rounded)));
    size[slot] = rounded;
  }
  return buf[slot].get();
}

// x [M, K] copied into this thread's zero-padded [Mp, Kp] buffer.
const uint16_t* padded_x(const uint16_t* x, int64_t M, int64_t K, int64_t Mp, int64_t Kp) {
  uint16_t* xb = scratch(0, Mp * Kp * 2);
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(xb + m * Kp, x + m * K, K * 2);
    std::memset(xb + m * Kp + K, 0, (Kp - K) * 2);
  }
  std::memset(xb + M * Kp, 0, (Mp - M) * Kp * 2);
  return xb;
}

template <typename W>
void amx_group(ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K,
               const std::vector<Weight>& ws) {
  if (M == 0) return;
  const int64_t S = (K + 31) / 32, Kp = S * 32, Mp = (M + 15) / 16 * 16;
  const uint16_t* xb = padded_x(x, M, K, Mp, Kp);
  // The group's columns (each weight's rounded up to 32) split evenly over the parts, each
  // part's share cut into chunks as wide as the panel allows, of near-equal widths.
  const bool whole_k = Mp >= kWholeKRows;
  const int64_t cw_max = whole_k ? std::max<int64_t>(32, std::min<int64_t>(
                                       kChunkColumns, kPanelBytes / (Kp * 2) / 32 * 32))
                                 : kChunkColumns;
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
    uint16_t* panel = scratch(1, std::max<int64_t>(kPanelBytes, 64 * (cw_max + 32)) +
                                 (whole_k ? 64 * Kp : 0));
    float* acc = reinterpret_cast<float*>(scratch(2, Mp * (cw_max + 32) * 4));
    configure_tiles();
    for (const Chunk& c : work[p]) {
      if (whole_k) run_chunk_whole_k<W>(xb, M, Mp, K, S, ws[c.g], c, panel);
      else run_chunk<W>(xb, M, Mp, K, S, ws[c.g], c, panel, acc);
    }
    _tile_release();
  });
}

// ---- [N, K] weights (a tied [V, D] embedding as the unembedding): y[M, N] = x . w^T ----------
// Computed transposed, C^T[n, m] = w[n, :] . x[m, :]: the weight's rows are the A tiles (a block
// of 32 rows, contiguous in memory, converted / copied into a zero-padded bf16 buffer), x^T is
// re-laid once per call as B tiles (pairs of K interleaved per row of x), and each 32 x 32 block
// of C^T is written to y transposed.

// x^T as B tiles: for row tile mt (16 rows of x) and K step s, tile (mt * S + s) holds in its
// row p the pairs (x[m, 32 s + 2 p], x[m, 32 s + 2 p + 1]) of its 16 rows m.
const uint16_t* x_as_b_tiles(const uint16_t* xb, int64_t Mp, int64_t S) {
  const int64_t Kp = S * 32;
  uint16_t* xt = scratch(1, Mp * Kp * 2);
  for (int64_t m = 0; m < Mp; ++m)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t p = 0; p < 16; ++p) {
        uint16_t* dst = xt + ((m / 16 * S + s) * 16 + p) * 32 + (m % 16) * 2;
        dst[0] = xb[m * Kp + s * 32 + 2 * p];
        dst[1] = xb[m * Kp + s * 32 + 2 * p + 1];
      }
  return xt;
}

template <typename W>
void amx_nk(ffi::ThreadPool& pool, const uint16_t* x, int64_t M, int64_t K, const W* w,
            int64_t N, float* y) {
  if (M == 0 || N == 0) return;
  const int64_t S = (K + 31) / 32, Kp = S * 32, Mp = (M + 31) / 32 * 32;
  const uint16_t* xt = x_as_b_tiles(padded_x(x, M, K, Mp, Kp), Mp, S);
  const int64_t blocks = (N + 31) / 32;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, blocks));
  run_parts(pool, parts, [&](int64_t p) {
    uint16_t* wb = scratch(2, 32 * Kp * 2);
    alignas(64) float cbuf[32 * 32];
    const __m512i stride32 = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(32));
    configure_tiles();
    for (int64_t nb = blocks * p / parts; nb < blocks * (p + 1) / parts; ++nb) {
      const int64_t n0 = nb * 32, nv = std::min<int64_t>(32, N - n0);
      for (int64_t r = 0; r < 32; ++r) {  // the block's weight rows as bf16, zero-padded
        const W* row = w + (n0 + r) * K;
        for (int64_t k = 0; k < Kp; k += 32) {
          const int64_t kv = std::min<int64_t>(32, std::max<int64_t>(0, K - k));
          const __mmask32 m = r < nv ? (kv >= 32 ? ~__mmask32(0) : ((__mmask32(1) << kv) - 1)) : 0;
          if (n0 + 32 + r < N && k < K)  // the same row of the next block
            _mm_prefetch(reinterpret_cast<const char*>(row + 32 * K + k), _MM_HINT_T1);
          _mm512_store_si512(wb + r * Kp + k, row32(row + k, m));
        }
      }
      for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t* b0 = xt + (m0 / 16) * S * 512;
        const uint16_t* b1 = b0 + S * 512;
        for (int64_t s = 0; s < S; ++s) {
          _tile_loadd(4, wb + s * 32, Kp * 2);
          _tile_loadd(5, wb + 16 * Kp + s * 32, Kp * 2);
          _tile_loadd(6, b0 + s * 512, 64);
          _tile_loadd(7, b1 + s * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, cbuf, 128);  // cbuf[n][m]: C^T for rows n0.., columns m0..
        _tile_stored(1, cbuf + 16, 128);
        _tile_stored(2, cbuf + 16 * 32, 128);
        _tile_stored(3, cbuf + 16 * 32 + 16, 128);
        const int64_t mv = std::min<int64_t>(32, M - m0);
        for (int64_t i = 0; i < mv; ++i)  // column i of cbuf is row m0 + i of y
          for (int64_t j = 0; j < nv; j += 16) {
            const __mmask16 mk = nv - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nv - j)) - 1);
            const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(int(j * 32 + i)), stride32);
            _mm512_mask_storeu_ps(y + (m0 + i) * N + n0 + j, mk,
                                  _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, idx, cbuf, 4));
          }
      }
    }
    _tile_release();
  });
}

ffi::Error AmxMatmulNKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> y) {
  constexpr const char* kWant =
      "phaseserve_amx_matmul_nk: want x [M, K] bf16, w [N, K] bf16 or int8, f32 result [M, N]";
  return nk_args(x, w, y, kWant, [&](auto... a) { amx_nk(pool, a...); });
}

// Operands: x [M, K] bf16, then G weights [K, N_g] of one dtype (bf16 or int8); results: G f32
// [M, N_g].
ffi::Error AmxMatmulGroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                              ffi::RemainingArgs args, ffi::RemainingRets rets) {
  constexpr const char* kWant =
      "phaseserve_amx_matmul_group: want x [M, K] bf16, G w [K, N] of one dtype (bf16 or int8), "
      "G f32 results [M, N]";
  return group_args(x, args, rets, kWant, [&](auto w, const uint16_t* xp, int64_t M, int64_t K,
                                               const std::vector<Weight>& ws) {
    amx_group<decltype(w)>(pool, xp, M, K, ws);
  });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveAmxTiledGroup, AmxTiledGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveAmxW8Group, AmxW8GroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveAmxMatmulNK, AmxMatmulNKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
