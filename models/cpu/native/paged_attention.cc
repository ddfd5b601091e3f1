// The native paged decode attention of models/cpu_paged_attention.py (see its docstring).
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxG = 16;

inline __m512 ld(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ld(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
inline __m512 ld(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x for x <= 0 (clamped at -87: e^-87 ~ 1.6e-38): 2^(x log2 e) = 2^n * 2^f, f in [-.5, .5].
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252734e-5f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-4f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline void prefetch(const char* p, bool l2) {
  if (l2) _mm_prefetch(p, _MM_HINT_T1);
  else _mm_prefetch(p, _MM_HINT_T0);
}

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// One page of the online softmax: sg[0, nz) <- exp(sg - m_new), zeros on [nz, span); updates the
// running max and sum; returns the factor the accumulators are to be scaled by.
inline float softmax_page(float* sg, int64_t nz, int64_t span, float& mrun, float& lrun) {
  __m512 mxv = _mm512_set1_ps(-INFINITY);
  for (int64_t z = 0; z < nz; z += 16)
    mxv = _mm512_max_ps(mxv, _mm512_mask_loadu_ps(mxv, lanes(nz - z), sg + z));
  const float mx = _mm512_reduce_max_ps(mxv);
  const float mnew = std::max(mrun, mx);
  const float corr = std::isinf(mrun) ? 0.f : std::exp(mrun - mnew);
  const __m512 mv = _mm512_set1_ps(mnew);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t z = 0; z < span; z += 16) {
    const __mmask16 mk = lanes(nz - z);
    const __m512 e = _mm512_maskz_mov_ps(
        mk, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + z), mv)));
    _mm512_mask_storeu_ps(sg + z, lanes(span - z), e);
    sum = _mm512_add_ps(sum, e);
  }
  lrun = lrun * corr + _mm512_reduce_add_ps(sum);
  mrun = mnew;
  return corr;
}

// acc[g] += sum_z p[g, z] v[z] (p[g, z] at s[g * ls + z]), 16 columns of H at a time, the G
// accumulators in registers.
template <typename T, int G>
inline void add_values(float* acc, const float* s, int64_t ls, const T* vp, int64_t nz,
                       int64_t H) {
  for (int64_t h = 0; h < H; h += 16) {
    __m512 a[G];
    for (int64_t g = 0; g < G; ++g) a[g] = ld(acc + g * H + h);
    for (int64_t z = 0; z < nz; ++z) {
      const __m512 vv = ld(vp + z * H + h);
      for (int64_t g = 0; g < G; ++g)
        a[g] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * ls + z]), vv, a[g]);
    }
    for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(acc + g * H + h, a[g]);
  }
}

inline void scale_row(float* x, float c, int64_t H) {
  const __m512 cv = _mm512_set1_ps(c);
  for (int64_t h = 0; h < H; h += 16) _mm512_storeu_ps(x + h, _mm512_mul_ps(ld(x + h), cv));
}

// o[g] = acc[g] / l[g].
template <int G>
inline void finish(float* o, const float* acc, const float* lrun, int64_t H) {
  for (int64_t g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / lrun[g]);
    for (int64_t h = 0; h < H; h += 16)
      _mm512_storeu_ps(o + g * H + h, _mm512_mul_ps(ld(acc + g * H + h), inv));
  }
}

// A unit of work of the block path (attention_blocks.h): rows [r0, r0 + n) of the call for kv
// head kh (n == 1: the row path's item r0 * K + kh).
struct Unit {
  int64_t r0, n, kh;
};

struct Job {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* table;
  const int32_t* pos;
  const float* ks;  // int8 pages: scales [L, P, K, Z] of K and V (else unused)
  const float* vs;
  float* out;
  int64_t B, N, K, G, H, Z, M, P, layer, max_keys;
  int64_t parts;
  bool dp;
  bool pf_l2;  // the next page's prefetch into L2 (else L1): chosen per machine at start-up
  std::vector<Unit> units;  // the block path's work (attention_blocks.h); empty: items
  std::atomic<int64_t> next{0};     // the next work item to hand out
  std::atomic<int64_t> started{0};  // helpers that began taking items
  std::atomic<int64_t> finished{0};  // helpers that stopped
};

