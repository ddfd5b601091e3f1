"""A numpy re-implementation of ``serving.penalties`` for tests: ``ref_apply`` (vLLM v1's order,
float32) and ``check_greedy``, which replays a greedy request's ids against the argmax of the
penalised logits of the model's own forward pass."""

from __future__ import annotations

import numpy as np

from serving.sampling import SamplingParams

MARGIN_EPS = 1e-4  # a top-2 margin below this is a near-tie that summation order may flip


def ref_apply(logits: np.ndarray, counts: np.ndarray, prompt: np.ndarray, p: SamplingParams
              ) -> np.ndarray:
  """Bias, repetition (ids of the prompt or output), frequency, presence: one row [V]."""
  x = logits.astype(np.float32).copy()
  for t, b in p.logit_bias:
    x[t] += np.float32(b)
  r = np.float32(p.repetition_penalty)
  seen = prompt | (counts > 0)
  x = np.where(seen, np.where(x > 0, x / r, x * r), x) if r != 1 else x
  x = x - np.float32(p.frequency_penalty) * counts.astype(np.float32)
  return x - np.float32(p.presence_penalty) * (counts > 0).astype(np.float32)


def check_greedy(logits_TV: np.ndarray, prompt: list[int], ids: list[int], p: SamplingParams
                 ) -> str:
  """``logits_TV``: the model's logits over ``prompt + ids[:-1]``. Each id against the argmax
  of ``ref_apply`` with the counts of the ids before it: 'equal', 'near-tie' (a top-2 margin
  below MARGIN_EPS on the way) or the first mismatch."""
  v = logits_TV.shape[-1]
  mask = np.zeros(v, bool)
  mask[prompt] = True
  for j, tok in enumerate(ids):
    counts = np.bincount(np.asarray(ids[:j], np.int64), minlength=v).astype(np.int32)
    x = ref_apply(logits_TV[len(prompt) - 1 + j], counts, mask, p)
    top2 = np.sort(x)[-2:]
    if top2[1] - top2[0] < MARGIN_EPS:
      return "near-tie"
    if int(np.argmax(x)) != tok:
      best = int(np.argmax(x))  # the gap says numerics (small) from a wrong row (large)
      return f"differs at {j}: {tok} != {best} (reference gap {x[best] - x[tok]:.3g})"
  return "equal"
