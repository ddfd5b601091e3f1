"""Multi-controller JAX (``jax.distributed``): 2 local processes x 4 fake CPU devices (CPU
collectives through gloo) against 1 process x 8 devices (this test process, tests/conftest.py).

Covered: the step-plan wire form round-trips exactly and refuses unknown types; the cluster
flags are validated; the partitioned paged prefill + decode give the same logits on 2 x 4 as on
1 x 8 (and as the unsharded model; ws_2d + batch_z f32 by default, ws_1d + heads int8 under
`slow`), relative tolerance 1e-5 of the logits' magnitude as
tests/partitioning/test_paged_layouts.py; a 2-process ``launch.server`` started with the default
warm-up (every process compiles and seals the same programs) streams the same greedy tokens as
the same engine in one process; SIGTERM to process 0 stops both cleanly (exit 0); a killed
process takes the other down with an error within the heartbeat timeout plus a margin. Every
process is reaped (tests/multiproc.py).
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partitioning.distributed import Cluster
from serving import plan_codec
from serving.kv_pages import PageCopy
from serving.prefix_cache import PageLoad, PageSpill
from serving.request import Sinks
from serving.sampling import SamplingParams
from serving.scheduler import DecodeRow, PrefillChunk, SlotSetup, StepPlan
from tests.multiproc import Workers, run_workers
from tests.partitioning.test_layouts import assert_close

HEARTBEAT_S = 5  # the workers' --heartbeat_timeout_s
DEATH_MARGIN_S = 15  # detection takes up to one heartbeat timeout; margin for a loaded machine


def test_plan_codec_round_trips_exactly():
  table = np.arange(24, dtype=np.int32).reshape(4, 6) - 3
  plan = StepPlan(
      step=7, prefill=(PrefillChunk("a", 1, (5, 6, 7), 32, True),),
      decode=(DecodeRow("b", 0, 40), DecodeRow("c", 2, 3)),
      setups=(SlotSetup(1, "a", SamplingParams(0.7, 5, 0.9, 123, 2), Sinks(64, 4)),
              SlotSetup(2, "c", SamplingParams(seed=2**32 - 1)),
              SlotSetup(3, "d", SamplingParams(presence_penalty=0.5, repetition_penalty=1.25,
                                               logit_bias=((7, -100.0), (9, 0.1))),
                        prompt_ids=(1, 2, 3), output_ids=(4, 4))),
      page_table=table, copies=(PageCopy(3, 9),), spills=(PageSpill(4, 2**60),),
      forget=(11, 12), loads=(PageLoad(2**60, 5),))
  got = plan_codec.decode(plan_codec.encode(plan))
  assert isinstance(got, StepPlan)
  for f in ("step", "prefill", "decode", "setups", "copies", "spills", "forget", "loads"):
    assert getattr(got, f) == getattr(plan, f), f
  assert got.page_table.dtype == np.int32 and np.array_equal(got.page_table, table)
  assert got.setups[0].sampling.temperature == 0.7  # floats exact through JSON
  assert got.setups[2].sampling.logit_bias == ((7, -100.0), (9, 0.1))
  call = plan_codec.decode(plan_codec.encode(("warmup", (2, None))))
  assert call == ("warmup", (2, None))
  with pytest.raises(ValueError, match="unknown type"):
    plan_codec.decode(b'{"dc":"Popen","f":{}}')
  with pytest.raises(TypeError, match="cannot encode"):
    plan_codec.encode(object())


@pytest.mark.parametrize("kw,match", [
    (dict(num_processes=0), "num_processes"),
    (dict(num_processes=2, process_id=2, coordinator_address="h:1"), "process_id"),
    (dict(num_processes=2), "coordinator_address"),
    (dict(num_processes=2, coordinator_address="nohostport"), "host:port"),
    (dict(heartbeat_timeout_s=0), "heartbeat_timeout_s"),
])
def test_cluster_validation_names_the_field(kw, match):
  with pytest.raises(ValueError, match=match):
    Cluster(**kw).validate()
  Cluster("auto").validate()  # JAX's cluster detection (TPU pod slices)
  assert Cluster("auto").multi and not Cluster().multi


@pytest.mark.parametrize("ffn,attn,quantized", [
    ("ws_2d", "batch_z", False),  # KV pages sharded over z, which crosses the processes
    pytest.param("ws_1d", "heads", True, marks=pytest.mark.slow),  # int8 weights
])
def test_two_processes_give_the_logits_of_one(tmp_path, ffn, attn, quantized):
  from partitioning.mesh import make_mesh
  from tests.partitioning import test_paged_layouts as T
  from tests.workers import partitioned_logits as W
  out = tmp_path / "logits.npz"
  name = W.case_name(ffn, attn, quantized)
  ws = run_workers(tmp_path, ["tests.workers.partitioned_logits", "--out", str(out),
                              "--cases", name], timeout=240)
  for w in ws:
    assert w.returncode == 0, w.output[-3000:]
  got = np.load(out)
  one = W.run_case(make_mesh(jax.devices()[:8]), ffn, attn, quantized)
  ref = T._case(quantized)[2]
  for k in ("l1", "l2", "l3"):
    assert_close(got[f"{name}/{k}"], one[k], f"{name} {k}: 2x4 vs 1x8")
    assert_close(got[f"{name}/{k}"], ref[k], f"{name} {k}: 2x4 vs unsharded")
  np.testing.assert_array_equal(got[f"{name}/lengths"], one["lengths"])


# -- launch.server over two processes ------------------------------------------------------------

LAYOUT = "ws_2d:batch_z"  # pages sharded over z: each process holds its own kv shards
SERVER = ("launch.server", "--model", "tiny", "--max_context", "128", "--max_slots", "4",
          "--kv_pages", "32", "--page_size", "16", "--max_chunk", "32",
          "--max_prefill_chunks", "1", "--fake_devices", "4", "--mode", "interleaved",
          "--prefill_layout", LAYOUT, "--decode_layout", LAYOUT,
          "--heartbeat_timeout_s", str(HEARTBEAT_S), "--grace_s", "5", "--noearly_reject")
PROMPT = (1, 72, 101, 108, 108, 111, 44, 32, 119)
MAX_TOKENS = 10


def _one_process_tokens() -> list[int]:
  """The same engine in this process over 8 devices (what a 1-process server runs)."""
  from models.io.loader import load_model
  from serving import stack
  from partitioning.deployment import Deployment, make_steps
  from serving.request import Request
  from serving.stop import StopCriteria
  cfg, params, tok = load_model("tiny", jnp.float32, 0)
  config = stack.ServingConfig(max_slots=4, page_size=16, kv_pages=32, max_chunk=32,
                               max_prefill_chunks=1, max_context=128)
  steps = make_steps(cfg, Deployment("interleaved", LAYOUT, LAYOUT), max_slots=4, max_chunk=32,
                     max_context=128, quantized=False, devices=jax.devices()[:8])
  loop = stack.build(steps.step, params, tok, config, decode=steps.decode,
                     kv_shards=steps.kv_shards)
  out: list[int] = []
  loop.submit(Request("r", PROMPT, SamplingParams(),
                      StopCriteria(max_tokens=MAX_TOKENS, stop_ids=())),
              lambda o: out.extend(o.token_ids))
  loop.run_until_idle()
  return out


def _wait_port(ws: Workers, path, timeout: float = 120.0) -> int:
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    if any(w.proc.poll() is not None for w in ws.workers) or time.monotonic() > deadline:
      raise RuntimeError("server did not bind:\n" + ws.logs())
    time.sleep(0.1)
  return int(open(path).read())


def _wait_serving(ws: Workers, port: int, timeout: float) -> None:
  """Until health says SERVING (warm-up done); fails if a process exits first."""
  from grpc_health.v1 import health_pb2, health_pb2_grpc
  deadline = time.monotonic() + timeout
  with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
    stub = health_pb2_grpc.HealthStub(ch)
    while True:
      if any(w.proc.poll() is not None for w in ws.workers) or time.monotonic() > deadline:
        raise RuntimeError("server did not become ready:\n" + ws.logs())
      try:
        req = health_pb2.HealthCheckRequest(service="phaseserve.v1.Generation")
        if stub.Check(req, timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
          return
      except grpc.RpcError:
        pass
      time.sleep(0.2)


def _stream(port: int, max_tokens: int = MAX_TOKENS) -> list[int]:
  from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
  from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
  with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
    stub = pb_grpc.GenerationStub(ch)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(PROMPT)), max_tokens=max_tokens,
                             ignore_eos=True)
    return [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]


def _server_pair(tmp_path, warmup: bool = False) -> Workers:
  port_file = str(tmp_path / "port")
  return Workers(tmp_path, SERVER + (() if warmup else ("--nowarmup",)),
                 extra=[("--port", "0", "--port_file", port_file), ()])


def test_two_process_server_warms_up_streams_the_tokens_of_one_and_stops_cleanly(tmp_path):
  """With the default warm-up (process 0 publishes warmup and seal: a TypeError or a program
  run by one process only would fail or hang here)."""
  expected = _one_process_tokens()
  assert len(expected) == MAX_TOKENS
  with _server_pair(tmp_path, warmup=True) as ws:
    port = _wait_port(ws, tmp_path / "port")
    _wait_serving(ws, port, timeout=300)
    assert "warm-up: " in ws.workers[0].output and "ready" in ws.workers[0].output
    assert _stream(port) == expected
    assert _stream(port, 3) == expected[:3]  # and it keeps serving
    ws.kill(0, signal.SIGTERM)
    done = ws.wait(60)
    assert [w.returncode for w in done] == [0, 0], ws.logs()
  assert "stopped after" in done[1].output  # the follower left its loop on process 0's word


@pytest.mark.parametrize("victim", [1, 0], ids=["follower-killed", "leader-killed"])
def test_a_killed_process_takes_the_other_down(tmp_path, victim):
  with _server_pair(tmp_path) as ws:
    _wait_port(ws, tmp_path / "port")
    survivor = 1 - victim
    ws.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    try:
      rc = ws.workers[survivor].proc.wait(HEARTBEAT_S + DEATH_MARGIN_S)
    except Exception:
      pytest.fail(f"process {survivor} still running {HEARTBEAT_S + DEATH_MARGIN_S} s after "
                  f"process {victim} was killed:\n{ws.logs()}")
    elapsed = time.monotonic() - t0
    assert rc != 0, ws.logs()
    assert "distributed service detected fatal errors" in ws.workers[survivor].output
  print(f"process {survivor} exited (rc {rc}) {elapsed:.1f} s after process {victim} died")


@pytest.mark.slow  # suite time: the sweep's own smoke is tests/launch/lab/test_sweep_partitioning.py
@pytest.mark.parametrize("runs", [1, 2],
                         ids=["once", "resumed"])
def test_two_process_partitioning_sweep(tmp_path, runs):
  """launch.lab.sweep_partitioning over 2 x 4 devices: every process runs every cell; process 0's
  timings decide and only it writes; run twice (``slow``), the second resumes from process 0's
  cache without re-timing (resuming itself is tested in one process by
  tests/launch/lab/test_sweep_partitioning.py)."""
  import csv
  import json
  out = tmp_path / "sweep"
  argv = ["launch.lab.sweep_partitioning", "--fake_devices", "4", "--model", "tiny", "--phases",
          "decode", "--batches", "8", "--seqs", "16", "--weights", "bf16", "--candidates",
          "ws_2d:heads,wg_xyz:batch_xyz", "--reps", "1", "--hardware", "tpu-v4",
          "--out", str(out)]
  for resumed in range(runs):
    logs = tmp_path / f"run{resumed}"
    logs.mkdir()
    ws = run_workers(logs, argv, timeout=240)
    assert [w.returncode for w in ws] == [0, 0], "\n".join(w.output[-2000:] for w in ws)
    summary = json.loads(ws[0].output.strip().splitlines()[-1])
    assert summary["cells"] == 1 and summary["resumed"] == resumed, summary
    assert '"cells"' not in ws[1].output  # the follower prints no summary
  with open(out / "sweep.csv") as f:
    rows = list(csv.DictReader(f))
  assert {r["ffn"] for r in rows} == {"ws_2d", "wg_xyz"}
  assert all(float(r["measured_s"]) > 0 for r in rows if not r["same_as"])
  assert json.load(open(out / "sweep.json"))["mesh"] == [2, 2, 2]


def test_deployments_that_cannot_span_processes_are_refused(monkeypatch):
  from partitioning.deployment import Deployment, check_multiprocess
  check_multiprocess(Deployment("disaggregated"))  # one process: anything goes
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  check_multiprocess(Deployment("interleaved"))
  for mode in ("single", "disaggregated"):
    with pytest.raises(ValueError, match="--mode interleaved"):
      check_multiprocess(Deployment(mode))
  with pytest.raises(ValueError, match="host tier"):
    check_multiprocess(Deployment("interleaved"), host_tier_bytes=1 << 20)


def test_bench_multihost_smoke(tmp_path):
  import json
  ws = run_workers(tmp_path, ["launch.lab.bench_multihost", "--reps", "5", "--width", "64"],
                   timeout=120)
  assert [w.returncode for w in ws] == [0, 0], ws[0].output[-2000:] + ws[1].output[-2000:]
  r = json.loads(ws[0].output.strip().splitlines()[-1])
  assert r["processes"] == 2 and r["devices"] == 8 and r["reps"] == 5
  assert r["plan_bytes"] > 1000 and r["broadcast_round_trip_ms"] > 0 and r["allreduce_ms"] > 0
