"""The step protocol: what a serving engine needs of a model, whoever partitions it.

Contract: a ``Step`` runs one phase of the model over a paged pool (``models.paged_kv.PagedKV``);
its functions are traceable (the engine calls them inside its own jitted programs, ``attend_len``
static).
  * ``prefill(params, tokens_BT, kv, start_B, lens_B, attend_len=, logits_at=None) ->
    (logits_BV, kv)``: row b's ``lens_B[b]`` tokens at positions ``start_B[b] + t``; logits of
    each row's last valid token (``logits_at`` [R]: of those rows only, ``[R, V]``). A packed
    call is ``T = 1``: each token its own row (its own table row and position).
  * ``decode(params, tokens_B, kv, active_B, attend_len=) -> (logits_BV, kv)``: one token per
    active row at position ``kv.lengths[b]``.
  * Both take ``lora`` (``models.lora.LoraBatch``): each token's adapter; a step that cannot
    run adapters raises ``ValueError`` when given one.
  * ``place_params`` / ``param_sharding(path, sds)``: the step's resident layout, per param (what
    ``models.io.placement`` loaders make params straight into); ``stacked_params``: it wants
    ``models.weights.stack_layers``' form (the unsharded step adds ``tile_params``' copies where
    its backend has the tiled kernel). ``init_kv(...)``: an empty placed pool (``sink_pool``
    for attention sinks, or ``ValueError``). ``describe()``: JSON-able. ``kv_shards``: sub-pools
    of the page axis; row ``r`` of a call runs on shard ``r // (R / kv_shards)``.
``UnshardedStep`` is the single-device model; the partitioned one is in ``partitioning/``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from models import transformer
from models.config import ModelConfig
from models.cpu.backend import CpuBackend
from models.lora import LoraBatch
from models.paged_kv import PagedKV, init_paged
from models.weights import Params, is_stacked, stack_layers, tile_params


class Step(Protocol):
  @property
  def cfg(self) -> ModelConfig: ...

  @property
  def stacked_params(self) -> bool: ...

  @property
  def kv_shards(self) -> int: ...

  def prefill(self, params: Params, tokens_BT: jax.Array, kv: PagedKV, start_B: jax.Array,
              lens_B: jax.Array, *, attend_len: int, logits_at: jax.Array | None = None,
              lora: LoraBatch | None = None) -> tuple[jax.Array, PagedKV]: ...

  def decode(self, params: Params, tokens_B: jax.Array, kv: PagedKV, active_B: jax.Array, *,
             attend_len: int, lora: LoraBatch | None = None) -> tuple[jax.Array, PagedKV]: ...

  def place_params(self, params: Params) -> Params: ...

  def param_sharding(self, path: str, sds: jax.ShapeDtypeStruct) -> jax.sharding.Sharding: ...

  def init_kv(self, batch: int, num_pages: int, page_size: int, pages_per_seq: int,
              dtype: jnp.dtype, sink_pool: bool = False) -> PagedKV: ...

  def describe(self) -> dict[str, object]: ...


# Moves pages (source pool, destination pool, source page ids, destination page ids) -> destination.
Transfer = Callable[[PagedKV, PagedKV, np.ndarray, np.ndarray], PagedKV]


@dataclasses.dataclass(frozen=True)
class PhaseDecode:
  """Decode in its own step: with ``transfer``, also in its own pool (a re-laid KV sharding or
  another mesh), into which ``transfer`` moves prefilled pages; without, over the prefill pool
  (one mesh, the same KV sharding and stored weights: the paper's one copy of the weights with
  a compute layout per phase)."""
  step: Step
  transfer: Transfer | None = None


@dataclasses.dataclass(frozen=True)
class UnshardedStep:
  """The model on one device; ``scan_layers``: params stacked (``models.weights.stack_layers``),
  every program one ``lax.scan`` over the layers (compile time independent of depth);
  ``backend``: how XLA:CPU computes it (static: the step and its pools carry it into every
  jit key; default: XLA only, see ``models.cpu.backend``)."""
  cfg: ModelConfig
  scan_layers: bool = False
  backend: CpuBackend = CpuBackend()

  def prefill(self, params, tokens_BT, kv, start_B, lens_B, *, attend_len, logits_at=None,
              lora=None):
    return transformer.prefill(params, tokens_BT, kv, start_B, lens_B, cfg=self.cfg,
                               attend_len=attend_len, backend=self.backend, logits_at=logits_at,
                               lora=lora)

  def decode(self, params, tokens_B, kv, active_B, *, attend_len, lora=None):
    return transformer.decode_step(params, tokens_B, kv, cfg=self.cfg, attend_len=attend_len,
                                   active_B=active_B, backend=self.backend, lora=lora)

  @property
  def stacked_params(self) -> bool:
    return self.scan_layers

  @property
  def kv_shards(self) -> int:
    return 1

  def place_params(self, params: Params) -> Params:
    if self.scan_layers and not is_stacked(params):
      params = jax.jit(stack_layers)(params)
    params = jax.device_put(params, jax.local_devices()[0])
    be = self.backend
    pairs = be.tiled and be.policy.tiles_pairs
    amx_tiles = be.amx and be.policy.amx_tiled_max_rows > 0  # bf16 copies AMX reads as tiles
    amx_quads = be.amx and be.policy.amx_w8_max_rows > 0  # weight-only int8: AMX int8 tiles
    w8a8 = be.tiled_w8a8 and be.policy.tiled_w8a8_max_rows > 0
    if pairs or amx_tiles or amx_quads or w8a8:
      params = tile_params(params, self.cfg, pairs=pairs or amx_tiles, w8a8=w8a8,
                           int8=pairs and be.policy.tiled_int8_max_rows > 0,
                           int8_quads=amx_quads)
    return params

  def param_sharding(self, path: str, sds: jax.ShapeDtypeStruct) -> jax.sharding.Sharding:
    del path, sds
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def init_kv(self, batch, num_pages, page_size, pages_per_seq, dtype, sink_pool=False
              ) -> PagedKV:
    return jax.jit(init_paged, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7))(
        self.cfg, batch, num_pages, page_size, pages_per_seq, dtype, sink_pool, self.backend)

  def describe(self) -> dict[str, object]:
    dev = jax.local_devices()[0]
    return {"kind": "unsharded", "device": f"{dev.platform}:{dev.id}", "model": self.cfg.name,
            "layers": "scan" if self.scan_layers else "unrolled"}
