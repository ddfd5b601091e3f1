"""The open speculation fault's reproducer: one verify call run over and over on copies of one
state, every output compared bit for bit with the first run's.

  python -m launch.lab.verify_repro --iters 2500 --json             # SmolLM2, f32 (~14 min)
  python -m launch.lab.verify_repro --iters 2500 --mode serial --json
  python -m launch.lab.verify_repro --model tiny --iters 3 --json    # smoke
  python -m launch.lab.verify_repro --target attention --iters 36000 --json  # kernel (~10 min)
  PHASESERVE_AMX=0 python -m launch.lab.verify_repro ...   # the AMX tile state never requested

BUILD_NOTES "Speculative decoding", "Open fault: a rare wrong computation": the verify program
(``serving.spec_verify.verify_call``, the engine and native CPU backend the speculation test
uses: 8 slots, 64 pages of 64, k = 4) sometimes computes a row wrong. Here the pool is random
(``--seed``), one row of slot 0 at ``--position`` with three draft ids. Each iteration makes two
copies of the state and runs the call on both: ``async`` dispatches the two calls back to back,
``serial`` waits for the first before the second. A run whose pools or ids differ from the
reference run is an event: its iteration, which of the two calls (0 / 1), and per layer the
largest |difference| of its K pool (the first layer that differs shows where the row went
wrong). The program is deterministic, so every event is a fault. ``--json`` prints one JSON
object {"target", "model", "dtype", "mode", "iters", "calls", "amx_allowed", "events":
[{"iter", "call", "ids", "ref_ids", "first_layer", "k_max_diff_by_layer"}], "wall_s", "date",
"machine"}.
``run(model, iters, mode, position, seed)`` -> dict is the library.

``--target attention`` runs the paged attention kernel alone (``run_attention``), no other
program in between: one program holds the model's ``L`` layers' calls on a random query
``[R, N, H]`` (R = 8 slots x 5 positions from ``--position``) over a random pool of the verify
call's shape; every run's outputs are compared with the first run's, and an event lists the
differing (layer, row, kv head) items with their largest |difference| (the JSON adds
"kernel_calls" and "rows"; each event is {"iter", "call", "items_differing", "items": [{"layer",
"row", "kv_head", "max_diff", "values_differing"}]}). ``PHASESERVE_AMX=0``
(read by ``models.cpu.env``) keeps phaseserve from requesting the AMX tile state at all.
"""

from __future__ import annotations

import datetime
import functools
import json
import time

from absl import flags

from launch import cli, machine
from launch.cli import CliError

MODES = ("async", "serial")
TARGETS = ("verify", "attention")


def _check(mode: str, position: int) -> None:
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if not 0 <= position <= 500:
    raise ValueError(f"position must be in [0, 500], got {position}")


def run(model: str, iters: int, mode: str = "async", position: int = 69, seed: int = 0) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from models.cpu import backend as cpu_backend, env, lowering as cpu_lowering
  from models.io.loader import load_model
  from models.step import UnshardedStep
  from serving.engine import Engine, EngineConfig
  from serving.sampling import SamplingArrays, SamplingParams
  from serving.spec_verify import pack_verify, verify_call
  from serving.step_plan import DecodeRow

  _check(mode, position)
  t0 = time.perf_counter()
  cfg, params, tok = load_model(model, jnp.float32)
  slots, pages, z = 8, 64, 64
  backend = cpu_backend.native(cpu_lowering.DEFAULT, amx=env.amx())
  engine = Engine(UnshardedStep(cfg, backend=backend), params,
                  EngineConfig(max_slots=slots, num_pages=pages, page_size=z,
                               max_seq_tokens=512, lag=1, spec_tokens=4, spec_rows=8,
                               valid_vocab=tok.vocab_size))
  pool = engine.prefill_pool
  ks = jax.random.split(jax.random.key(seed), 2)
  table_XM = np.arange(slots * 8, dtype=np.int32).reshape(slots, 8)  # 8 pages a slot
  kv = pool.kv.replace(
      k_pages=jax.random.normal(ks[0], pool.kv.k_pages.shape, jnp.float32),
      v_pages=jax.random.normal(ks[1], pool.kv.v_pages.shape, jnp.float32),
      page_table=jax.device_put(table_XM, pool.kv.page_table.sharding),
      lengths=jnp.full((slots,), position, jnp.int32))
  last_X = jnp.full((slots,), 1, jnp.int32)
  draft = tuple(int(t) % tok.vocab_size for t in (351, 260, 15601))
  a = pack_verify([DecodeRow("r", 0, position, draft)], 5, slots)
  samp = SamplingArrays.from_params([SamplingParams()] * slots)
  call = functools.partial(verify_call, step=engine.decode_step, attend_len=512,
                           valid_vocab=tok.vocab_size, k=4)

  def once(state):
    return call(pool.params, state[0], state[1], samp, a.tokens_N, a.first_N, a.slot_N,
                a.pos_N, a.next_N, a.slots_R, a.start_R, a.k_R, None)

  def copy():
    return jax.block_until_ready((jax.tree.map(jnp.copy, kv), jnp.copy(last_X)))

  same = jax.jit(lambda x, y: jnp.all(x == y))
  ref = once(copy())
  ref_ids = np.asarray(ref[2]).tolist()
  events = []
  for i in range(iters):
    c0, c1 = copy(), copy()
    first = once(c0)
    if mode == "serial":
      jax.block_until_ready(first)
    outs = (first, once(c1))
    for j, out in enumerate(outs):
      ids = np.asarray(out[2]).tolist()
      if (ids == ref_ids and bool(same(out[0].k_pages, ref[0].k_pages))
          and bool(same(out[0].v_pages, ref[0].v_pages))):
        continue
      d = np.abs(np.asarray(out[0].k_pages) - np.asarray(ref[0].k_pages)).max(axis=(1, 2, 3, 4))
      nz = np.nonzero(d)[0]
      events.append({"iter": i, "call": j, "ids": ids, "ref_ids": ref_ids,
                     "first_layer": int(nz[0]) if len(nz) else None,
                     "k_max_diff_by_layer": [round(float(x), 6) for x in d]})
  return {"target": "verify", "model": model, "dtype": "float32", "mode": mode, "iters": iters,
          "calls": 2 * iters, "amx_allowed": env.amx(), "events": events,
          "wall_s": round(time.perf_counter() - t0, 1),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "machine": machine.describe()}


