// Query blocks on AMX for paged_attention.cc (inlined by models.cpu.build.source; needs its Job,
// lanes, exp_ps and to_bf16).
//
// A prefill chunk reaches the kernel as one row per token: consecutive rows with one page table
// and consecutive positions. Up to 16 such rows form a block; for each kv head the block reads
// each page once and runs its G query heads over it as AMX tile products:
//   S[i, z] = q_g[i] . k[z]    A = the rows' q_g (bf16, 16 x 32 a tile), B = the page's keys
//                              transposed into pairs of head dims (a 16 x 16 dword transpose)
//   O[i, :] += P[i, z] v[z]    A = the rows' probabilities (bf16), B = pairs of value rows
//                              interleaved (vpermt2w)
// with the online softmax of each row between the two on AVX-512 (row i sees keys
// s < nkeys(i): causal within the block). Numerics as the row path's bf16 dot products: q and
// the probabilities rounded to bf16, f32 products and sums. Keys past the block's last visible
// key are read as zeros (a reused page's stale NaN never meets a zero probability).
// Tiles (amx_tile_config.h): tmm0 S, tmm1 O, tmm4 / tmm5 A, tmm6 / tmm7 B.

constexpr int64_t kMinBlockRows = 4;  // fewer rows take the row path

// The call's units in row order, for K kv heads: blocks of up to 16 rows (one table,
// consecutive positions >= 0; at least kMinBlockRows), single rows elsewhere.
inline std::vector<Unit> plan_units(const int32_t* pos, const int32_t* table, int64_t B,
                                    int64_t M, int64_t K) {
  std::vector<Unit> u;
  u.reserve(B * K);
  for (int64_t r = 0; r < B;) {
    int64_t n = 1;
    if (pos[r] >= 0)
      while (n < 16 && r + n < B && pos[r + n] == pos[r] + n &&
             std::memcmp(table + (r + n) * M, table + r * M, M * sizeof(int32_t)) == 0)
        ++n;
    if (n < kMinBlockRows) n = 1;
    for (int64_t kh = 0; kh < K; ++kh) u.push_back({r, n, kh});
    r += n;
  }
  return u;
}

// rows[c] (c < 16) -> rows[t] = column t: a 16 x 16 transpose of 32-bit elements.
inline void transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  // b[4 i + k], 128-bit lane L: column 4 L + k of rows 4 i .. 4 i + 3
  for (int k = 0; k < 4; ++k) {
    const __m512i c0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x44);
    const __m512i c1 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xEE);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x44);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
  }
}

// One thread's buffers for blocks of G heads (64-byte aligned).
struct BlockScratch {
  std::vector<uint16_t, std::allocator<uint16_t>> raw;
  uint16_t* kt;   // [Z / 16][H / 32] B tiles of the page's keys
  uint16_t* vt;   // [Z / 32][H / 16] B tiles of the page's values
  uint16_t* qb;   // [G][16][H] the rows' queries, bf16
  uint16_t* pb;   // [16][Z] probabilities, bf16
  float* sb;      // [16][Z] logits
  float* oacc;    // [G][16][H] unnormalized outputs
  BlockScratch(int64_t G, int64_t H, int64_t Z) {
    const int64_t kt_n = Z * H, vt_n = Z * H, qb_n = G * 16 * H, pb_n = 16 * Z;
    const int64_t sb_n = 2 * 16 * Z, oa_n = 2 * G * 16 * H;  // floats as pairs of uint16
    raw.assign(kt_n + vt_n + qb_n + pb_n + sb_n + oa_n + 6 * 32, 0);
    auto align = [](uint16_t* p) {
      return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
    };
    kt = align(raw.data());
    vt = align(kt + kt_n);
    qb = align(vt + vt_n);
    pb = align(qb + qb_n);
    sb = reinterpret_cast<float*>(align(pb + pb_n));
    oacc = reinterpret_cast<float*>(align(reinterpret_cast<uint16_t*>(sb) + sb_n));
  }
};

