// Shared by the bf16-activation kernels (amx_matmul.cc, dpbf16_matmul.cc); inlined into
// each source by models.cpu.build.source, so each library's cache key covers it.
// A group call's operands: x [M, K] bf16, then G weights [K, N_g] of one dtype (bf16 or int8);
// results: G f32 [M, N_g].
struct Weight {
  const void* w;
  int64_t N;
  float* y;
};

// A group call: fn(W{}, x, M, K, weights) with W the weights' common dtype (uint16_t: bf16, or
// int8_t); InvalidArgument(want) for any other operands.
template <typename Fn>
ffi::Error group_args(ffi::Buffer<ffi::BF16>& x, ffi::RemainingArgs& args,
                      ffi::RemainingRets& rets, const char* want, Fn fn) {
  auto xd = x.dimensions();
  const size_t G = rets.size();
  if (xd.size() != 2 || G == 0 || args.size() != G) return ffi::Error::InvalidArgument(want);
  std::vector<Weight> ws;
  ffi::DataType type = ffi::DataType::INVALID;
  for (size_t i = 0; i < G; ++i) {
    auto w = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(want);
    auto wd = w->dimensions();
    if (wd.size() != 2 || wd[0] != xd[1] || (*y)->element_count() != xd[0] * wd[1])
      return ffi::Error::InvalidArgument(want);
    if (i == 0) type = w->element_type();
    if (w->element_type() != type || (type != ffi::BF16 && type != ffi::S8))
      return ffi::Error::InvalidArgument(want);
    ws.push_back({w->untyped_data(), wd[1], (*y)->typed_data()});
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  if (type == ffi::BF16)
    fn(uint16_t{}, xp, xd[0], xd[1], ws);
  else
    fn(int8_t{}, xp, xd[0], xd[1], ws);
  return ffi::Error::Success();
}

// A call with one weight laid out [N, K] (x [M, K] bf16, w [N, K] bf16 or int8, f32 result
// [M, N]): fn(x, M, K, w, N, y) with w typed by its dtype; InvalidArgument(want) otherwise.
template <typename Fn>
ffi::Error nk_args(ffi::Buffer<ffi::BF16>& x, ffi::AnyBuffer& w, ffi::ResultBuffer<ffi::F32>& y,
                   const char* want, Fn fn) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1] || y->element_count() != xd[0] * wd[0])
    return ffi::Error::InvalidArgument(want);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  if (w.element_type() == ffi::BF16)
    fn(xp, xd[0], xd[1], reinterpret_cast<const uint16_t*>(w.untyped_data()), wd[0],
       y->typed_data());
  else if (w.element_type() == ffi::S8)
    fn(xp, xd[0], xd[1], reinterpret_cast<const int8_t*>(w.untyped_data()), wd[0],
       y->typed_data());
  else
    return ffi::Error::InvalidArgument(want);
  return ffi::Error::Success();
}
