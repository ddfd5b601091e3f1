"""launch.defaults: what ``--dtype auto`` and ``--max_slots 0`` choose, and that the CLIs report it."""

from __future__ import annotations

from launch import defaults


def test_bf16_where_the_cpu_computes_it_natively():
  zen4 = frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})
  spr = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
  old = frozenset({"avx2", "avx512f"})
  assert defaults.choose_dtype("cpu", zen4).value == "bfloat16"
  assert "avx512_bf16, amx_bf16" in defaults.choose_dtype("cpu", spr).reason
  got = defaults.choose_dtype("cpu", old)
  assert got.value == "float32" and "emulate" in got.reason
  assert defaults.choose_dtype("gpu", frozenset()).value == "bfloat16"
  assert defaults.choose_dtype("tpu", frozenset()).value == "bfloat16"


def test_slots_are_64_but_never_more_than_the_kv_pages():
  assert defaults.choose_slots(512).value == defaults.SLOTS == 64
  small = defaults.choose_slots(16)
  assert small.value == 16 and "--kv_pages 16" in small.reason
