"""Allowed-token bitmasks: the layout, the JAX mask on logits, numpy helpers.

Contract:
  * Layout (llguidance's and xgrammar's): an int32 array ``mask_RW`` with ``W = words(V)`` =
    ceil(V / 32) words per row; token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32`` is
    set (bit 0 = least significant). A token at or past ``32 * W`` is never allowed.
  * ``apply_bitmask(logits_RV, mask_RW, on_R)`` (pure, jit-able; shapes static): rows with
    ``on_R`` get every disallowed logit set to -inf, other rows come back unchanged. ``V`` may be
    wider than ``32 * W`` (the model's vocab padded past the tokenizer's: those ids are -inf on
    ``on_R`` rows) or narrower (the mask's extra bits are ignored).
  * ``allowed_ids(mask_W, vocab)``, ``unpack_bitmask(mask_RW, vocab)``: the host-side reading of
    the same layout (tests, debugging).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def words(vocab: int) -> int:
  """W: the int32 words of one row's bitmask for a vocab of ``vocab`` ids."""
  return (vocab + 31) // 32


def apply_bitmask(logits_RV: jax.Array, mask_RW: jax.Array, on_R: jax.Array) -> jax.Array:
  """``logits_RV`` with the disallowed tokens of the ``on_R`` rows at -inf; see the contract."""
  R, V = logits_RV.shape
  W = mask_RW.shape[1]
  shifts = jnp.arange(32, dtype=jnp.int32)
  bits_RWb = (mask_RW.astype(jnp.int32)[:, :, None] >> shifts) & 1  # arithmetic >> keeps bit b
  allowed_RU = bits_RWb.reshape(R, W * 32).astype(jnp.bool_)
  if W * 32 >= V:
    allowed_RV = allowed_RU[:, :V]
  else:
    allowed_RV = jnp.pad(allowed_RU, ((0, 0), (0, V - W * 32)), constant_values=False)
  keep_RV = allowed_RV | ~on_R.astype(jnp.bool_)[:, None]
  return jnp.where(keep_RV, logits_RV, jnp.array(-jnp.inf, logits_RV.dtype))


def unpack_bitmask(mask_RW: np.ndarray, vocab: int) -> np.ndarray:
  """[R, vocab] bool: token t of row r allowed (ids past ``32 * W`` are False)."""
  mask_RW = np.ascontiguousarray(np.atleast_2d(mask_RW), np.int32)
  bits = (mask_RW.view(np.uint32)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
  flat = bits.reshape(mask_RW.shape[0], -1).astype(bool)
  out = np.zeros((mask_RW.shape[0], vocab), bool)
  n = min(vocab, flat.shape[1])
  out[:, :n] = flat[:, :n]
  return out


def allowed_ids(mask_W: np.ndarray, vocab: int) -> np.ndarray:
  """The ids one row's mask allows, ascending."""
  return np.flatnonzero(unpack_bitmask(np.asarray(mask_W).reshape(1, -1), vocab)[0])


__all__ = ["allowed_ids", "apply_bitmask", "unpack_bitmask", "words"]
