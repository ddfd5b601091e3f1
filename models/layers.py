"""Small building blocks: RMSNorm, rotary embeddings (half-split, as Llama/Gemma in HF), GLU MLP.

Contract: pure functions over arrays; norms and rotary math run in float32 and return the input
dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import quant
from models.config import ModelConfig


def rms_norm(x: jax.Array, w: jax.Array, eps: float, plus_one: bool) -> jax.Array:
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale = w.astype(jnp.float32) + (1.0 if plus_one else 0.0)
  return (y * scale).astype(x.dtype)


def rope(x_BTnH: jax.Array, pos_BT: jax.Array, theta: float) -> jax.Array:
  """Rotates pairs (i, i + H/2) by angle pos * theta^(-2i/H)."""
  h = x_BTnH.shape[-1]
  inv_freq = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
  ang = pos_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  sin, cos = jnp.sin(ang)[:, :, None, :], jnp.cos(ang)[:, :, None, :]
  x = x_BTnH.astype(jnp.float32)
  x1, x2 = x[..., : h // 2], x[..., h // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTnH.dtype)


def mlp(x_BTD: jax.Array, layer: dict, cfg: ModelConfig) -> jax.Array:
  gate_BTF = quant.einsum("btd,df->btf", x_BTD, layer["gate"])
  up_BTF = quant.einsum("btd,df->btf", x_BTD, layer["up"])
  if cfg.activation == "swiglu":
    act = jax.nn.silu(gate_BTF.astype(jnp.float32))
  else:  # geglu, tanh-approximate gelu as Gemma
    act = jax.nn.gelu(gate_BTF.astype(jnp.float32), approximate=True)
  h_BTF = (act * up_BTF.astype(jnp.float32)).astype(x_BTD.dtype)
  return quant.einsum("btf,fd->btd", h_BTF, layer["down"])
