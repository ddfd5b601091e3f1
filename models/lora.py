"""Low-rank adapters (LoRA) beside the base weights: many adapters in one batch (punica, S-LoRA).

Contract: ``LoraWeights`` holds ``A`` resident adapter slots of rank ``E`` for every target
projection of every layer: ``a[t]`` [L, I, A, E] and ``b[t]`` [L, A, E, O] (``I`` / ``O``: the
projection's input / output features, flat; the scaling ``alpha / r`` folded into ``b``; an
adapter of lower rank is zero-padded, which changes nothing). ``LoraBatch`` is what one model
call applies: the weights and each token's slot ``slot_BT`` (-1: none, the base model alone).
A projection ``y = x W`` becomes ``y + (x a_s) b_s`` for the token's slot ``s``, computed for all
slots at once as two dense products, ``x [I] @ a [I, A*E]``, masked to the token's slot, then
``@ b [A*E, O]``: one program whatever the batch's mix of adapters (no per-adapter compile), at
``A * E * (I + O)`` extra multiply-adds per token and projection. Where the backend has it
(``CpuBackend.lora``) one native call per group of targets sharing an input does it instead
(``models.cpu.kernels.lora_group``: each token's own slot only, the stacked weights read in
place; XLA:CPU's small dots cost ~15-25 us each, and 14 a layer made a decode step 2.4x the
base's; measured faster from 8 to 512 tokens, BUILD_NOTES "Multi-LoRA serving"). Targets: ``TARGETS``, with Hugging Face's module names in
``HF_MODULES``. Letters: ``models/config.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.cpu import kernels
from models.cpu.backend import CpuBackend

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
HF_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
              "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def target_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """Target -> (I, O): its input and output features, flat (heads times head dim)."""
  d, f = cfg.embed_dim, cfg.mlp_dim
  qo, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return {"q": (d, qo), "k": (d, kv), "v": (d, kv), "o": (qo, d), "gate": (d, f), "up": (d, f),
          "down": (f, d)}


class LoraWeights(NamedTuple):
  a: dict[str, jax.Array]  # target -> [L, I, A, E]
  b: dict[str, jax.Array]  # target -> [L, A, E, O]

  @property
  def slots(self) -> int:
    return self.a["q"].shape[2]

  @property
  def rank(self) -> int:
    return self.a["q"].shape[3]


class LoraBatch(NamedTuple):
  weights: LoraWeights
  slot_BT: jax.Array  # int32: each token's adapter slot, -1 for none


class LayerLora(NamedTuple):
  """One layer's share of a ``LoraBatch``: the stacked weights and the layer ``l`` (traced or
  a Python int: sliced where used, so a native call reads them in place), the tokens' slot
  mask [B, T, A*E] and slots."""
  w: LoraWeights
  l: jax.Array | int
  mask_BTJ: jax.Array  # J = A * E
  slot_BT: jax.Array  # int32, -1: none

  def a(self, target: str) -> jax.Array:  # [I, A, E]
    return jax.lax.dynamic_index_in_dim(self.w.a[target], self.l, 0, keepdims=False)

  def b(self, target: str) -> jax.Array:  # [A, E, O]
    return jax.lax.dynamic_index_in_dim(self.w.b[target], self.l, 0, keepdims=False)


def empty_weights(cfg: ModelConfig, slots: int, rank: int, dtype) -> LoraWeights:
  """Zeros (every slot the base model) for ``slots`` adapters of rank up to ``rank``."""
  dims, n = target_dims(cfg), cfg.num_layers
  return LoraWeights({t: jnp.zeros((n, i, slots, rank), dtype) for t, (i, _) in dims.items()},
                     {t: jnp.zeros((n, slots, rank, o), dtype) for t, (_, o) in dims.items()})


def slot_mask(slot_BT: jax.Array, slots: int, rank: int, dtype) -> jax.Array:
  """[B, T, A * E]: 1 on the E columns of each token's slot (none for slot -1)."""
  owner_J = jnp.arange(slots * rank, dtype=jnp.int32) // rank
  return (slot_BT[..., None] == owner_J).astype(dtype)


View = tuple[LoraWeights, jax.Array, jax.Array]  # weights, mask_BTJ, slot_BT


def layer_view(batch: LoraBatch | None, dtype) -> View | None:
  """The stacked weights and the step's slot mask (computed once for every layer)."""
  if batch is None:
    return None
  w = batch.weights
  return w, slot_mask(batch.slot_BT, w.slots, w.rank, dtype), batch.slot_BT