// Work item ``it`` = (row b, kv head kh): its G query heads, output rows and visible keys. A
// row with no visible key gets zeros here (nkeys <= 0: nothing else to do).
struct Item {
  int64_t b, kh, nkeys;
  int64_t pages;       // pages holding the visible keys
  int64_t page_elems;  // elements of one pool page (K * Z * H)
  int64_t base;        // offset of this layer's page 0, this kv head, in the K and V pools
  int64_t sbase;       // the same in the scale pools (int8): page stride K * Z
  const int32_t* tab;  // the row's page table
  const float* q;
  float* o;
};

inline Item locate(const Job& j, int64_t it, int64_t G) {
  Item r;
  r.b = it / j.K;
  r.kh = it % j.K;
  r.q = j.q + (r.b * j.N + r.kh * G) * j.H;
  r.o = j.out + (r.b * j.N + r.kh * G) * j.H;
  r.nkeys = std::min<int64_t>(int64_t(j.pos[r.b]) + 1, j.max_keys);
  r.pages = (r.nkeys + j.Z - 1) / j.Z;
  r.page_elems = j.K * j.Z * j.H;
  r.base = j.layer * j.P * r.page_elems + r.kh * j.Z * j.H;
  r.sbase = j.layer * j.P * j.K * j.Z + r.kh * j.Z;
  r.tab = j.table + r.b * j.M;
  if (r.nkeys <= 0) std::memset(r.o, 0, sizeof(float) * G * j.H);
  return r;
}

template <typename T, int G>
void item(const Job& j, int64_t it, float* s, float* acc, const T* zeros) {
  const Item r = locate(j, it, G);
  if (r.nkeys <= 0) return;
  const int64_t kh = r.kh, H = j.H, Z = j.Z, nkeys = r.nkeys;
  const float* q = r.q;
  float* o = r.o;
  float mrun[G], lrun[G];
  for (int64_t g = 0; g < G; ++g) { mrun[g] = -INFINITY; lrun[g] = 0.f; }
  std::memset(acc, 0, sizeof(float) * G * H);
  const int64_t page_elems = r.page_elems, pages = r.pages;
  const T* kbase = static_cast<const T*>(j.k) + r.base;
  const T* vbase = static_cast<const T*>(j.v) + r.base;
  const int32_t* tab = r.tab;
  for (int64_t m = 0; m < pages; ++m) {
    const int64_t nz = std::min<int64_t>(Z, nkeys - m * Z);
    const int64_t p = tab[m];
    const bool real = p >= 0 && p < j.P;
    const T* kp = real ? kbase + p * page_elems : zeros;
    const T* vp = real ? vbase + p * page_elems : zeros;
    // logits s[g, z] = q[g] . k[z]
    for (int64_t z = 0; z < nz; ++z) {
      __m512 a[G];
      for (int64_t g = 0; g < G; ++g) a[g] = _mm512_setzero_ps();
      for (int64_t h = 0; h < H; h += 16) {
        const __m512 kv = ld(kp + z * H + h);
        for (int64_t g = 0; g < G; ++g) a[g] = _mm512_fmadd_ps(ld(q + g * H + h), kv, a[g]);
      }
      for (int64_t g = 0; g < G; ++g) s[g * Z + z] = _mm512_reduce_add_ps(a[g]);
    }
    // online softmax: s <- exp(s - m_new), rescale the running sum and accumulators
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * Z;
      const float corr = softmax_page(sg, nz, nz, mrun[g], lrun[g]);
      if (corr != 1.f) scale_row(acc + g * H, corr, H);
    }
    add_values<T, G>(acc, s, Z, vp, nz, H);
  }
  finish<G>(o, acc, lrun, H);
}

// r[i] = sum of the 16 lanes of v[i].
inline __m512 reduce16(__m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),
                                 _mm512_shuffle_ps(c[0], c[1], 0xDD));
  // d[4 j + t] = sum(v[4 t + j]) -> r[k] = d[4 (k % 4) + k / 4]
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, d);
}

