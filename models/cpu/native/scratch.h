// Shared by the bf16-activation kernels (dpbf16_matmul.cc, tiled_matmul.cc); inlined into each
// source by models.cpu.build.source, so each library's cache key covers it.
// scratch(slot, bytes): this thread's 64-byte aligned buffer `slot` (0 or 1) of at least `bytes`,
// kept across calls (a fresh allocation per call would page-fault its pages in every time).
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

void* scratch(int slot, int64_t bytes) {
  thread_local std::unique_ptr<void, FreeDeleter> buf[2];
  thread_local int64_t size[2] = {0, 0};
  if (size[slot] < bytes) {
    const int64_t rounded = (bytes + 4095) / 4096 * 4096;
    buf[slot].reset(std::aligned_alloc(64, rounded));
    size[slot] = rounded;
  }
  return buf[slot].get();
}
