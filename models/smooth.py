"""SmoothQuant (Xiao et al., 2023) for W8A8: activation outliers moved into the weights.

Per-token int8 activations lose the small channels of a token whose few outlier channels set its
scale. Dividing each input channel j of a matmul by ``s_j = amax_j^alpha / wmax_j^(1 - alpha)``
(``amax_j``: the channel's largest |activation| on calibration text; ``wmax_j``: the largest
|weight| in the weight rows it multiplies) and multiplying those rows by ``s_j`` computes the same
function in float and evens out what both int8 roundings see. The division is folded into the
op that produces the activation, so serving costs nothing:

  ========================  =====================================  ============================
  matmul (input)            divided in                             shared by
  ========================  =====================================  ============================
  q / k / v (attn norm)     ``attn_norm``'s weight                 q, k, v (and gate / up when
                                                                   ``parallel_block``)
  o (attention output)      v's output columns (one s per kv head  the query heads of a kv head
                            channel)
  gate / up (mlp norm)      ``mlp_norm``'s weight                  gate, up
  down (GLU output)         up's output columns                    -
  ========================  =====================================  ============================

The unembedding is not smoothed (its input norm feeds it alone, but a tied table is also the
input embedding); ``models.precision`` keeps it weight-only in W8A8 mode.

Contract:
  * ``channel_amax(params, cfg, tokens_BT, lens_B)``: float params -> per layer, the largest
    |activation| of each input channel of each matmul group over the valid tokens:
    ``[{"attn_in": [D], "o_in": [N, H], "mlp_in": [D], "down_in": [F]}, ...]`` (numpy f32), from
    a plain causal forward over the layers in one ``lax.scan`` (``_calibration_forward``) that
    tests hold equal to ``models.transformer.forward``.
  * ``smooth(params, cfg, amax, alpha=ALPHA)``: float params (layers unstacked) -> float params
    computing the same logits up to float rounding, each leaf placed as it was (host numpy in
    between: the params of one process).
  * ``smooth_for_w8a8(params, cfg, tokens)``: both, on one calibration document (stacked
    layers too: unstacked for it and stacked again).
Letters: B batch, T tokens, D embed, N query heads, K kv heads, H head dim, F mlp.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import attention
from models.config import ModelConfig
from models.layers import glu, rms_norm, rotate, rotation
from models.weights import Params, is_stacked, stack_layers

ALPHA = 0.5  # SmolLM2-135M, held-out text: 0.5 and 0.6 within noise of each other, 0.8 worse
_S_MIN, _S_MAX = 1e-3, 1e3


def _calibration_forward(params: Params, cfg: ModelConfig, tokens_BT: jax.Array,
                         valid_BT: jax.Array, with_logits: bool = True
                         ) -> tuple[jax.Array | None, dict[str, jax.Array]]:
  """Logits [B, T, V] (None unless ``with_logits``: the stats do not need them) and the channel
  maxima, each ``[L, ...]``, of a causal forward from position 0 (layers stacked or not)."""
  b, t = tokens_BT.shape
  dtype = params["final_norm"].dtype
  w = lambda a: a.astype(dtype)  # noqa: E731
  x = w(params["embed"])[tokens_BT]
  if cfg.embed_scale:
    x = x * jnp.asarray(cfg.embed_dim ** 0.5, dtype)
  pos_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  rot = rotation(pos_BT, cfg.head_dim, cfg.rope_theta)
  mask = valid_BT[..., None]

  def amax(a, axes):  # over the valid tokens: [B, T, ...] -> [...]
    a = jnp.abs(a.astype(jnp.float32)) * mask.reshape(mask.shape + (1,) * (a.ndim - 3))
    return jnp.max(a, axis=axes)

  def body(x, layer):
    h = rms_norm(x, layer["attn_norm"], cfg.norm_eps, cfg.norm_plus_one)
    q = rotate(jnp.einsum("btd,dnh->btnh", h, w(layer["q"])), rot)
    k = rotate(jnp.einsum("btd,dkh->btkh", h, w(layer["k"])), rot)
    v = jnp.einsum("btd,dkh->btkh", h, w(layer["v"]))
    o_in = attention.attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), pos_BT)
    attn = jnp.einsum("btnh,nhd->btd", o_in, w(layer["o"]))
    m_in = h if cfg.parallel_block else rms_norm(x + attn, layer["mlp_norm"], cfg.norm_eps,
                                                 cfg.norm_plus_one)
    d_in = glu(jnp.einsum("btd,df->btf", m_in, w(layer["gate"])),
               jnp.einsum("btd,df->btf", m_in, w(layer["up"])), cfg.activation, dtype)
    x = x + attn + jnp.einsum("btf,fd->btd", d_in, w(layer["down"]))
    return x, {"attn_in": amax(h, (0, 1)), "o_in": amax(o_in, (0, 1)),
               "mlp_in": amax(m_in, (0, 1)), "down_in": amax(d_in, (0, 1))}

  # One scanned layer (compile time independent of depth); stats stacked [L, ...].
  x, stats = jax.lax.scan(body, x, stack_layers(params)["layers"])
  if not with_logits:
    return None, stats
  x = rms_norm(x, params["final_norm"], cfg.norm_eps, cfg.norm_plus_one)
  table = (w(params["embed"]).T if cfg.tie_embeddings else w(params["unembed"]))
  return jnp.einsum("btd,dv->btv", x, table).astype(jnp.float32), stats


def channel_amax(params: Params, cfg: ModelConfig, tokens_BT: jax.Array, lens_B: jax.Array
                 ) -> list[dict[str, np.ndarray]]:
  valid = jnp.arange(tokens_BT.shape[1])[None, :] < lens_B[:, None]
  _, stats = jax.jit(_calibration_forward, static_argnums=(1, 4))(params, cfg, tokens_BT, valid,
                                                                  False)
  stats = {k: np.asarray(v, np.float32) for k, v in stats.items()}
  return [{k: v[i] for k, v in stats.items()} for i in range(cfg.num_layers)]


def _factor(a: np.ndarray, wmax: np.ndarray, alpha: float) -> np.ndarray:
  """s = a^alpha / wmax^(1 - alpha) per channel, 1 where the channel never fired."""
  s = np.power(np.maximum(a, 1e-8), alpha) / np.power(np.maximum(wmax, 1e-8), 1 - alpha)
  return np.where(a > 0, np.clip(s, _S_MIN, _S_MAX), 1.0).astype(np.float32)


def _row_max(*ws: np.ndarray) -> np.ndarray:
  """max |w| over every axis but the first (the contracted input channel), over ``ws``."""
  return np.max([np.abs(w).reshape(w.shape[0], -1).max(axis=1) for w in ws], axis=0)


def _divide_norm(norm: np.ndarray, s: np.ndarray, plus_one: bool) -> np.ndarray:
  return (norm + 1) / s - 1 if plus_one else norm / s


def smooth(params: Params, cfg: ModelConfig, amax: Sequence[dict[str, np.ndarray]],
           alpha: float = ALPHA) -> Params:
  if is_stacked(params) or len(amax) != len(params["layers"]):
    raise ValueError("smooth wants unstacked layers and one amax entry per layer")
  g = cfg.num_heads // cfg.num_kv_heads
  layers = []
  for layer, a in zip(params["layers"], amax):
    p = {k: np.asarray(v, np.float32) for k, v in layer.items()}
    attn_group = ["q", "k", "v"] + (["gate", "up"] if cfg.parallel_block else [])
    in_a = np.maximum(a["attn_in"], a["mlp_in"]) if cfg.parallel_block else a["attn_in"]
    s = _factor(in_a, _row_max(*(p[n] for n in attn_group)), alpha)
    p["attn_norm"] = _divide_norm(p["attn_norm"], s, cfg.norm_plus_one)
    for n in attn_group:
      p[n] = p[n] * s.reshape(-1, *[1] * (p[n].ndim - 1))
    if not cfg.parallel_block:
      s = _factor(a["mlp_in"], _row_max(p["gate"], p["up"]), alpha)
      p["mlp_norm"] = _divide_norm(p["mlp_norm"], s, cfg.norm_plus_one)
      p["gate"], p["up"] = p["gate"] * s[:, None], p["up"] * s[:, None]
    # o: one factor per (kv head, channel), shared by the query heads that read that kv head.
    o_a = a["o_in"].reshape(cfg.num_kv_heads, g, -1).max(axis=1)  # [K, H]
    o_w = np.abs(p["o"]).max(axis=2).reshape(cfg.num_kv_heads, g, -1).max(axis=1)
    s = _factor(o_a, o_w, alpha)  # [K, H]
    p["v"] = p["v"] / s[None]
    p["o"] = p["o"] * np.repeat(s, g, axis=0)[:, :, None]
    s = _factor(a["down_in"], _row_max(p["down"]), alpha)  # [F]
    p["up"] = p["up"] / s[None]
    p["down"] = p["down"] * s[:, None]
    layers.append({k: _placed_like(v, layer[k]) for k, v in p.items()})
  return {**params, "layers": layers}


def _placed_like(value: np.ndarray, old) -> jax.Array:
  """``value`` in ``old``'s dtype, on ``old``'s devices (a sharded load stays sharded)."""
  new = jnp.asarray(value, old.dtype)
  return jax.device_put(new, old.sharding) if isinstance(old, jax.Array) else new


def smooth_for_w8a8(params: Params, cfg: ModelConfig, tokens: Sequence[int]) -> Params:
  """``smooth`` with the channel maxima of one calibration document (cut to the context)."""
  toks = list(tokens)[:cfg.max_seq_len]
  if len(toks) < 2:
    raise ValueError("the calibration text gives fewer than 2 tokens")
  amax = channel_amax(params, cfg, jnp.asarray([toks], jnp.int32),
                      jnp.asarray([len(toks)], jnp.int32))
  stacked = is_stacked(params)
  if stacked:
    params = {**params, "layers": [jax.tree.map(lambda a: a[i], params["layers"])
                                   for i in range(cfg.num_layers)]}
  out = smooth(params, cfg, amax)
  return stack_layers(out) if stacked else out


__all__ = ["ALPHA", "channel_amax", "smooth", "smooth_for_w8a8"]
