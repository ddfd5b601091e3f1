"""The compute policy of int8 weights, decided once, at load time, in one place.

Contract:
  * ``Int8Mode``: ``weight_only`` (int8 weights, activations in the float dtype; the scales
    applied to the f32 sums) or ``w8a8`` (the layers' activations quantized per token to int8
    too: an int8 x int8 -> int32 dot, the fastest CPU kernel, at a quality cost on trained models
    that smoothing (``models.smooth``) cuts; the unembedding stays weight-only: ``W8A8_KEEP``).
  * ``default_int8_mode(backend)``: ``weight_only`` on every backend (why: BUILD_NOTES.md, the
    int8 quality table).
  * ``apply(params, cfg, quantize, int8_mode=None, backend=None, calibration=None)``: float
    params -> the params to serve, unchanged or int8 with the mode's ``act_quant`` on every
    ``QuantArray`` (int8 checkpoints are re-flagged to the mode chosen here). W8A8 from float
    params with ``calibration`` (token ids) smooths them first (``models.smooth``).
  * ``calibration_text()``: the project's calibration text (``models/data/calibration.txt``).
  * ``int8_mode_of(params)``: the mode int8 params carry (None for float params), read from the
    layers' weights.
This is the only place that decides ``act_quant``; callers pass the user's choice through.
"""

from __future__ import annotations

import importlib.resources
from typing import Literal, Sequence

import jax

from models import smooth
from models.config import ModelConfig
from models.quant import QuantArray
from models.weights import Params, quantize as quantize_params

Int8Mode = Literal["weight_only", "w8a8"]
INT8_MODES: tuple[Int8Mode, ...] = ("weight_only", "w8a8")
Quantize = Literal["none", "int8"]
W8A8_KEEP = ("embed", "unembed")  # weight-only in W8A8 mode: the vocabulary-wide products


def calibration_text() -> str:
  return importlib.resources.files("models").joinpath("data", "calibration.txt").read_text()


def default_int8_mode(backend: str | None = None) -> Int8Mode:
  del backend  # the same on every backend today; see the module contract
  return "weight_only"


def _is_quant(x: object) -> bool:
  return isinstance(x, QuantArray)


def set_int8_mode(params: Params, mode: Int8Mode) -> Params:
  def flag(act_quant: bool, tree):
    return jax.tree.map(lambda q: q.replace(act_quant=act_quant) if _is_quant(q) else q, tree,
                        is_leaf=_is_quant)

  w8a8 = mode == "w8a8"
  return {k: flag(w8a8 and k not in W8A8_KEEP, v) for k, v in params.items()}


def int8_mode_of(params: Params) -> Int8Mode | None:
  flags = {q.act_quant for q in jax.tree.leaves(params["layers"], is_leaf=_is_quant)
           if _is_quant(q)}
  if not flags:
    return None
  if len(flags) > 1:
    raise ValueError("params mix weight-only and W8A8 int8 weights")
  return "w8a8" if flags.pop() else "weight_only"


def apply(params: Params, cfg: ModelConfig, quantize: Quantize,
          int8_mode: Int8Mode | None = None, backend: str | None = None,
          calibration: Sequence[int] | None = None) -> Params:
  if quantize not in ("none", "int8"):
    raise ValueError(f"quantize must be 'none' or 'int8', got {quantize!r}")
  if int8_mode is not None and int8_mode not in INT8_MODES:
    raise ValueError(f"int8 mode must be one of {', '.join(INT8_MODES)}, got {int8_mode!r}")
  mode = int8_mode or default_int8_mode(backend or jax.default_backend())
  already = int8_mode_of(params) is not None
  if quantize == "none" and not already:
    return params
  if not already:
    if mode == "w8a8" and calibration is not None:
      params = smooth.smooth_for_w8a8(params, cfg, calibration)
    params = jax.jit(lambda p: quantize_params(p, cfg))(params)
  return set_int8_mode(params, mode)