// int8 pages: each page's K is widened once into ``kf`` (f32, its scale folded in, rows past the
// visible keys zero), then 16 keys' logits per transpose-reduce as item_bf16 does; the value
// product widens V in registers with each probability times the key's V scale.
template <int G>
void item_i8(const Job& j, int64_t it, float* s, float* acc, float* kf) {
  const Item r = locate(j, it, G);
  if (r.nkeys <= 0) return;
  const int64_t H = j.H, Z = j.Z, nkeys = r.nkeys;
  const int64_t Z16 = (Z + 15) / 16 * 16;
  const float* q = r.q;
  float* o = r.o;
  float mrun[G], lrun[G];
  for (int64_t g = 0; g < G; ++g) { mrun[g] = -INFINITY; lrun[g] = 0.f; }
  std::memset(acc, 0, sizeof(float) * G * H);
  const int8_t* kbase = static_cast<const int8_t*>(j.k) + r.base;
  const int8_t* vbase = static_cast<const int8_t*>(j.v) + r.base;
  for (int64_t m = 0; m < r.pages; ++m) {
    const int64_t nz = std::min<int64_t>(Z, nkeys - m * Z);
    const int64_t p = r.tab[m];
    if (p < 0 || p >= j.P) {  // the null page: keys and values are zeros
      for (int64_t z = 0; z < Z16; ++z) std::memset(kf + z * H, 0, sizeof(float) * H);
    } else {
      const int8_t* kp = kbase + p * r.page_elems;
      const float* ksp = j.ks + r.sbase + p * j.K * Z;
      for (int64_t z = 0; z < nz; ++z) {
        const __m512 sc = _mm512_set1_ps(ksp[z]);
        for (int64_t h = 0; h < H; h += 16)
          _mm512_storeu_ps(kf + z * H + h, _mm512_mul_ps(ld(kp + z * H + h), sc));
      }
      for (int64_t z = nz; z < Z16; ++z) std::memset(kf + z * H, 0, sizeof(float) * H);
    }
    for (int64_t z0 = 0; z0 < nz; z0 += 16) {
      for (int64_t g = 0; g < G; ++g) {
        __m512 a[16];
        for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
        for (int64_t h = 0; h < H; h += 16) {
          const __m512 qv = ld(q + g * H + h);
          for (int i = 0; i < 16; ++i)
            a[i] = _mm512_fmadd_ps(qv, ld(kf + (z0 + i) * H + h), a[i]);
        }
        _mm512_storeu_ps(s + g * Z16 + z0, reduce16(a));
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * Z16;
      const float corr = softmax_page(sg, nz, nz, mrun[g], lrun[g]);
      if (corr != 1.f) scale_row(acc + g * H, corr, H);
    }
    if (p < 0 || p >= j.P) continue;  // zero values add nothing
    const float* vsp = j.vs + r.sbase + p * j.K * Z;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t z = 0; z < nz; ++z) s[g * Z16 + z] *= vsp[z];
    add_values<int8_t, G>(acc, s, Z16, vbase + p * r.page_elems, nz, H);
  }
  finish<G>(o, acc, lrun, H);
}

// n int8 values (n % 32 == 0) to bf16, exactly.
inline void widen_bf16(const int8_t* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 32)
    _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(ld(src + i + 16), ld(src + i)));
}

