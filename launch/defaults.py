"""What the serving CLIs run when a flag is left at ``auto``: the measured best, per machine.

Contract: ``choose_dtype(platform, cpu_flags) -> Choice`` is the activation and float-weight dtype
for ``--dtype auto``: ``bfloat16`` on accelerators and on CPUs that compute bf16 natively
(``avx512_bf16`` or ``amx_bf16``), else ``float32`` (XLA:CPU emulates bf16 arithmetic there).
``choose_slots(kv_pages) -> Choice`` is ``--max_slots 0``'s decode rows: ``SLOTS`` (64), at most the
KV pages (each running sequence holds at least one). A ``Choice`` carries the value and the
reason the start-up log and ``ServerInfo.defaults`` show.

Why (BUILD_NOTES.md "Defaults that serve"): on SmolLM2-135M, 64 x (128 + 128) tokens offline,
AMD EPYC Zen 4, bf16 weights and activations in 64 slots gave 456 tok/s against 103 with int8
weights, f32 activations and 32 slots (the old defaults with ``--quantize int8``); bf16 passes the
quality gate against f32 (perplexity +0.1%, KL 0.0006, ``tests/launch/lab/test_quality.py``).
int8 weights stay opt-in: weight-only int8 is faster than bf16 at one decode row, slower at 16-64.
"""

from __future__ import annotations

import dataclasses

SLOTS = 64
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclasses.dataclass(frozen=True)
class Choice:
  value: str | int
  reason: str


def choose_dtype(platform: str, cpu_flags: frozenset[str]) -> Choice:
  if platform != "cpu":
    return Choice("bfloat16", f"{platform}: bf16 is the accelerator's native format")
  native = [f for f in BF16_FLAGS if f in cpu_flags]
  if native:
    return Choice("bfloat16", f"this CPU computes bf16 natively ({', '.join(native)}); "
                  "bf16 passes the quality gate against f32")
  return Choice("float32", "this CPU has no native bf16 (no avx512_bf16 / amx_bf16): XLA would "
                "emulate it")


def choose_slots(kv_pages: int) -> Choice:
  if kv_pages >= SLOTS:
    return Choice(SLOTS, f"{SLOTS} decode rows: the fastest batch measured on 2-core CPUs")
  return Choice(kv_pages, f"{kv_pages} decode rows: one per KV page (--kv_pages {kv_pages})")
