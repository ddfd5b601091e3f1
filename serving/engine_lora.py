"""The engine's LoRA adapters on the device: ``max_loras`` slots and each engine slot's adapter.

Contract: ``DeviceLoras.create(cfg, registry, slots=, dtype=, sharding=)`` places zeroed adapter
slots (``models.lora.LoraWeights`` at the registry's rank) on the step's device. ``setup(slot,
adapter)`` records engine slot ``slot``'s adapter slot (-1: none); ``load(loads)`` fills device
slots from the registry's host arrays (one jitted program, the slot traced: warmed by
``warm()``); ``batch()`` is what every model call takes: the weights and the per-slot adapter
ids ``adapter_X``, gathered into each row by ``rows`` inside the call. Letters:
``models/config.py``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import lora
from models.config import ModelConfig
from models.lora import LoraBatch, LoraWeights
from serving.lora import LoraLoad, LoraRegistry


class SlotLoras(NamedTuple):
  """A model call's adapters: the weights and each engine slot's adapter slot [X] (-1: none)."""
  weights: LoraWeights
  adapter_X: jax.Array | np.ndarray  # a host array as the engine passes it (3 us, not 0.15 ms)


def lora_rows(s: SlotLoras | None, idx: jax.Array) -> LoraBatch | None:
  """Each row's adapter for a call whose rows (or tokens) run slots ``idx`` (any shape; out of
  range: padding, no adapter)."""
  if s is None:
    return None
  adapter_X = jnp.asarray(s.adapter_X)  # traced inside the call
  return LoraBatch(s.weights, adapter_X.at[idx].get(mode="fill", fill_value=-1))


_place = jax.jit(lora.place, donate_argnums=0)


@dataclasses.dataclass
class DeviceLoras:
  registry: LoraRegistry
  weights: LoraWeights
  adapter_X: np.ndarray  # int32 [X]
  loaded: int = 0  # adapters moved onto the device

  @classmethod
  def create(cls, cfg: ModelConfig, registry: LoraRegistry, *, slots: int, max_slots: int,
             dtype, sharding: jax.sharding.Sharding) -> "DeviceLoras":
    w = jax.device_put(lora.empty_weights(cfg, slots, registry.slot_rank, dtype), sharding)
    return cls(registry, w, np.full((max_slots,), -1, np.int32))

  def setup(self, slot: int, adapter: int) -> None:
    self.adapter_X[slot] = adapter

  def batch(self) -> SlotLoras:
    """The call's adapters: ``adapter_X`` copied, since a numpy argument of an asynchronous
    call may be read in place after ``setup`` changed it for a later step."""
    return SlotLoras(self.weights, self.adapter_X.copy())

  def load(self, loads: Sequence[LoraLoad]) -> None:
    for ld in loads:
      a, b = self.registry.weights(ld.uid)
      self.weights = _place(self.weights, np.int32(ld.slot), a, b)
      self.loaded += 1

  def warm(self) -> None:
    """Compiles the slot-filling program (writes zeros into slot 0, which holds nothing yet),
    with float32 host arrays as ``LoraRegistry.weights`` gives them (the same signature)."""
    a = {t: np.zeros(x.shape[:2] + x.shape[3:], np.float32) for t, x in self.weights.a.items()}
    b = {t: np.zeros((x.shape[0],) + x.shape[2:], np.float32) for t, x in self.weights.b.items()}
    self.weights = jax.block_until_ready(_place(self.weights, np.int32(0), a, b))


__all__ = ["SlotLoras", "lora_rows", "DeviceLoras"]