inline uint16_t to_bf16(float x) {  // round to nearest even (x finite)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// bf16 pages with AVX-512 BF16 (Z % 16 == 0, H % 32 == 0): logits by vdpbf16ps over bf16 q
// (exact: q arrives rounded to bf16), 16 keys per transpose-reduce; the value product by
// vdpbf16ps over key pairs with the probabilities rounded to bf16 (as the gather path rounds
// them before its value product). The accumulators hold each 32-column block of H in the lane
// order of _mm512_unpack{lo,hi}_epi16 (undone at the end). int8 pages (T = int8_t) take the
// same loops: each page's K and V are widened to bf16 scratch (exact: |x| <= 127), the logits
// multiplied by the K scales and the probabilities by the V scales before their rounding.
template <typename T, int G>
void item_bf16(const Job& j, int64_t it, int64_t next_it, float* s, float* acc,
               const uint16_t* zeros, uint16_t* qb, uint32_t* pp, uint16_t* kw, uint16_t* vw) {
  constexpr bool kI8 = std::is_same_v<T, int8_t>;
  const Item r = locate(j, it, G);
  if (r.nkeys <= 0) return;
  const int64_t kh = r.kh, H = j.H, Z = j.Z, nkeys = r.nkeys;
  const float* q = r.q;
  float* o = r.o;
  // bf16 pools: q arrives rounded to bf16 (exact here); int8 pools: f32 q, rounded to nearest.
  for (int64_t i = 0; i < G * H; ++i) qb[i] = to_bf16(q[i]);
  float mrun[G], lrun[G];
  for (int64_t g = 0; g < G; ++g) { mrun[g] = -INFINITY; lrun[g] = 0.f; }
  std::memset(acc, 0, sizeof(float) * G * H);
  const int64_t page_elems = r.page_elems, pages = r.pages;
  const T* kbase = static_cast<const T*>(j.k) + r.base;
  const T* vbase = static_cast<const T*>(j.v) + r.base;
  const int32_t* tab = r.tab;
  const int64_t Z2 = Z / 2;
  for (int64_t m = 0; m < pages; ++m) {
    const int64_t nz = std::min<int64_t>(Z, nkeys - m * Z);
    const int64_t p = tab[m];
    const bool real = p >= 0 && p < j.P;
    const uint16_t* kp = zeros;
    const uint16_t* vp = zeros;
    const float* ksp = nullptr;
    const float* vsp = nullptr;
    if constexpr (kI8) {
      if (real) {
        widen_bf16(kbase + p * page_elems, kw, Z * H);
        widen_bf16(vbase + p * page_elems, vw, Z * H);
        kp = kw, vp = vw;
        ksp = j.ks + r.sbase + p * j.K * Z;
        vsp = j.vs + r.sbase + p * j.K * Z;
      }
    } else if (real) {
      kp = kbase + p * page_elems;
      vp = vbase + p * page_elems;
    }
    // prefetch the next page: this row's, or the first of the next item (kh of the next item)
    int64_t pn = -1, kn = kh, pkeys = 0;  // its page, kv head and visible keys
    if (m + 1 < pages) {
      pn = tab[m + 1];
      pkeys = std::min<int64_t>(Z, nkeys - (m + 1) * Z);
    } else if (next_it < j.B * j.K) {
      const int64_t nb = next_it / j.K;
      pn = j.table[nb * j.M];
      kn = next_it % j.K;
      pkeys = std::min<int64_t>({Z, int64_t(j.pos[nb]) + 1, j.max_keys});
    }
    const bool pf = pn >= 0 && pn < j.P && pkeys > 0;
    // Its visible keys' K lines, spread over this page's groups of 16 keys, and its V lines over
    // this page's value iterations (a short last page must still fetch the whole of the next
    // item's first page), into L2 where the start-up race chose it (Zen 4: 1.4-1.7x faster
    // than L1; a page's K and V fill half of its L1); a burst of the whole page's misses
    // stalled the loop it sat in.
    const int64_t pf_bytes = pkeys * H * int64_t(sizeof(T));
    const int64_t groups = (nz + 15) / 16;
    const int64_t pf_step = (pf_bytes / 64 + groups - 1) / groups * 64;
    const int64_t pf_off = pf ? (kn - kh) * Z * H + pn * page_elems : 0;
    const char* nk = reinterpret_cast<const char*>(kbase + pf_off);
    const char* nv = reinterpret_cast<const char*>(vbase + pf_off);
    for (int64_t z0 = 0; z0 < nz; z0 += 16) {
      if (pf) {
        const int64_t c0 = (z0 / 16) * pf_step;
        for (int64_t c = c0; c < std::min(pf_bytes, c0 + pf_step); c += 64)
          prefetch(nk + c, j.pf_l2);
      }
      for (int64_t g = 0; g < G; ++g) {
        __m512 a[16];
        for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
        for (int64_t h = 0; h < H; h += 32) {
          const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + g * H + h);
          for (int i = 0; i < 16; ++i)
            a[i] = _mm512_dpbf16_ps(a[i], qv,
                                    (__m512bh)_mm512_loadu_si512(kp + (z0 + i) * H + h));
        }
        __m512 lg = reduce16(a);
        if (kI8 && ksp) lg = _mm512_mul_ps(lg, _mm512_loadu_ps(ksp + z0));
        _mm512_storeu_ps(s + g * Z + z0, lg);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * Z;
      const float corr = softmax_page(sg, nz, Z, mrun[g], lrun[g]);  // zeros past nz
      if (kI8 && vsp)  // the sum above is of the probabilities; the values get the V scales
        for (int64_t z = 0; z < Z; z += 16)
          _mm512_storeu_ps(sg + z, _mm512_mul_ps(_mm512_loadu_ps(sg + z),
                                                 _mm512_loadu_ps(vsp + z)));
      // The pairs (p[2 i], p[2 i + 1]) are the probabilities as a bf16 array: 32 at a time by
      // vcvtne2ps2bf16 (round to nearest even, as to_bf16; the probabilities are normal or 0).
      uint16_t* pb16 = reinterpret_cast<uint16_t*>(pp + g * Z2);
      int64_t z = 0;
      for (; z + 32 <= Z; z += 32)
        _mm512_storeu_si512(pb16 + z, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sg + z + 16),
                                                                    _mm512_loadu_ps(sg + z)));
      for (; z < Z; ++z) pb16[z] = to_bf16(sg[z]);
      if (corr != 1.f) scale_row(acc + g * H, corr, H);
    }
    const int64_t npair = (nz + 1) / 2;  // an odd tail pairs with a zero probability
    const bool odd = nz & 1;
    // The next page's V lines, spread over this page's value iterations.
    const int64_t v_iters = npair * (H / 32);
    const int64_t v_step = pf ? (pf_bytes / 64 + v_iters - 1) / v_iters * 64 : 0;
    int64_t v_next = 0;
    for (int64_t h = 0; h < H; h += 32) {
      __m512 lo[G], hi[G];
      for (int64_t g = 0; g < G; ++g) {
        lo[g] = _mm512_loadu_ps(acc + g * H + h);
        hi[g] = _mm512_loadu_ps(acc + g * H + h + 16);
      }
      for (int64_t z2 = 0; z2 < npair; ++z2) {
        for (int64_t c = v_next; c < std::min(pf_bytes, v_next + v_step); c += 64)
          prefetch(nv + c, j.pf_l2);
        v_next += v_step;
        const __m512i v0 = _mm512_loadu_si512(vp + (2 * z2) * H + h);
        // the row after an odd tail may be unwritten (any bits): use zeros, never 0 * NaN
        const __m512i v1 = (odd && z2 == npair - 1) ? _mm512_setzero_si512()
                                                     : _mm512_loadu_si512(vp + (2 * z2 + 1) * H + h);
        const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
        const __m512bh vh = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
        for (int64_t g = 0; g < G; ++g) {
          const __m512bh pb = (__m512bh)_mm512_set1_epi32(int(pp[g * Z2 + z2]));
          lo[g] = _mm512_dpbf16_ps(lo[g], pb, vl);
          hi[g] = _mm512_dpbf16_ps(hi[g], pb, vh);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        _mm512_storeu_ps(acc + g * H + h, lo[g]);
        _mm512_storeu_ps(acc + g * H + h + 16, hi[g]);
      }
    }
  }
  // lane l of lo (hi) in 128-bit lane c, element e < 4 holds column 8 c + e (+ 4)
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / lrun[g];
    for (int64_t h = 0; h < H; h += 32)
      for (int l = 0; l < 32; ++l) {
        const int half = l / 16, c = (l % 16) / 4, e = l % 4;
        o[g * H + h + 8 * c + e + 4 * half] = acc[g * H + h + l] * inv;
      }
  }
}

