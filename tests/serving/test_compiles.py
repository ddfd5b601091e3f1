"""serving.compiles.ProgramCounter: programs counted, and where their start-up time went."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.compiles import ProgramCounter


def test_counts_programs_and_breaks_their_time_down():
  counter = ProgramCounter()
  try:
    salt = float(jax.random.uniform(jax.random.key(7)))  # a program no other test compiled

    @jax.jit
    def f(x):
      return jnp.tanh(x * salt) @ x.T

    f(jnp.ones((16, 16))).block_until_ready()
    b = counter.breakdown()
    assert counter.count >= 1 and counter.names["jit(f)"] == 1
    assert b["trace_s"] > 0 and b["lower_s"] > 0 and b["compile_or_load_s"] > 0
    # The suite runs with JAX's persistent cache on (tests/conftest.py): a new program is looked
    # up there, a miss, then written.
    assert b["cache_hits"] + b["cache_misses"] >= 1 and b["cache_read_s"] >= 0
    counter.mark()
    f(jnp.ones((16, 16))).block_until_ready()  # in memory: no program loaded again
    assert counter.since_mark == 0 and counter.breakdown()["compile_or_load_s"] == \
        b["compile_or_load_s"]
  finally:
    counter.close()
  n = counter.count
  f(jnp.ones((8, 8))).block_until_ready()  # a new shape, after close(): not counted
  assert counter.count == n
