"""Session 11: the seven [K, N] weights of SmolLM2-135M's 30 layers (q / k / v grouped, o,
gate / up grouped, down; weights streamed from memory, the layers chained as in a model) through
XLA's bf16 dot, the native float kernel (up to 32 rows) and the AMX kernel, best of 5 rounds of
10 calls, ms per pass (BUILD_NOTES "AMX tiles for decode batches"):

    .venv/bin/python -m launch.lab.model_speed.amx_chain_s11 8 16 32 64 128 [int8]
"""

from __future__ import annotations

import sys
import time

LAYERS = 30
SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]


def main() -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax

  from models.cpu import kernels as ck

  rng = np.random.default_rng(0)
  dt = jnp.int8 if "int8" in sys.argv else jnp.bfloat16
  weights = [[jnp.asarray(rng.standard_normal((k, n)) * 0.03, jnp.float32).astype(dt)
              for k, n in SHAPES] for _ in range(LAYERS)]

  def xla(x, ws):
    return [lax.dot_general(x, w.astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32) for w in ws]

  def nat(x, ws):
    return ck.matmul_float_group(x.astype(jnp.float32), ws)

  ck.available()
  ck.amx_available()

  def make(g):
    def f(x, layers):
      for q, k, v, o, ga, u, d in layers:
        a, b, c = g(x, [q, k, v])
        a = a.astype(jnp.bfloat16)
        x = (x.astype(jnp.float32) + g(a, [o])[0] + b.sum() * 0 + c.sum() * 0).astype(jnp.bfloat16)
        gg, uu = g(x, [ga, u])
        h = (jax.nn.silu(gg) * uu).astype(jnp.bfloat16)
        x = (x.astype(jnp.float32) + g(h, [d])[0]).astype(jnp.bfloat16)
      return x
    return jax.jit(f)

  fs = {"xla": make(xla), "native": make(nat), "amx": make(ck.matmul_amx_group)}
  for rows in [int(a) for a in sys.argv[1:] if a.isdigit()]:
    x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.bfloat16)
    for n, f in fs.items():
      if n == "native" and rows > 32:
        continue
      f(x, weights).block_until_ready()
    best = {n: 1e9 for n in fs}
    for _ in range(5):
      for n, f in fs.items():
        if n == "native" and rows > 32:
          continue
        t = time.perf_counter()
        for _ in range(10):
          y = f(x, weights)
        y.block_until_ready()
        best[n] = min(best[n], (time.perf_counter() - t) / 10)
    print(rows, "  ".join(f"{n} {v * 1e3:.2f}ms" for n, v in best.items() if v < 1e8), flush=True)


if __name__ == "__main__":
  main()