#include "amx_tile_config.h"
#include "attention_blocks.h"

// The block path's units (bf16 pages, bf16 dot products, AMX): blocks on tiles, single rows as
// items of the row path.
template <int G>
void run_units(const std::shared_ptr<Job>& jp, float* s, float* acc, const uint16_t* zeros) {
  const Job& j = *jp;
  const std::vector<Unit>& units = j.units;
  const int64_t nu = int64_t(units.size());
  std::vector<uint16_t> qb(G * j.H);
  std::vector<uint32_t> pp(G * j.Z / 2);
  std::unique_ptr<BlockScratch> bs;
  auto item_of = [&](int64_t k) { return units[k].r0 * j.K + units[k].kh; };
  for (int64_t it = jp->next.fetch_add(1); it < nu;) {
    const int64_t nxt = jp->next.fetch_add(1);
    const Unit& u = units[it];
    if (u.n == 1) {
      const int64_t next_item = nxt < nu && units[nxt].n == 1 ? item_of(nxt) : j.B * j.K;
      item_bf16<uint16_t, G>(j, item_of(it), next_item, s, acc, zeros, qb.data(), pp.data(),
                             nullptr, nullptr);
    } else {
      if (!bs) {
        bs = std::make_unique<BlockScratch>(G, j.H, j.Z);
        configure_tiles();
      }
      block_item<G>(j, u, *bs, zeros);
    }
    it = nxt;
  }
  if (bs) _tile_release();
}

