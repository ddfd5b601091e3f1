// Shared by the native kernels (models/native/*.cc); inlined into each source by
// models.native_build.source, so each library's cache key covers it.
// run_parts(pool, parts, fn): runs fn(p) for p in [0, parts) on XLA's intra-op pool (the calling
// thread takes a share too) and waits for all of them.
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
