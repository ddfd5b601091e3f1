"""What the native-kernel tests share: the skip marker for CPUs without the kernels, and CPU
backends (``models.cpu.backend.CpuBackend``) with every native path on (the ``DEFAULT`` policy:
up to 16 rows) or the native matmuls off, whatever this machine would measure."""

import dataclasses

import pytest

from models.cpu import backend as cpu_backend, kernels as cpu_kernels, lowering as cpu_lowering

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(),
                                  reason="native CPU kernels unavailable here (CPU / compiler)")
NATIVE = cpu_backend.native(cpu_lowering.DEFAULT)
XLA_ONLY = dataclasses.replace(
    NATIVE, amx=False, dpbf16=False, tiled=False, tiled_w8a8=False, policy=dataclasses.replace(
        cpu_lowering.DEFAULT, float_native_max_rows=0, f32_native_max_rows=0,
        int8_native_max_rows=0, int8_nk_native_max_rows=0))


def decode_step_vs_xla(backend, quantize: bool, rows: int = 24, tile: bool = False,
                       stacked: bool = False, int8_quads: bool = False):
  """A whole decode step of the tiny model (bf16 weights, weight-only int8 when ``quantize``) at
  ``rows`` rows under ``backend`` and under ``XLA_ONLY``: (logits, XLA's logits, compiled HLO
  text of the ``backend`` step). ``stacked``: the layers stacked (one ``lax.scan``); ``tile``:
  both runs on ``weights.tile_params``' params (``int8_quads``: weight-only int8 as AMX quads)."""
  import jax
  import jax.numpy as jnp

  from models import weights
  from models.config import get_preset
  from models.kv_cache import init_cache
  from models.transformer import decode_step

  cfg = get_preset("tiny")
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                        weights.init_params(cfg, jax.random.key(0)))
  if quantize:
    params = weights.quantize(params, cfg)
  if stacked:
    params = weights.stack_layers(params)
  if tile:
    params = weights.tile_params(params, cfg, int8_quads=int8_quads)
  toks = jax.random.randint(jax.random.key(1), (rows,), 0, cfg.vocab_size)
  cache = init_cache(cfg, rows, 32, jnp.bfloat16).replace(lengths=jnp.full((rows,), 5, jnp.int32))

  def run(b):
    step = jax.jit(lambda p, t, c: decode_step(p, t, c, cfg=cfg, attend_len=32, backend=b)[0])
    return step(params, toks, cache), step.lower(params, toks, cache).compile().as_text()

  got, hlo = run(backend)
  ref, _ = run(XLA_ONLY)
  return got, ref, hlo