template <typename T, int G>
void run_items(const std::shared_ptr<Job>& jp) {
  const Job& j = *jp;
  std::vector<float> s(G * j.Z), acc(G * j.H);
  const int64_t items = j.B * j.K;
  if constexpr (std::is_same_v<T, int8_t>) {
    if (j.dp) {
      std::vector<uint16_t> qb(G * j.H), kw(j.Z * j.H), vw(j.Z * j.H), zb(j.Z * j.H, 0);
      std::vector<uint32_t> pp(G * j.Z / 2);
      int64_t it = jp->next.fetch_add(1);
      while (it < items) {
        const int64_t nxt = jp->next.fetch_add(1);
        item_bf16<int8_t, G>(j, it, nxt, s.data(), acc.data(), zb.data(), qb.data(), pp.data(),
                             kw.data(), vw.data());
        it = nxt;
      }
      return;
    }
    const int64_t z16 = (j.Z + 15) / 16 * 16;
    std::vector<float> s8(G * z16), kf(z16 * j.H);
    for (int64_t it = jp->next.fetch_add(1); it < items; it = jp->next.fetch_add(1))
      item_i8<G>(j, it, s8.data(), acc.data(), kf.data());
    return;
  }
  std::vector<T> zeros(j.Z * j.H, T(0));
  if constexpr (sizeof(T) == 2) {
    if (j.dp && !j.units.empty()) {
      run_units<G>(jp, s.data(), acc.data(), zeros.data());
      return;
    }
    if (j.dp) {
      std::vector<uint16_t> qb(G * j.H);
      std::vector<uint32_t> pp(G * j.Z / 2);
      int64_t it = jp->next.fetch_add(1);
      while (it < items) {
        const int64_t nxt = jp->next.fetch_add(1);  // known early: its first page is prefetched
        item_bf16<uint16_t, G>(j, it, nxt, s.data(), acc.data(), zeros.data(), qb.data(),
                               pp.data(), nullptr, nullptr);
        it = nxt;
      }
      return;
    }
  }
  for (int64_t it = jp->next.fetch_add(1); it < items; it = jp->next.fetch_add(1))
    item<T, G>(j, it, s.data(), acc.data(), zeros.data());
}

template <typename T>
void work(const std::shared_ptr<Job>& jp) {
  switch (jp->G) {
#define PS_CASE(g) case g: run_items<T, g>(jp); break;
    PS_CASE(1) PS_CASE(2) PS_CASE(3) PS_CASE(4) PS_CASE(5) PS_CASE(6) PS_CASE(7) PS_CASE(8)
    PS_CASE(9) PS_CASE(10) PS_CASE(11) PS_CASE(12) PS_CASE(13) PS_CASE(14) PS_CASE(15)
    PS_CASE(16)
#undef PS_CASE
    default: break;
  }
}

// A helper may start late or never (the pool's threads may all be busy, e.g. running the other
// fake devices' calls): the caller takes items until none is left, then waits only for the
// helpers that took one. A helper starting after that finds no item and touches no buffer.
template <typename T>
void helper(const std::shared_ptr<Job>& jp) {
  jp->started.fetch_add(1);
  work<T>(jp);
  jp->finished.fetch_add(1);
}

