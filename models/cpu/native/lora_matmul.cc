// Multi-LoRA terms for few rows (decode): each row's own adapter only (punica's SGMV on a CPU).
// y_g[m, :] = (x[m, :] @ a_g[l, :, s E:(s + 1) E]) @ b_g[l, s E:(s + 1) E, :] for s = slot[m]
// in [0, A) (other slots: a zero row), for G (a_g [L, I, A E], b_g [L, A E, O_g]) pairs sharing
// x [M, I], at layer l = layer[0]: the stacked weights are read in place (a slice passed to a
// custom call would be a copy of it every call).
// x and the weights are both bf16 or both f32; products and sums in f32; E % 16 == 0.
// Rows of one slot go through together, 8 at a time: their x rows are widened to f32 once,
// each weight vector is read and widened once per block, then one FMA per row with the row's
// scalar broadcast from memory (the rows' u and y live in registers / L1). The (slot, block,
// pair) parts run on XLA's intra-op pool: each writes its own rows of its own output.
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <cstring>
#include <vector>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#include "run_parts.h"

constexpr int kRows = 8;  // rows per block

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  uint32_t u = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Pair {
  const void* a;
  const void* b;
  int64_t O;
  float* y;
};

// x rows `rows[0..R)` as f32 into xf [R, I].
template <typename T>
void widen(const T* x, int64_t I, const int64_t* rows, int R, float* xf) {
  for (int r = 0; r < R; ++r) {
    const T* xr = x + rows[r] * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) _mm512_storeu_ps(xf + r * I + i, load16(xr + i));
    for (; i < I; ++i) xf[r * I + i] = load1(xr + i);
  }
}

// One block of `R` rows (x widened: xf [R, I]; output rows `rows`) of slot `s` through one
// (a, b) pair.
template <typename T>
void block(const float* xf, int64_t I, const int64_t* rows, int R, int64_t s, int64_t A,
           int64_t E, const Pair& p, float* u /* [kRows, E] */) {
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  const int64_t AE = A * E, O = p.O;
  for (int64_t e0 = 0; e0 < E; e0 += 16) {  // shrink: u[r, e] = x[r, :] . a[:, s E + e]
    __m512 acc[kRows];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const T* ai = a + s * E + e0;
    for (int64_t i = 0; i < I; ++i, ai += AE) {
      const __m512 av = load16(ai);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xf[r * I + i]), av, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(u + r * E + e0, acc[r]);
  }
  const T* bs = b + s * E * O;
  int64_t o = 0;
  for (; o + 16 <= O; o += 16) {  // expand: y[r, o] = u[r, :] . b[s E:, o]
    __m512 acc[kRows];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t e = 0; e < E; ++e) {
      const __m512 bv = load16(bs + e * O + o);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(u[r * E + e]), bv, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.y + rows[r] * O + o, acc[r]);
  }
  for (; o < O; ++o)  // a tail of fewer than 16 columns
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t e = 0; e < E; ++e) acc += u[r * E + e] * load1(bs + e * O + o);
      p.y[rows[r] * O + o] = acc;
    }
}

template <typename T>
void run(ffi::ThreadPool& pool, const T* x, const int32_t* slot, int64_t M, int64_t I,
         int64_t A, int64_t E, const std::vector<Pair>& ps) {
  std::vector<std::vector<int64_t>> by_slot(A);
  for (int64_t m = 0; m < M; ++m) {
    if (slot[m] >= 0 && slot[m] < A) {
      by_slot[slot[m]].push_back(m);
    } else {
      for (const Pair& p : ps) std::memset(p.y + m * p.O, 0, sizeof(float) * p.O);
    }
  }
  struct Part { int64_t s; size_t r0; int R; const Pair* p; };
  std::vector<Part> parts;
  for (int64_t s = 0; s < A; ++s)
    for (size_t r0 = 0; r0 < by_slot[s].size(); r0 += kRows)
      for (const Pair& p : ps)
        parts.push_back({s, r0, int(std::min<size_t>(kRows, by_slot[s].size() - r0)), &p});
  if (parts.empty()) return;
  run_parts(pool, int64_t(parts.size()), [&](int64_t i) {
    const Part& q = parts[i];
    std::vector<float> u(kRows * E), xf(kRows * I);
    const int64_t* rows = by_slot[q.s].data() + q.r0;
    widen(x, I, rows, q.R, xf.data());
    block<T>(xf.data(), I, rows, q.R, q.s, A, E, *q.p, u.data());
  });
}

ffi::Error LoraGroupImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> slot,
                         ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, int64_t slots) {
  const char* want =
      "lora_group wants x [M, I] bf16|f32, slot [M] s32, layer [1] s32, then (a [L, I, A E], "
      "b [L, A E, O]) pairs of x's dtype with E % 16 == 0 and 0 <= layer < L, and f32 [M, O] "
      "results";
  auto xd = x.dimensions();
  const size_t G = rets.size();
  if (xd.size() != 2 || G == 0 || args.size() != 2 * G || slots < 1 ||
      slot.element_count() != xd[0] || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(want);
  const int64_t l = layer.typed_data()[0];
  const int64_t M = xd[0], I = xd[1];
  const ffi::DataType type = x.element_type();
  if (type != ffi::BF16 && type != ffi::F32) return ffi::Error::InvalidArgument(want);
  std::vector<Pair> ps;
  int64_t E = 0;
  for (size_t g = 0; g < G; ++g) {
    auto a = args.get<ffi::AnyBuffer>(2 * g);
    auto b = args.get<ffi::AnyBuffer>(2 * g + 1);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(g);
    if (!a.has_value() || !b.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(want);
    auto ad = a->dimensions(), bd = b->dimensions();
    if (ad.size() != 3 || bd.size() != 3 || ad[0] != bd[0] || l < 0 || l >= ad[0] ||
        ad[1] != I || ad[2] % slots || bd[1] != ad[2] || a->element_type() != type ||
        b->element_type() != type || (*y)->element_count() != M * bd[2])
      return ffi::Error::InvalidArgument(want);
    const int64_t e = ad[2] / slots;
    if (e % 16 || (g && e != E)) return ffi::Error::InvalidArgument(want);
    E = e;
    const int64_t size = type == ffi::BF16 ? 2 : 4;
    ps.push_back({static_cast<const char*>(a->untyped_data()) + l * ad[1] * ad[2] * size,
                  static_cast<const char*>(b->untyped_data()) + l * bd[1] * bd[2] * size,
                  bd[2], (*y)->typed_data()});
  }
  const int32_t* s = slot.typed_data();
  if (type == ffi::BF16)
    run(pool, reinterpret_cast<const uint16_t*>(x.untyped_data()), s, M, I, slots, E, ps);
  else
    run(pool, reinterpret_cast<const float*>(x.untyped_data()), s, M, I, slots, E, ps);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PhaseserveLoraGroup, LoraGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("slots"));
