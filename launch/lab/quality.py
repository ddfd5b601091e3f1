"""Quality of a model (and of its lower-precision variants) on real text.

Contract:
  * ``make_variants(params, cfg, names, calibration=None)`` builds the named precision variants
    of float params: ``f32``, ``bf16`` (params and activations in bf16), ``int8`` (weight-only
    int8, f32 activations: the default int8 policy), ``w8a8`` (``--int8_mode w8a8`` as served:
    smoothed on ``calibration``'s token ids (``models.smooth``), per-token int8 activations, the
    unembedding weight-only) and ``w8a8_raw`` (every matmul W8A8, nothing smoothed). A name
    with the suffix ``+kv8`` (``f32+kv8``, ``int8+kv8``, ...) is the base variant run over an
    int8 KV cache (``models.paged_kv`` int8 pages: per-token, per-head
    scales); ``kv_dtype_of(name)`` says which cache a name runs over.
  * ``compare(variants, docs, cfg)`` scores each named params variant on every token of every
    document (a list of token-id lists, each scored from position 0 with no context carried
    over) and compares its next-token distributions with the FIRST variant's (the reference,
    normally float32). Returns ``{name: VariantQuality}`` with
      ``perplexity``  exp(mean negative log-likelihood of each next token),
      ``kl``          mean KL(reference || variant) per predicted position (nats),
      ``top1``        fraction of positions whose argmax equals the reference's,
      ``tokens``      the number of predicted positions (sum over docs of len - 1).
  * The documents are one ragged batch: one prefill per variant with every position's logits
    (``all_logits=True``), padded to a multiple of 64 tokens, so each variant compiles once; all
    metrics are reduced on the device (only scalars reach the host).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import precision
from models.config import ModelConfig
from models.kv_cache import init_cache
from models.paged_kv import init_paged
from models.transformer import prefill
from models.weights import Params, quantize

VARIANTS = ("f32", "bf16", "int8", "w8a8", "w8a8_raw")


@dataclasses.dataclass(frozen=True)
class VariantQuality:
  perplexity: float
  kl: float
  top1: float
  tokens: int

  def to_json(self) -> dict[str, float]:
    return dataclasses.asdict(self)


KV8 = "+kv8"


def kv_dtype_of(name: str) -> str | None:
  """``"int8"`` for a ``+kv8`` variant, else None (the activation dtype's cache)."""
  return "int8" if name.endswith(KV8) else None


def make_variants(params: Params, cfg: ModelConfig, names: Sequence[str] = VARIANTS,
                  calibration: Sequence[int] | None = None) -> dict[str, Params]:
  f32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  built: dict[str, Params] = {}  # base variant -> params (shared by its +kv8 twin)

  def base(name: str) -> Params:
    if name not in built:
      if name == "f32":
        built[name] = f32
      elif name == "bf16":
        built[name] = jax.tree.map(lambda a: a.astype(jnp.bfloat16), f32)
      elif name in ("int8", "w8a8_raw"):
        built[name] = quantize(f32, cfg, act_quant=name == "w8a8_raw")
      elif name == "w8a8":
        built[name] = precision.apply(f32, cfg, "int8", "w8a8", calibration=calibration)
      else:
        raise ValueError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)}, each "
                         f"optionally with {KV8})")
    return built[name]

  return {full: base(full.removesuffix(KV8)) for full in names}


_KV8_PAGE = 64


@functools.partial(jax.jit, static_argnames=("cfg", "kv_dtype"))
def _log_probs(params: Params, tokens_BT: jax.Array, lens_B: jax.Array, *, cfg: ModelConfig,
               kv_dtype: str | None = None) -> jax.Array:
  """Log-softmax of every position's next-token logits: [B, T, V] f32."""
  b, t = tokens_BT.shape
  if kv_dtype == "int8":  # an int8 paged pool, row b on pages [b * M, (b + 1) * M)
    m = -(-t // _KV8_PAGE)
    cache = init_paged(cfg, b, b * m, _KV8_PAGE, m, jnp.int8).replace(
        page_table=jnp.arange(b * m, dtype=jnp.int32).reshape(b, m))
  else:
    cache = init_cache(cfg, b, t, params["final_norm"].dtype)
  logits_BTV, _ = prefill(params, tokens_BT, cache, jnp.zeros((b,), jnp.int32), lens_B,
                          cfg=cfg, attend_len=t, all_logits=True)
  return jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)


@jax.jit
def _scores(logp_BTV: jax.Array, ref_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sums over valid positions: (nll, KL(ref || logp), argmax agreements)."""
  nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  kl_BT = jnp.sum(jnp.exp(ref_BTV) * (ref_BTV - logp_BTV), axis=-1)
  agree_BT = jnp.argmax(logp_BTV, axis=-1) == jnp.argmax(ref_BTV, axis=-1)
  m = mask_BT.astype(jnp.float32)
  return jnp.sum(nll_BT * m), jnp.sum(kl_BT * m), jnp.sum(agree_BT * m)


def compare(variants: Mapping[str, Params], docs: Sequence[Sequence[int]], cfg: ModelConfig,
            *, pad_multiple: int = 64) -> dict[str, VariantQuality]:
  """All documents go through one ragged prefill per variant, padded to a multiple of
  ``pad_multiple`` (one compiled program per variant)."""
  if not variants:
    raise ValueError("no variants to compare")
  docs = [list(d) for d in docs if len(d) >= 2]
  if not docs:
    raise ValueError("no document has two or more tokens")
  longest = max(len(d) for d in docs)
  if longest > cfg.max_seq_len:
    raise ValueError(f"a document has {longest} tokens, more than the context "
                     f"({cfg.max_seq_len})")
  t = -(-longest // pad_multiple) * pad_multiple
  toks = np.zeros((len(docs), t), np.int32)
  targets = np.zeros((len(docs), t), np.int32)
  mask = np.zeros((len(docs), t), bool)
  for i, d in enumerate(docs):
    toks[i, :len(d)] = d
    targets[i, :len(d) - 1] = d[1:]
    mask[i, :len(d) - 1] = True
  lens = jnp.asarray([len(d) for d in docs], jnp.int32)
  total = int(mask.sum())
  out: dict[str, VariantQuality] = {}
  ref = None
  for name, params in variants.items():
    logp = _log_probs(params, jnp.asarray(toks), lens, cfg=cfg, kv_dtype=kv_dtype_of(name))
    ref = logp if ref is None else ref
    nll, kl, agree = (float(v) for v in _scores(logp, ref, jnp.asarray(targets),
                                                  jnp.asarray(mask)))
    out[name] = VariantQuality(perplexity=math.exp(nll / total), kl=kl / total,
                               top1=agree / total, tokens=total)
    del logp
  return out