ffi::Error PagedDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                    ffi::AnyBuffer k, ffi::AnyBuffer v,
                                    ffi::Buffer<ffi::F32> kscale, ffi::Buffer<ffi::F32> vscale,
                                    ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> pos,
                                    ffi::Buffer<ffi::S32> layer_buf,
                                    ffi::ResultBuffer<ffi::F32> out, int64_t max_keys,
                                    int32_t bf16_dot, int32_t prefetch_l2, int32_t amx_blocks) {
  const int64_t layer = layer_buf.element_count() == 1 ? int64_t(*layer_buf.typed_data()) : -1;
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || td[0] != qd[0] ||
      pos.dimensions().size() != 1 || pos.dimensions()[0] != qd[0] || kd[4] != qd[2] ||
      qd[1] % kd[2] != 0 || qd[1] / kd[2] > kMaxG || qd[2] % 16 != 0 ||
      k.element_type() != v.element_type() || layer < 0 || layer >= kd[0])
    return ffi::Error::InvalidArgument(
        "phaseserve_paged_decode_attention: want q [B, N, H], pages [L, P, K, Z, H] "
        "(H % 16 == 0, N / K <= 16), table [B, M], pos [B], 0 <= layer < L");
  auto job = std::make_shared<Job>();
  Job& j = *job;
  j.q = q.typed_data(); j.k = k.untyped_data(); j.v = v.untyped_data();
  j.table = table.typed_data(); j.pos = pos.typed_data(); j.out = out->typed_data();
  j.ks = kscale.typed_data(); j.vs = vscale.typed_data();
  j.B = qd[0]; j.N = qd[1]; j.H = qd[2]; j.P = kd[1]; j.K = kd[2]; j.Z = kd[3];
  j.G = j.N / j.K; j.M = td[1]; j.layer = layer;
  j.max_keys = std::min<int64_t>(max_keys, j.M * j.Z);
  if (j.B == 0) return ffi::Error::Success();
  const auto et = k.element_type();
  const bool bf16 = et == ffi::BF16;
  j.dp = (bf16 || et == ffi::S8) && bf16_dot && j.Z % 16 == 0 && j.H % 32 == 0;
  j.pf_l2 = prefetch_l2 != 0;
  if (amx_blocks && bf16 && j.dp && j.H % 32 == 0 && j.Z % 32 == 0) {
    j.units = plan_units(j.pos, j.table, j.B, j.M, j.K);
    if (int64_t(j.units.size()) == j.B * j.K) j.units.clear();  // no block: the items
  }
  if (!bf16 && et != ffi::F32 && et != ffi::S8)
    return ffi::Error::InvalidArgument(
        "phaseserve_paged_decode_attention: pages f32, bf16 or s8");
  if (et == ffi::S8 && (kscale.element_count() != kd[0] * kd[1] * kd[2] * kd[3] ||
                        vscale.element_count() != kscale.element_count()))
    return ffi::Error::InvalidArgument(
        "phaseserve_paged_decode_attention: s8 pages need scales [L, P, K, Z, 1]");
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t n_work = j.units.empty() ? j.B * j.K : int64_t(j.units.size());
  j.parts = std::max<int64_t>(1, std::min<int64_t>(threads, n_work));
  // Interim: one part, the calling thread doing every item. With a pool helper, under CPU
  // preemption an item sometimes came out wrong (BUILD_NOTES "Speculative decoding", "Open
  // fault": 7 of 14 loaded runs of the spec tests failed with helpers, 0 of 10 without); the
  // helper path stays for the hunt.
  j.parts = 1;
  auto run = [et](const std::shared_ptr<Job>& jp, bool as_helper) {
    if (et == ffi::BF16) as_helper ? helper<uint16_t>(jp) : work<uint16_t>(jp);
    else if (et == ffi::S8) as_helper ? helper<int8_t>(jp) : work<int8_t>(jp);
    else as_helper ? helper<float>(jp) : work<float>(jp);
  };
  for (int64_t i = 0; i + 1 < j.parts; ++i) pool.Schedule([job, run] { run(job, true); });
  run(job, false);
  while (job->started.load() != job->finished.load()) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

// The block path's plan (plan_units, one kv head) for pos [B] and table [B, M]: n_out[r] is the
// rows of the unit that starts at row r (1: a single row), 0 inside a block. For tests.
extern "C" void phaseserve_attention_blocks(const int32_t* pos, const int32_t* table, int64_t B,
                                            int64_t M, int64_t* n_out) {
  std::fill(n_out, n_out + B, 0);
  for (const Unit& u : plan_units(pos, table, B, M, 1)) n_out[u.r0] = u.n;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseservePagedDecodeAttention, PagedDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("max_keys")
                                  .Attr<int32_t>("bf16_dot")
                                  .Attr<int32_t>("prefetch_l2")
                                  .Attr<int32_t>("amx_blocks"));