def run_attention(model: str, iters: int, mode: str = "async", position: int = 69,
                  seed: int = 0) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from models.config import get_preset
  from models.cpu import env, paged_attention

  _check(mode, position)
  if not paged_attention.available():
    raise ValueError("the native paged attention kernel is not available on this machine")
  t0 = time.perf_counter()
  cfg = get_preset(model)
  slots, pages, z, rows_per_slot = 8, 64, 64, 5
  L, N, K, H = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  ks = jax.random.split(jax.random.key(seed), 3)
  shape = (L, pages, K, z, H)
  k_pages = jax.random.normal(ks[0], shape, jnp.float32)
  v_pages = jax.random.normal(ks[1], shape, jnp.float32)
  R = slots * rows_per_slot
  q_RNH = jax.random.normal(ks[2], (R, N, H), jnp.float32) * H ** -0.5
  table_RM = jnp.asarray(np.repeat(np.arange(slots * 8, dtype=np.int32).reshape(slots, 8),
                                   rows_per_slot, axis=0))
  pos_R = jnp.asarray(position + np.tile(np.arange(rows_per_slot, dtype=np.int32), slots))

  @jax.jit
  def layers(q, kp, vp, table, pos):  # [L, R, N, H]: each layer's call on its own query
    return jnp.stack([paged_attention.decode_attention(q * (1.0 + 0.01 * i), kp, vp, table, pos,
                                                       i, 8 * z) for i in range(L)])

  same = jax.jit(lambda x, y: jnp.all(x == y))
  ref = jax.block_until_ready(layers(q_RNH, k_pages, v_pages, table_RM, pos_R))
  events = []
  for i in range(iters):
    first = layers(q_RNH, k_pages, v_pages, table_RM, pos_R)
    if mode == "serial":
      jax.block_until_ready(first)
    outs = (first, layers(q_RNH, k_pages, v_pages, table_RM, pos_R))
    for j, out in enumerate(outs):
      if bool(same(out, ref)):
        continue
      d_LRKX = np.abs(np.asarray(out) - np.asarray(ref)).reshape(L, R, K, -1)
      bad = np.argwhere(d_LRKX.max(axis=-1) > 0)
      events.append({"iter": i, "call": j, "items": [
          {"layer": int(a), "row": int(b), "kv_head": int(c),
           "max_diff": float(d_LRKX[a, b, c].max()),
           "values_differing": int((d_LRKX[a, b, c] > 0).sum())} for a, b, c in bad[:32]],
          "items_differing": int(len(bad))})
  return {"target": "attention", "model": model, "dtype": "float32", "mode": mode,
          "iters": iters, "calls": 2 * iters, "kernel_calls": 2 * iters * L, "rows": R,
          "amx_allowed": env.amx(), "events": events,
          "wall_s": round(time.perf_counter() - t0, 1),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "machine": machine.describe()}


class _Flags:
  def __init__(self):
    self.model = flags.DEFINE_string("model", "smollm2-135m", "a model the loader knows")
    self.iters = flags.DEFINE_integer("iters", 2500, "pairs of verify calls", lower_bound=1)
    self.mode = flags.DEFINE_enum("mode", "async", list(MODES), "the pair back to back "
                                  "(async) or the second after the first finished (serial)")
    self.position = flags.DEFINE_integer("position", 69, "the row's position", lower_bound=0)
    self.seed = flags.DEFINE_integer("seed", 0, "the random pool's seed")
    self.json = flags.DEFINE_bool("json", False, "print one JSON object")
    self.target = flags.DEFINE_enum("target", "verify", list(TARGETS), "the whole verify call "
                                    "(verify) or the paged attention kernel alone (attention)")


def main(f: _Flags, argv: list[str]) -> None:
  cli.start(argv)
  try:
    fn = run if f.target.value == "verify" else run_attention
    r = fn(f.model.value, f.iters.value, f.mode.value, f.position.value, f.seed.value)
  except ValueError as e:
    raise CliError(str(e)) from e
  if f.json.value:
    print(json.dumps(r))
  else:
    print(f"{r['model']} {r['mode']}: {len(r['events'])} events in {r['calls']} calls "
          f"({r['wall_s']} s)")
    for e in r["events"]:
      if "items" in e:
        print(f"  iter {e['iter']} call {e['call']}: {e['items_differing']} items differ, "
              f"first {e['items'][0]}")
      else:
        print(f"  iter {e['iter']} call {e['call']}: first layer {e['first_layer']}, ids "
              f"{e['ids']} against {e['ref_ids']}")


if __name__ == "__main__":
  cli.run(functools.partial(main, _Flags()))
