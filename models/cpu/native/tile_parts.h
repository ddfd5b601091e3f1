// Shared by the tiled kernels (tiled_matmul.cc, tiled_w8a8.cc); inlined into each source by
// models.cpu.build.source, so each library's cache key covers it. Needs run_parts.h.
// for_each_tile(pool, counts, fn): fn(g, local) for every tile `local` of every weight g (counts[g]
// tiles each), the group's tiles split evenly over XLA's intra-op pool (no K split, no partial
// sums: each tile's outputs are its own).
template <typename Fn>
void for_each_tile(ffi::ThreadPool& pool, const std::vector<int64_t>& counts, Fn fn) {
  int64_t tiles = 0;
  std::vector<int64_t> first;  // each weight's first tile in the group's numbering
  for (const int64_t c : counts) {
    first.push_back(tiles);
    tiles += c;
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, tiles));
  run_parts(pool, parts, [&](int64_t part) {
    const int64_t t0 = tiles * part / parts, t1 = tiles * (part + 1) / parts;
    size_t g = 0;
    for (int64_t t = t0; t < t1; ++t) {
      while (g + 1 < first.size() && t >= first[g + 1]) ++g;
      fn(g, t - first[g]);
    }
  });
}
