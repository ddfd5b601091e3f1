// The AMX tile configuration the native kernels share (inlined by models.cpu.build.source):
// every tile 16 rows x 64 bytes (C: 16 x 16 f32, A: 16 x 32 bf16, B: 16 pairs x 16 columns).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void configure_tiles() {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}
