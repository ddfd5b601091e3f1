"""The decoder-only transformer as pure functions: ``prefill`` a chunk, ``decode_step`` a batch.

Contract:
  * ``prefill(params, tokens_BT, cache, start_B, lens_B, cfg=, attend_len=, all_logits=,
    backend=)``: row b's ``lens_B[b]`` tokens at positions ``start_B[b] + t`` (``start_B=None``:
    at ``cache.lengths``), K/V written into the cache; logits of each row's last valid token
    (``all_logits``: every position). Rows with ``lens_B[b] == 0`` and padding write nothing.
  * ``decode_step(params, tokens_B, cache, cfg=, attend_len=, active_B=, backend=)``: one token
    per active row at ``cache.lengths[b]`` (ragged batch).
  * ``params``: a list of layers (a Python loop calling one jitted block with the layer index
    traced: traced and lowered once, inlined by XLA) or stacked (``models.weights.stack_layers``: one
    ``lax.scan``, the layer index traced). ``cache``: any ``models.kv_cache.KVStore``; the same
    type comes back. Queries are rotated by ``cache.rope_positions``, keys by absolute position.
  * Static: ``cfg``, ``attend_len`` (the attended positions: a bucket covering every row),
    ``all_logits`` and ``backend`` (a ``models.cpu.backend.CpuBackend``: how XLA:CPU computes
    the matmuls; default XLA only). ``jit_prefill`` / ``jit_decode_step`` donate the cache.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp

from models import kv_cache, lora as lora_mod, quant
from models.config import ModelConfig
from models.cpu.backend import CpuBackend
from models.kv_cache import KVStore, written_end
from models.layers import Rotation, mlp, rms_norm, rotate, rotation
from models.lora import LayerLora, LoraBatch
from models.weights import Params, is_stacked

Store = TypeVar("Store", bound=KVStore)  # KVCache or paged_kv.PagedKV


def embed(params: Params, tokens: jax.Array, cfg: ModelConfig, dtype) -> jax.Array:
  """Token embeddings (Gemma: scaled by sqrt(D)); ``params`` needs only ``embed``."""
  x = quant.take_rows(params["embed"], tokens, dtype)
  if cfg.embed_scale:
    x = x * jnp.asarray(cfg.embed_dim ** 0.5, dtype)
  return x


def _unembed(params: Params, x_BTD: jax.Array, cfg: ModelConfig, backend: CpuBackend
             ) -> jax.Array:
  x = rms_norm(x_BTD, params["final_norm"], cfg.norm_eps, cfg.norm_plus_one)
  if cfg.tie_embeddings:
    logits = quant.einsum("btd,vd->btv", x, params["embed"], backend)
  else:
    logits = quant.einsum("btd,dv->btv", x, params["unembed"], backend)
  return logits.astype(jnp.float32)


def _block(x_BTD, layer, l, cache: Store, pos_BT, wpos_BT, rot: Rotation, rot_q: Rotation,
           cfg: ModelConfig, attend_len: int, backend: CpuBackend, lw: LayerLora | None = None
           ) -> tuple[jax.Array, Store]:
  h_BTD = rms_norm(x_BTD, layer["attn_norm"], cfg.norm_eps, cfg.norm_plus_one)
  q_BTNH, k_BTKH, v_BTKH = quant.einsums(("btd,dnh->btnh", "btd,dkh->btkh", "btd,dkh->btkh"),
                                         h_BTD, (layer["q"], layer["k"], layer["v"]), backend)
  q_BTNH, k_BTKH, v_BTKH = lora_mod.adds((q_BTNH, k_BTKH, v_BTKH), h_BTD, lw, ("q", "k", "v"),
                                          backend)
  q_BTNH = rotate(q_BTNH, rot_q)
  k_BTKH = rotate(k_BTKH, rot)
  cache = cache.write(l, wpos_BT, k_BTKH, v_BTKH)
  attn_BTNH = cache.attend(l, q_BTNH, pos_BT, attend_len, written_end(wpos_BT, pos_BT))
  attn_BTD = lora_mod.add(quant.einsum("btnh,nhd->btd", attn_BTNH, layer["o"], backend),
                          attn_BTNH, lw, "o", backend)
  if cfg.parallel_block:
    x_BTD = x_BTD + attn_BTD + mlp(h_BTD, layer, cfg, backend, lw)
  else:
    x_BTD = x_BTD + attn_BTD
    x_BTD = x_BTD + mlp(rms_norm(x_BTD, layer["mlp_norm"], cfg.norm_eps, cfg.norm_plus_one),
                        layer, cfg, backend, lw)
  return x_BTD, cache


_jit_block = jax.jit(_block, static_argnames=("cfg", "attend_len", "backend"))


def prefill(params: Params, tokens_BT: jax.Array, cache: Store, start_B: jax.Array | None,
            lens_B: jax.Array, *, cfg: ModelConfig, attend_len: int | None = None,
            all_logits: bool = False, backend: CpuBackend = CpuBackend(),
            logits_at: jax.Array | None = None, lora: LoraBatch | None = None
            ) -> tuple[jax.Array, Store]:
  """Returns (logits [B, V] of each row's last valid token, or [B, T, V], or with
  ``logits_at`` (rows [R]) those rows' only: [R, V]; updated cache). ``lora``: each token's
  adapter (``models.lora``)."""
  b, t = tokens_BT.shape
  attend_len = attend_len or cache.max_len
  dtype = params["final_norm"].dtype  # activation dtype = float param dtype (never quantized)
  # start None: continue each row; padding writes go to max_len = out of range -> dropped.
  c = kv_cache.chunk_positions(cache.lengths, start_B, lens_B, t, cache.max_len)
  x_BTD = embed(params, tokens_BT, cfg, dtype)
  rot = rotation(c.pos_BT, cfg.head_dim, cfg.rope_theta)
  rot_q = rotation(cache.rope_positions(c.pos_BT), cfg.head_dim, cfg.rope_theta) \
      if cache.sink_pool else rot
  view = lora_mod.layer_view(lora, dtype)
  if is_stacked(params):  # one traced layer in a loop: compile time independent of depth
    def body(carry, xs):
      x, store = carry
      layer, l = xs
      return _block(x, layer, l, store, c.pos_BT, c.wpos_BT, rot, rot_q, cfg, attend_len,
                    backend, lora_mod.layer(view, l)), None

    (x_BTD, cache), _ = jax.lax.scan(
        body, (x_BTD, cache), (params["layers"], jnp.arange(cfg.num_layers, dtype=jnp.int32)))
  else:
    # One traced block called per layer (layer index traced): traced and lowered once, not
    # once per layer; XLA inlines the calls, so the program is the unrolled loop's.
    for l, layer in enumerate(params["layers"]):
      x_BTD, cache = _jit_block(x_BTD, layer, jnp.int32(l), cache, c.pos_BT, c.wpos_BT, rot,
                                rot_q, cfg, attend_len, backend, lora_mod.layer(view, l))
  if not all_logits:
    x_BTD = jnp.take_along_axis(x_BTD, c.last_B[:, None, None], axis=1)
    if logits_at is not None:
      x_BTD = x_BTD[logits_at]  # [R, 1, D]: the unembedding only where a token is sampled
  logits = _unembed(params, x_BTD, cfg, backend)
  cache = cache.replace(lengths=c.lengths_B)
  return (logits if all_logits else logits[:, 0]), cache


def decode_step(params: Params, tokens_B: jax.Array, cache: Store, *, cfg: ModelConfig,
                attend_len: int | None = None, active_B: jax.Array | None = None,
                backend: CpuBackend = CpuBackend(), lora: LoraBatch | None = None
                ) -> tuple[jax.Array, Store]:
  """One token per active row at position ``cache.lengths[b]``; returns (logits [B, V], cache).
  ``lora``: each row's adapter, ``slot_BT`` [B] or [B, 1]."""
  ones = jnp.ones_like(cache.lengths) if active_B is None else active_B.astype(jnp.int32)
  if lora is not None and lora.slot_BT.ndim == 1:
    lora = lora._replace(slot_BT=lora.slot_BT[:, None])
  return prefill(params, tokens_B[:, None], cache, None, ones, cfg=cfg,
                 attend_len=attend_len, backend=backend, lora=lora)


jit_prefill = jax.jit(prefill, static_argnames=("cfg", "attend_len", "all_logits", "backend"),
                      donate_argnames=("cache",))
jit_decode_step = jax.jit(decode_step, static_argnames=("cfg", "attend_len", "backend"),
                          donate_argnames=("cache",))


def forward(params: Params, tokens_BT: jax.Array, *, cfg: ModelConfig,
            backend: CpuBackend = CpuBackend(), lora: LoraBatch | None = None) -> jax.Array:
  """Full causal forward of unpadded sequences from position 0: logits [B, T, V] (reference)."""
  from models.kv_cache import init_cache
  b, t = tokens_BT.shape
  dtype = params["final_norm"].dtype
  cache = init_cache(cfg, b, t, dtype, backend)
  logits, _ = prefill(params, tokens_BT, cache, jnp.zeros((b,), jnp.int32),
                      jnp.full((b,), t, jnp.int32), cfg=cfg, all_logits=True, backend=backend,
                      lora=lora)
  return logits


def bucket(n: int, minimum: int = 16, maximum: int | None = None) -> int:
  """Smallest power of two >= n (at least ``minimum``), capped at ``maximum``."""
  size = max(minimum, 1 << max(0, (n - 1).bit_length()))
  return min(size, maximum) if maximum else size


__all__ = ["prefill", "decode_step", "jit_prefill", "jit_decode_step", "forward", "bucket",
           "embed"]

