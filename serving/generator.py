"""Batch generation for the CLI and benchmarks: chunked prefill, then a jitted multi-step decode.

Contract: ``Generator(cfg, params).stream(prompts, max_tokens, sampling)`` yields, per step, a
numpy int32 array with the next token of every prompt (``-1`` once a row has stopped); rows stop at
``max_tokens`` or at a stop id. Shapes are padded to power-of-two buckets (prompt chunk length,
attention length) so a new request length reuses compiled code. Decoding runs ``steps_per_call``
steps inside one jitted ``fori_loop`` (tokens reach the host in small bursts). This is not the
continuous-batching engine (``serving/engine.py``): a batch here starts and ends together, and
penalties / logit bias (``serving.penalties``, the engine's) are refused.
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.cpu.backend import CpuBackend
from models.kv_cache import KVCache, init_cache
from models.transformer import bucket, decode_step, prefill
from models.weights import Params
from serving.sampling import SamplingArrays, SamplingParams, sample


@functools.partial(jax.jit, static_argnames=("cfg", "attend_len", "greedy_only", "valid_vocab"),
                   donate_argnames=("cache",))
def prefill_and_sample(params: Params, tokens_BT: jax.Array, cache: KVCache, lens_B: jax.Array,
                       s: SamplingArrays, *, cfg: ModelConfig, attend_len: int,
                       greedy_only: bool, valid_vocab: int | None = None
                       ) -> tuple[jax.Array, KVCache]:
  """Prefills one chunk (continuing each row at its cache length); samples the next token."""
  logits_BV, cache = prefill(params, tokens_BT, cache, None, lens_B, cfg=cfg,
                             attend_len=attend_len, backend=cache.backend)
  return sample(logits_BV[:, :valid_vocab], cache.lengths, s, greedy_only), cache


@functools.partial(jax.jit,
                   static_argnames=("cfg", "n", "attend_len", "greedy_only", "valid_vocab"),
                   donate_argnames=("cache",))
def decode_n(params: Params, tokens_B: jax.Array, cache: KVCache, s: SamplingArrays, *,
             cfg: ModelConfig, n: int, attend_len: int, greedy_only: bool,
             valid_vocab: int | None = None
             ) -> tuple[jax.Array, KVCache]:
  """``n`` decode steps in one call; returns (tokens [n, B], cache)."""
  def body(i, carry):
    tok_B, cache, out_NB = carry
    logits_BV, cache = decode_step(params, tok_B, cache, cfg=cfg, attend_len=attend_len,
                                   backend=cache.backend)
    nxt_B = sample(logits_BV[:, :valid_vocab], cache.lengths, s, greedy_only)
    return nxt_B, cache, out_NB.at[i].set(nxt_B)

  out_NB = jnp.zeros((n, tokens_B.shape[0]), jnp.int32)
  _, cache, out_NB = jax.lax.fori_loop(0, n, body, (tokens_B, cache, out_NB))
  return out_NB, cache


class Generator:
  """Generates for a fixed batch of prompts with one model."""

  def __init__(self, cfg: ModelConfig, params: Params, *, max_len: int | None = None,
               prefill_chunk: int = 512, steps_per_call: int = 8, min_batch: int = 1,
               valid_vocab: int | None = None, backend: CpuBackend = CpuBackend()):
    """``backend``: how XLA:CPU runs the model (resolved at start-up; the cache carries it).
    ``steps_per_call`` is rounded down to a power of two per call (few compiled variants);
    ``valid_vocab`` limits sampling to ids below it (a tokenizer smaller than the embedding)."""
    if prefill_chunk < 1 or steps_per_call < 1 or min_batch < 1:
      raise ValueError("prefill_chunk, steps_per_call and min_batch must be >= 1")
    self.cfg = cfg
    self.valid_vocab = min(valid_vocab or cfg.vocab_size, cfg.vocab_size)
    self.params = params
    self.max_len = max_len or cfg.max_seq_len
    self.prefill_chunk = prefill_chunk
    self.steps_per_call = steps_per_call
    self.min_batch = min_batch  # pad the batch (XLA:CPU int8 dots want >= 8 rows)
    self.dtype = params["final_norm"].dtype
    self.backend = backend

  def check_lengths(self, prompt_len: int, max_tokens: int) -> None:
    if prompt_len < 1:
      raise ValueError("the prompt is empty")
    if prompt_len + max_tokens > self.max_len:
      raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                       f"model context ({self.max_len} tokens)")

  def stream(self, prompts: Sequence[Sequence[int]], max_tokens: int,
             sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
             stop_ids: Sequence[int] = ()) -> Iterator[np.ndarray]:
    n_rows = len(prompts)
    if n_rows < 1 or max_tokens < 1:
      raise ValueError("need at least one prompt and max_tokens >= 1")
    rows = [sampling] * n_rows if isinstance(sampling, SamplingParams) else list(sampling)
    if len(rows) != n_rows:
      raise ValueError(f"{len(rows)} sampling params for {n_rows} prompts")
    if any(r.penalized or r.logit_bias for r in rows):
      raise ValueError("penalties and logit_bias are applied by the serving engine only")
    longest = max(len(p) for p in prompts)
    for p in prompts:
      self.check_lengths(len(p), max_tokens)
      if min(p) < 0 or max(p) >= self.cfg.vocab_size:
        raise ValueError(f"token id out of range [0, {self.cfg.vocab_size})")
    b = max(n_rows, self.min_batch)
    rows = rows + [SamplingParams()] * (b - n_rows)
    s = SamplingArrays.from_params(rows)
    greedy_only = all(r.greedy for r in rows)
    cache_len = min(self.max_len, bucket(longest + max_tokens, maximum=self.max_len))
    cache = init_cache(self.cfg, b, cache_len, self.dtype, self.backend)

    lens = np.array([len(p) for p in prompts] + [0] * (b - n_rows))
    first = None
    for start in range(0, longest, self.prefill_chunk):
      chunk_lens = np.clip(lens - start, 0, self.prefill_chunk)
      t = bucket(int(chunk_lens.max()), maximum=self.prefill_chunk)
      toks = np.zeros((b, t), np.int32)
      for i, p in enumerate(prompts):
        piece = p[start:start + t]
        toks[i, :len(piece)] = piece
      tok_B, cache = prefill_and_sample(
          self.params, jnp.asarray(toks), cache, jnp.asarray(chunk_lens, jnp.int32), s,
          cfg=self.cfg, attend_len=min(cache_len, bucket(start + t, maximum=cache_len)),
          greedy_only=greedy_only, valid_vocab=self.valid_vocab)
      # Rows whose prompt ended in this chunk sampled their first token here.
      ended = (lens > start) & (lens <= start + t)
      first = tok_B if first is None else jnp.where(jnp.asarray(ended), tok_B, first)

    done = np.zeros(b, bool)
    done[n_rows:] = True
    stop = np.array(sorted(set(stop_ids)), np.int64)
    emitted = 0
    tok_B = first
    step_tokens = np.asarray(first)[None]
    while True:
      for row in step_tokens:
        out = np.where(done, -1, row).astype(np.int32)
        yield out[:n_rows]
        emitted += 1
        done |= np.isin(row, stop)
        if emitted >= max_tokens or done.all():
          return
      n = min(self.steps_per_call, max_tokens - emitted)
      n = 1 << (n.bit_length() - 1)  # power of two: few compiled variants
      cur = longest + emitted  # longest row's length after feeding tok_B
      attend_len = min(cache_len, bucket(cur + n, maximum=cache_len))
      out_NB, cache = decode_n(self.params, tok_B, cache, s, cfg=self.cfg, n=n,
                               attend_len=attend_len, greedy_only=greedy_only,
                               valid_vocab=self.valid_vocab)
      step_tokens = np.asarray(out_NB)
      tok_B = out_NB[-1]