// The page's keys as B tiles of S = q . k^T (tile (zb, hb), row t: the pair of head dims
// (32 hb + 2 t, + 1) of keys 16 zb .. + 15) and its values as B tiles of O = P . v (tile
// (zp, ht), row t: the pair of keys (32 zp + 2 t, + 1) of head dims 16 ht .. + 15); keys at or
// past `nz` are zeros.
inline void page_tiles(const uint16_t* kp, const uint16_t* vp, int64_t nz, int64_t Z, int64_t H,
                       uint16_t* kt, uint16_t* vt) {
  const int64_t HB = H / 32, HT = H / 16;
  for (int64_t zb = 0; zb < Z / 16; ++zb)
    for (int64_t hb = 0; hb < HB; ++hb) {
      __m512i r[16];
      for (int c = 0; c < 16; ++c) {
        const int64_t z = zb * 16 + c;
        r[c] = _mm512_maskz_loadu_epi32(z < nz ? __mmask16(0xFFFF) : __mmask16(0),
                                        kp + z * H + hb * 32);
      }
      transpose16(r);
      uint16_t* dst = kt + (zb * HB + hb) * 512;
      for (int t = 0; t < 16; ++t) _mm512_store_si512(dst + t * 32, r[t]);
    }
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                                  6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                                  12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
                                                  22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59,
                                                  28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t zp = 0; zp < Z / 32; ++zp)
    for (int64_t t = 0; t < 16; ++t) {
      const int64_t z = zp * 32 + 2 * t;
      const __mmask32 m0 = z < nz ? ~__mmask32(0) : 0, m1 = z + 1 < nz ? ~__mmask32(0) : 0;
      for (int64_t hh = 0; hh < H / 32; ++hh) {
        const __m512i a = _mm512_maskz_loadu_epi16(m0, vp + z * H + hh * 32);
        const __m512i b = _mm512_maskz_loadu_epi16(m1, vp + (z + 1) * H + hh * 32);
        _mm512_store_si512(vt + ((zp * HT + 2 * hh) * 16 + t) * 32,
                           _mm512_permutex2var_epi16(a, lo, b));
        _mm512_store_si512(vt + ((zp * HT + 2 * hh + 1) * 16 + t) * 32,
                           _mm512_permutex2var_epi16(a, hi, b));
      }
    }
}

