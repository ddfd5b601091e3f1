"""Quality of a model (and of its lower-precision variants) on real text.

Contract:
  * ``read_passages(path)`` splits a text file into passages at lines holding only ``===``.
  * ``make_variants(params, cfg, names)`` builds the named precision variants of float params:
    ``f32``, ``bf16`` (params and activations in bf16), ``int8`` (weight-only int8, f32
    activations: the GPU/TPU policy) and ``w8a8`` (int8 weights and per-token int8 activations:
    the CPU policy).
  * ``compare(variants, docs, cfg)`` scores each named params variant on every token of every
    document (a list of token-id lists, each scored from position 0 with no context carried
    over) and compares its next-token distributions with the FIRST variant's (the reference,
    normally float32). Returns ``{name: VariantQuality}`` with
      ``perplexity``  exp(mean negative log-likelihood of each next token),
      ``kl``          mean KL(reference || variant) per predicted position (nats),
      ``top1``        fraction of positions whose argmax equals the reference's,
      ``tokens``      the number of predicted positions (sum over docs of len - 1).
  * Each document is one prefill with every position's logits (``all_logits=True``), padded to a
    power-of-two bucket, so a variant compiles once per bucket; all metrics are reduced on the
    device (only scalars reach the host).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.kv_cache import init_cache
from models.transformer import bucket, prefill
from models.weights import Params, quantize

VARIANTS = ("f32", "bf16", "int8", "w8a8")


@dataclasses.dataclass(frozen=True)
class VariantQuality:
  perplexity: float
  kl: float
  top1: float
  tokens: int

  def to_json(self) -> dict[str, float]:
    return dataclasses.asdict(self)


def read_passages(path: str | Path) -> list[str]:
  text = Path(path).read_text(encoding="utf-8")
  parts, current = [], []
  for line in text.splitlines():
    if line.strip() == "===":
      parts.append("\n".join(current).strip())
      current = []
    else:
      current.append(line)
  parts.append("\n".join(current).strip())
  return [p for p in parts if p]


def make_variants(params: Params, cfg: ModelConfig, names: Sequence[str] = VARIANTS
                  ) -> dict[str, Params]:
  f32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  out: dict[str, Params] = {}
  for name in names:
    if name == "f32":
      out[name] = f32
    elif name == "bf16":
      out[name] = jax.tree.map(lambda a: a.astype(jnp.bfloat16), f32)
    elif name in ("int8", "w8a8"):
      out[name] = quantize(f32, cfg, act_quant=name == "w8a8")
    else:
      raise ValueError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
  return out


@functools.partial(jax.jit, static_argnames=("cfg",))
def _log_probs(params: Params, tokens_1T: jax.Array, n_valid: jax.Array, *, cfg: ModelConfig
               ) -> jax.Array:
  """Log-softmax of every position's next-token logits: [T, V] f32."""
  t = tokens_1T.shape[1]
  cache = init_cache(cfg, 1, t, params["final_norm"].dtype)
  logits_1TV, _ = prefill(params, tokens_1T, cache, jnp.zeros((1,), jnp.int32), n_valid,
                          cfg=cfg, attend_len=t, all_logits=True)
  return jax.nn.log_softmax(logits_1TV[0].astype(jnp.float32), axis=-1)


@jax.jit
def _scores(logp_TV: jax.Array, ref_TV: jax.Array, targets_T: jax.Array, mask_T: jax.Array
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sums over valid positions: (nll, KL(ref || logp), argmax agreements)."""
  nll_T = -jnp.take_along_axis(logp_TV, targets_T[:, None], axis=1)[:, 0]
  kl_T = jnp.sum(jnp.exp(ref_TV) * (ref_TV - logp_TV), axis=-1)
  agree_T = jnp.argmax(logp_TV, axis=-1) == jnp.argmax(ref_TV, axis=-1)
  m = mask_T.astype(jnp.float32)
  return jnp.sum(nll_T * m), jnp.sum(kl_T * m), jnp.sum(agree_T * m)


def compare(variants: Mapping[str, Params], docs: Sequence[Sequence[int]], cfg: ModelConfig
            ) -> dict[str, VariantQuality]:
  if not variants:
    raise ValueError("no variants to compare")
  names = list(variants)
  sums = {n: np.zeros(3) for n in names}
  total = 0
  for doc in docs:
    n = len(doc)
    if n < 2:
      continue
    if n > cfg.max_seq_len:
      raise ValueError(f"a document has {n} tokens, more than the context ({cfg.max_seq_len})")
    t = bucket(n, maximum=max(cfg.max_seq_len, n))
    toks = np.zeros((1, t), np.int32)
    toks[0, :n] = doc
    targets = np.zeros((t,), np.int32)
    targets[:n - 1] = doc[1:]
    mask = np.arange(t) < n - 1
    ref = None
    for name in names:
      logp = _log_probs(variants[name], jnp.asarray(toks), jnp.asarray([n], jnp.int32), cfg=cfg)
      ref = logp if ref is None else ref
      sums[name] += np.array([float(v) for v in _scores(logp, ref, jnp.asarray(targets),
                                                        jnp.asarray(mask))])
    total += n - 1
  if total == 0:
    raise ValueError("no document has two or more tokens")
  return {name: VariantQuality(perplexity=math.exp(s[0] / total), kl=float(s[1] / total),
                               top1=float(s[2] / total), tokens=total)
          for name, s in sums.items()}