def layer(view: View | None, l) -> LayerLora | None:
  """Layer ``l``'s weights (``l`` traced or a Python int) with the step's mask."""
  if view is None:
    return None
  w, mask, slot = view
  return LayerLora(w, l, mask, slot)


def _native(x: jax.Array, lw: LayerLora, backend: CpuBackend) -> bool:
  """The native kernel takes this call (static: shapes, dtypes and the backend)."""
  w = lw.w.a["q"]
  return (backend.lora and w.shape[3] % 16 == 0 and x.dtype == w.dtype
          and x.dtype in (jnp.bfloat16, jnp.float32))


def adds(ys: tuple[jax.Array, ...], x: jax.Array, lw: LayerLora | None,
         targets: tuple[str, ...], backend: CpuBackend = CpuBackend()) -> tuple[jax.Array, ...]:
  """``add`` for several targets sharing ``x`` (q / k / v, gate / up): one native call for all
  of them where the backend has the kernel."""
  if lw is None:
    return ys
  if not _native(x, lw, backend):
    return tuple(add(y, x, lw, t) for y, t in zip(ys, targets))
  b, t = x.shape[:2]
  n, i, slots, rank = lw.w.a[targets[0]].shape
  pairs = [(lw.w.a[g].reshape(n, i, slots * rank), lw.w.b[g].reshape(n, slots * rank, -1))
           for g in targets]
  slot_M = jnp.broadcast_to(lw.slot_BT, (b, t)).reshape(-1)
  ds = kernels.lora_group(x.reshape(b * t, i), slot_M, lw.l, pairs, slots)
  return tuple((y.astype(jnp.float32) + d.reshape(y.shape)).astype(y.dtype)
               for y, d in zip(ys, ds))


def add(y: jax.Array, x: jax.Array, lw: LayerLora | None, target: str,
        backend: CpuBackend = CpuBackend()) -> jax.Array:
  """``y`` (the base projection of ``x``, any trailing output shape) plus each token's adapter
  term; ``x``'s trailing axes flatten to the target's ``I``."""
  if lw is None:
    return y
  b, t = x.shape[:2]
  if _native(x, lw, backend):
    return adds((y,), x.reshape(b, t, -1), lw, (target,), backend)[0]
  a_IAE, b_AEO = lw.a(target), lw.b(target)
  i, slots, rank = a_IAE.shape
  u_BTJ = jnp.dot(x.reshape(b, t, i), a_IAE.reshape(i, slots * rank),
                  preferred_element_type=jnp.float32)
  u_BTJ = (u_BTJ * lw.mask_BTJ).astype(a_IAE.dtype)
  d_BTO = jnp.dot(u_BTJ, b_AEO.reshape(slots * rank, -1), preferred_element_type=jnp.float32)
  return (y.astype(jnp.float32) + d_BTO.reshape(y.shape)).astype(y.dtype)


def place(w: LoraWeights, slot: jax.Array, a: dict[str, jax.Array], b: dict[str, jax.Array]
          ) -> LoraWeights:
  """``w`` with slot ``slot`` (traced) holding one adapter: ``a[t]`` [L, I, E], ``b[t]``
  [L, E, O] at the slots' rank (zero-padded by the caller)."""
  put_a = lambda full, x: full.at[:, :, slot].set(x.astype(full.dtype))
  put_b = lambda full, x: full.at[:, slot].set(x.astype(full.dtype))
  return LoraWeights(jax.tree.map(put_a, w.a, a), jax.tree.map(put_b, w.b, b))


def merged(params: dict, a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict:
  """Unstacked ``params`` with one adapter merged into the base weights (``W + a b``): the
  reference the per-token path must equal (float weights only)."""
  out = dict(params)
  out["layers"] = []
  for l, layer_w in enumerate(params["layers"]):
    layer_w = dict(layer_w)
    for t, a_LIE in a.items():
      w = layer_w[t]
      delta = (a_LIE[l].astype(np.float32) @ b[t][l].astype(np.float32)).reshape(w.shape)
      layer_w[t] = (w.astype(jnp.float32) + delta).astype(w.dtype)
    out["layers"].append(layer_w)
  return out


__all__ = ["TARGETS", "HF_MODULES", "target_dims", "LoraWeights",
           "LoraBatch", "LayerLora", "empty_weights", "slot_mask", "layer_view", "layer", "add",
           "adds", "place", "merged"]