// Rows [u.r0, u.r0 + u.n) x kv head u.kh as one block (tiles configured by the caller).
template <int G>
void block_item(const Job& j, const Unit& u, BlockScratch& w, const uint16_t* zeros) {
  const int64_t H = j.H, Z = j.Z, n = u.n, kh = u.kh, r0 = u.r0;
  int64_t nk[16];
  int64_t nmax = 0;
  for (int64_t i = 0; i < 16; ++i) {
    nk[i] = i < n ? std::max<int64_t>(0, std::min<int64_t>(int64_t(j.pos[r0 + i]) + 1,
                                                           j.max_keys))
                  : 0;
    nmax = std::max(nmax, nk[i]);
  }
  auto out_row = [&](int64_t i, int64_t g) { return j.out + ((r0 + i) * j.N + kh * G + g) * H; };
  if (nmax == 0) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < G; ++g) std::memset(out_row(i, g), 0, sizeof(float) * H);
    return;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < 16; ++i) {
      uint16_t* dst = w.qb + (g * 16 + i) * H;
      if (i >= n) {
        std::memset(dst, 0, 2 * H);
        continue;
      }
      const float* src = j.q + ((r0 + i) * j.N + kh * G + g) * H;
      for (int64_t h = 0; h < H; h += 32)
        _mm512_store_si512(dst + h, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + h + 16),
                                                                  _mm512_loadu_ps(src + h)));
    }
  float mrun[G][16], lrun[G][16];
  for (int64_t g = 0; g < G; ++g)
    for (int i = 0; i < 16; ++i) mrun[g][i] = -INFINITY, lrun[g][i] = 0.f;
  std::memset(w.oacc, 0, sizeof(float) * G * 16 * H);
  std::memset(w.pb, 0, 2 * 16 * Z);  // rows past n stay zero
  const int64_t page_elems = j.K * Z * H;
  const uint16_t* kbase = static_cast<const uint16_t*>(j.k) + j.layer * j.P * page_elems + kh * Z * H;
  const uint16_t* vbase = static_cast<const uint16_t*>(j.v) + j.layer * j.P * page_elems + kh * Z * H;
  const int32_t* tab = j.table + r0 * j.M;
  const int64_t pages = (nmax + Z - 1) / Z, HB = H / 32, HT = H / 16;
  for (int64_t pg = 0; pg < pages; ++pg) {
    const int64_t p = tab[pg], z0 = pg * Z;
    const bool real = p >= 0 && p < j.P;
    const int64_t nz = std::min<int64_t>(Z, nmax - z0);
    page_tiles(real ? kbase + p * page_elems : zeros, real ? vbase + p * page_elems : zeros, nz,
               Z, H, w.kt, w.vt);
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* qg = w.qb + g * 16 * H;
      for (int64_t zb = 0; zb < Z / 16; ++zb) {
        _tile_zero(0);
        for (int64_t hb = 0; hb < HB; ++hb) {
          _tile_loadd(4, qg + hb * 32, H * 2);
          _tile_loadd(6, w.kt + (zb * HB + hb) * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, w.sb + zb * 16, Z * 4);
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t kv = std::min<int64_t>(Z, std::max<int64_t>(0, nk[i] - z0));
        float* si = w.sb + i * Z;
        uint16_t* pi = w.pb + i * Z;
        if (kv == 0) {
          std::memset(pi, 0, 2 * Z);
          continue;
        }
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t z = 0; z < kv; z += 16)
          mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, lanes(kv - z), si + z));
        const float m_old = mrun[g][i];
        const float m_new = std::max(m_old, _mm512_reduce_max_ps(mx));
        const float corr = std::isinf(m_old) ? 0.f : std::exp(m_old - m_new);
        const __m512 mv = _mm512_set1_ps(m_new);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t z = 0; z < Z; z += 32) {
          const __mmask16 k0 = lanes(kv - z), k1 = lanes(kv - z - 16);
          const __m512 e0 = _mm512_maskz_mov_ps(
              k0, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k0, si + z), mv)));
          const __m512 e1 = _mm512_maskz_mov_ps(
              k1, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k1, si + z + 16), mv)));
          sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
          _mm512_storeu_si512(pi + z, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        lrun[g][i] = lrun[g][i] * corr + _mm512_reduce_add_ps(sum);
        mrun[g][i] = m_new;
        if (corr != 1.f) {
          float* oi = w.oacc + (g * 16 + i) * H;
          const __m512 cv = _mm512_set1_ps(corr);
          for (int64_t h = 0; h < H; h += 16)
            _mm512_storeu_ps(oi + h, _mm512_mul_ps(_mm512_loadu_ps(oi + h), cv));
        }
      }
      float* og = w.oacc + g * 16 * H;
      for (int64_t ht = 0; ht < HT; ++ht) {
        _tile_loadd(1, og + ht * 16, H * 4);
        for (int64_t zp = 0; zp < Z / 32; ++zp) {
          _tile_loadd(5, w.pb + zp * 32, Z * 2);
          _tile_loadd(7, w.vt + (zp * HT + ht) * 512, 64);
          _tile_dpbf16ps(1, 5, 7);
        }
        _tile_stored(1, og + ht * 16, H * 4);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i) {
      float* o = out_row(i, g);
      const float l = lrun[g][i];
      const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
      const float* a = w.oacc + (g * 16 + i) * H;
      for (int64_t h = 0; h < H; h += 16)
        _mm512_storeu_ps(o + h, _mm512_mul_ps(_mm512_loadu_ps(a + h), inv));
    }
}
