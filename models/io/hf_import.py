"""Import a local Hugging Face checkpoint (Llama family, Gemma v1) into our params layout.

Contract: ``load_hf_checkpoint(path, dtype=jnp.float32, *, shardings=None, quantize=False,
stacked=False, progress=None) -> (ModelConfig, params)`` reads ``config.json`` and safetensors
weights (one file, any ``*.safetensors``, or an index of shards) of ``LlamaForCausalLM``,
``MistralForCausalLM`` or ``GemmaForCausalLM`` (v1). The config goes through
``models.config.from_hf_config``; ``params`` follows ``models.weights`` exactly.
Each array is made straight in its sharding from ``shardings`` (a ``models.io.placement.Target``),
reading only the slices this process's devices hold, one shard at a time. ``quantize=True`` gives
int8 ``QuantArray`` matmul weights equal to ``models.weights.quantize`` of the float load;
``stacked=True`` gives ``stack_layers``' form; ``progress`` gets ``placement.Progress``.
Torch's ``[out, in]`` tensors are transposed and split head-major into our shapes (the mapping:
BUILD_NOTES "Design: Checkpoints"). Read with numpy via ``safetensors`` (no torch). Every
problem is a ``ValueError`` naming the file or tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Callable, Iterable, cast

import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding
from safetensors import safe_open

from models.io import placement
from models.config import ModelConfig, from_hf_config
from models.io.placement import Index, Progress, Target
from models.quant import INV_127, QuantArray
from models.weights import Params

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "GemmaForCausalLM")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Stored by some exporters but recomputed by us (and by transformers); safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_config(root: Path) -> dict:
  cfg_path = root / "config.json"
  if not cfg_path.is_file():
    raise ValueError(f"{root}: no config.json (not a Hugging Face checkpoint directory?)")
  try:
    hf = json.loads(cfg_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{cfg_path}: invalid JSON: {e}") from None
  if not isinstance(hf, dict):
    raise ValueError(f"{cfg_path}: expected a JSON object")
  archs = hf.get("architectures") or []
  known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
  if archs and not known:
    raise ValueError(f"{cfg_path}: unsupported architecture(s) {archs} "
                     f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
  if not archs and hf.get("model_type") not in ("llama", "mistral", "gemma"):
    raise ValueError(f"{cfg_path}: no 'architectures' and unsupported model_type "
                     f"{hf.get('model_type')!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
  if known == ["GemmaForCausalLM"] and hf.get("model_type") not in (None, "gemma"):
    raise ValueError(f"{cfg_path}: GemmaForCausalLM with model_type {hf.get('model_type')!r}")
  return hf


def _tensor_files(root: Path) -> dict[str, Path]:
  """Tensor name -> safetensors file holding it."""
  index = root / _INDEX
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index}: not a safetensors index ({e!r})") from None
    files = {name: root / fname for name, fname in weight_map.items()}
    missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
    if missing:
      raise ValueError(f"{index} lists shard(s) missing from {root}: {', '.join(missing)}")
    return files
  paths = [root / _SINGLE] if (root / _SINGLE).is_file() else sorted(root.glob("*.safetensors"))
  if not paths:
    present = ", ".join(sorted(p.name for p in root.iterdir())) or "nothing"
    raise ValueError(
        f"{root}: no *.safetensors weights and no {_INDEX} (found: {present}); "
        "re-save .bin / .pth checkpoints with save_pretrained(safe_serialization=True)")
  files = {}
  for p in paths:
    with safe_open(p, framework="numpy") as f:
      for name in f.keys():
        if name in files:
          raise ValueError(f"tensor {name!r} is in both {files[name].name} and {p.name}")
        files[name] = p
  return files


class _Reader:
  """Reads slices of tensors on demand (``safe_open(...).get_slice``: only the bytes asked for
  are copied out of the memory-mapped file), one open handle per file; counts the bytes read."""

  def __init__(self, files: dict[str, Path]):
    self.files = files
    self.used: set[str] = set()
    self.bytes_read = 0
    self._handles: dict[Path, object] = {}

  def _handle(self, name: str):
    path = self.files[name]
    if path not in self._handles:
      self._handles[path] = safe_open(path, framework="numpy")
    return self._handles[path]

  def check(self, name: str, shape: tuple[int, ...]) -> None:
    """``ValueError`` unless the checkpoint holds ``name`` with ``shape`` (reads no data)."""
    if name not in self.files:
      raise ValueError(f"missing tensor {name!r} (expected shape {shape}); "
                       f"checkpoint holds {len(self.files)} tensors")
    try:
      got = tuple(self._handle(name).get_slice(name).get_shape())
    except Exception as e:  # safetensors raises its own error types
      raise ValueError(f"{self.files[name].name}: cannot read tensor {name!r}: {e}") from None
    if got != shape:
      raise ValueError(f"tensor {name!r} in {self.files[name].name} has shape {got}, but "
                       f"config.json implies {shape}")
    self.used.add(name)

  def read(self, name: str, index: Index) -> np.ndarray:
    """``tensor[index]`` (one ``(start, stop)`` per axis) as a new host array."""
    try:
      arr = self._handle(name).get_slice(name)[tuple(slice(a, b) for a, b in index)]
    except Exception as e:  # safetensors raises its own error types
      raise ValueError(f"{self.files[name].name}: cannot read tensor {name!r}: {e}") from None
    self.bytes_read += arr.nbytes
    return arr

  def close(self) -> None:
    for h in self._handles.values():
      exit_ = getattr(h, "__exit__", None)
      if exit_ is not None:
        exit_(None, None, None)
    self._handles.clear()


@dataclasses.dataclass(frozen=True)
class _Source:
  """Where one of our weights lives in the file. A torch tensor is ``[out, in]`` (1D: ``[out]``);
  our weight is it reshaped to our ``out_axes`` sizes then ``in_axes`` sizes (row-major: HF splits
  ``out = n * H + h``) and transposed to our axis order; a matmul weight's contracted axes are
  its ``in_axes``, so int8 scales are per file row."""
  name: str
  shape: tuple[int, ...]  # ours
  out_axes: tuple[int, ...]
  in_axes: tuple[int, ...] = ()

  @property
  def file_shape(self) -> tuple[int, ...]:
    dims = [math.prod(self.shape[a] for a in self.out_axes)]
    return tuple(dims + ([math.prod(self.shape[a] for a in self.in_axes)] if self.in_axes else []))

  def _group(self, axes: tuple[int, ...], index: Index) -> tuple[tuple[int, int], list[int],
                                                                 list[slice]]:
    """The file range covering ``index`` on a group of our axes, the block's dims, and the
    slices that cut ``index`` out of it (only needed when an inner axis is itself cut)."""
    (a0, b0), inner = index[axes[0]], math.prod(self.shape[a] for a in axes[1:])
    dims = [b0 - a0] + [self.shape[a] for a in axes[1:]]
    return (a0 * inner, b0 * inner), dims, [slice(None)] + [slice(*index[a]) for a in axes[1:]]

  def _order(self) -> list[int]:
    grouped = list(self.out_axes + self.in_axes)
    return [grouped.index(a) for a in range(len(self.shape))]

  def read(self, reader: _Reader, index: Index, dtype: np.dtype) -> np.ndarray:
    """Our ``weight[index]`` in ``dtype``: reads only the file block that covers it."""
    rows, out_dims, out_cut = self._group(self.out_axes, index)
    file_index = [rows]
    dims, cut = out_dims, out_cut
    if self.in_axes:
      cols, in_dims, in_cut = self._group(self.in_axes, index)
      file_index.append(cols)
      dims, cut = dims + in_dims, cut + in_cut
    block = reader.read(self.name, tuple(file_index)).reshape(dims)[tuple(cut)]
    view = block.transpose(self._order())
    out = np.empty(view.shape, dtype)
    np.copyto(out, view, casting="unsafe")  # one pass: the transpose and the cast
    return out

  def row_amax(self, reader: _Reader, rows: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """max |w| per file row (= per output channel) over the whole row, after the cast to
    ``dtype`` (as ``quantize`` sees the loaded weight), read in bounded chunks."""
    width = self.file_shape[1]
    step = max(1, _CHUNK_ELEMENTS // width)
    out = np.empty((rows[1] - rows[0],), np.float32)
    for r in range(rows[0], rows[1], step):
      stop = min(rows[1], r + step)
      piece = reader.read(self.name, ((r, stop), (0, width))).astype(dtype).astype(np.float32)
      out[r - rows[0]:stop - rows[0]] = np.max(np.abs(piece), axis=1)
    return out

  def scale(self, reader: _Reader, index: Index, dtype: np.dtype,
            cache: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    """The int8 scale of our ``weight[index]``'s output channels, shaped ``[..out.., 1 ..in..]``
    in our axis order (``models.quant.quantize_array``: amax / 127, 1 where amax is 0)."""
    rows, out_dims, out_cut = self._group(self.out_axes, index)
    if rows not in cache:
      amax = self.row_amax(reader, rows, dtype)
      # amax * INV_127 and w * (1 / scale) below: quantize_array's own arithmetic, so the
      # values are bit-equal to it.
      cache[rows] = np.where(amax > 0, amax * INV_127, np.float32(1.0)).astype(np.float32)
    s = cache[rows].reshape(out_dims)[tuple(out_cut)]
    s = s.reshape(s.shape + (1,) * len(self.in_axes))
    return np.ascontiguousarray(s.transpose(self._order()))

  def quant(self, reader: _Reader, index: Index, dtype: np.dtype,
            cache: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    w = self.read(reader, index, dtype).astype(np.float32, copy=False)
    w *= np.float32(1.0) / self.scale(reader, index, dtype, cache)  # in place: one f32 shard
    np.round(w, out=w)
    np.clip(w, -127, 127, out=w)
    return w.astype(np.int8)


_CHUNK_ELEMENTS = 1 << 20  # row_amax reads at most this many elements (4 MB in f32) at a time


def _sources(cfg: ModelConfig) -> dict[str, _Source]:
  """Our weight path (``placement.WeightRef.path``) -> its place in the file."""
  d, n, k, h, f, v = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
                      cfg.vocab_size)
  out = {"['embed']": _Source("model.embed_tokens.weight", (v, d), (0,), (1,)),
         "['final_norm']": _Source("model.norm.weight", (d,), (0,))}
  if not cfg.tie_embeddings:
    out["['unembed']"] = _Source("lm_head.weight", (d, v), (1,), (0,))
  for i in range(cfg.num_layers):
    p, q = f"model.layers.{i}.", f"['layers'][{i}]"
    out.update({
        q + "['attn_norm']": _Source(p + "input_layernorm.weight", (d,), (0,)),
        q + "['mlp_norm']": _Source(p + "post_attention_layernorm.weight", (d,), (0,)),
        q + "['q']": _Source(p + "self_attn.q_proj.weight", (d, n, h), (1, 2), (0,)),
        q + "['k']": _Source(p + "self_attn.k_proj.weight", (d, k, h), (1, 2), (0,)),
        q + "['v']": _Source(p + "self_attn.v_proj.weight", (d, k, h), (1, 2), (0,)),
        q + "['o']": _Source(p + "self_attn.o_proj.weight", (n, h, d), (2,), (0, 1)),
        q + "['gate']": _Source(p + "mlp.gate_proj.weight", (d, f), (1,), (0,)),
        q + "['up']": _Source(p + "mlp.up_proj.weight", (d, f), (1,), (0,)),
        q + "['down']": _Source(p + "mlp.down_proj.weight", (f, d), (1,), (0,)),
    })
  return out


def _unexpected(names: Iterable[str], used: set[str], tied: bool) -> list[str]:
  out = []
  for name in names:
    if name in used or name.endswith(_IGNORED_SUFFIXES):
      continue
    if tied and name == "lm_head.weight":  # some exporters store the tied copy too
      continue
    out.append(name)
  return sorted(out)


def load_hf_checkpoint(path: str | os.PathLike, dtype=jnp.float32, *, name: str | None = None,
                       shardings: Target = None, quantize: bool = False, stacked: bool = False,
                       progress: Callable[[Progress], None] | None = None
                       ) -> tuple[ModelConfig, Params]:
  """Loads ``path`` (a local HF checkpoint directory) as ``(ModelConfig, params)`` in ``dtype``,
  each array straight into its sharding (see the module contract)."""
  root = Path(path)
  if not root.is_dir():
    raise ValueError(f"Hugging Face checkpoint directory {str(root)!r} does not exist "
                     "(pass a local directory with config.json and *.safetensors)")
  hf = _read_config(root)
  cfg = from_hf_config(hf, name=name or root.name)
  if cfg.parallel_block:  # from_hf_config never sets it; the layer mapping assumes serial blocks
    raise ValueError("parallel-block checkpoints are not supported")
  reader = _Reader(_tensor_files(root))
  sources = _sources(cfg)
  np_dtype = np.dtype(dtype)
  try:
    for src in sources.values():  # every name and shape checked before anything is read
      reader.check(src.name, src.file_shape)
    extra = _unexpected(reader.files, reader.used, cfg.tie_embeddings)
    if extra:
      shown = ", ".join(extra[:8]) + (f", ... ({len(extra)} in all)" if len(extra) > 8 else "")
      raise ValueError(f"{root}: unexpected tensors not used by {cfg.name} "
                       f"({cfg.num_layers} layers per config.json): {shown}")

    def make(ref: placement.WeightRef, where: placement.Placement, on_bytes):
      src = sources[ref.path]
      if not isinstance(where, QuantArray):
        return placement.from_host(src.shape, np_dtype, where,
                                   lambda i: src.read(reader, i, np_dtype), on_bytes)
      scales: dict[tuple[int, int], np.ndarray] = {}  # this weight's, per file row range
      # ``where`` is a QuantArray of shardings (a placement.Placement), not of arrays
      quant_s, scale_s = cast(Sharding, where.quant), cast(Sharding, where.scale)
      quant = placement.from_host(src.shape, np.int8, quant_s,
                                  lambda i: src.quant(reader, i, np_dtype, scales), on_bytes)
      scale_shape = tuple(1 if a in src.in_axes else s for a, s in enumerate(src.shape))
      scale = placement.from_host(scale_shape, np.float32, scale_s,
                                  lambda i: src.scale(reader, i, np_dtype, scales), on_bytes)
      return QuantArray(quant=quant, scale=scale)

    params = placement.build(cfg, dtype, shardings, make, quantized=quantize, stacked=stacked,
                             progress=progress, read_bytes=lambda: reader.bytes_read)
  finally:
    reader.close()
  return cfg, params


__all__ = ["SUPPORTED_ARCHITECTURES", "load_hf_checkpoint"]
