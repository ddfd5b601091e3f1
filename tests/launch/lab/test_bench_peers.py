"""launch.lab.bench_peers at tiny size with every peer absent (their paths point at an empty dir), and
the model writers it relies on (launch.lab.hf_export, launch.lab.gguf_export) round-tripping exactly."""

import csv
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from launch.lab.peers import core
from launch.lab.gguf_export import write_gguf
from models.io.gguf_import import load_gguf
from launch.lab.hf_export import save_hf_checkpoint
from models.io.hf_import import load_hf_checkpoint
from models.io.loader import load_model


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_writers_round_trip(tmp_path):
  cfg, params, _ = load_model("tiny")
  save_hf_checkpoint(cfg, params, tmp_path / "hf", "float32")
  cfg_hf, params_hf = load_hf_checkpoint(tmp_path / "hf")
  assert cfg_hf.replace(name=cfg.name) == cfg
  assert _max_diff(params, params_hf) == 0.0
  write_gguf(cfg, params, tmp_path / "m.gguf", "F32")
  cfg_g, params_g = load_gguf(tmp_path / "m.gguf")
  assert cfg_g.replace(name=cfg.name) == cfg
  assert _max_diff(params, params_g) == 0.0  # Q/K permuted and un-permuted exactly
  write_gguf(cfg, params, tmp_path / "q.gguf", "Q8_0")
  _, params_q = load_gguf(tmp_path / "q.gguf")
  scale = max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(params))
  assert 0.0 < _max_diff(params, params_q) < scale / 100  # int8 blocks of 32: ~1/254 of a max


def test_bench_peers_smoke_every_peer_absent(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  out = tmp_path / "out"
  args = [sys.executable, "-m", "launch.lab.bench_peers", "--model", "tiny", "--prompt", "16",
          "--new_tokens", "4", "--batches", "1,2", "--repeats", "1", "--offline=false",
          "--loadgen=false", "--llamacpp_repeats", "1",
          "--trace_requests", "2", "--trace_prompt", "8", "--trace_tokens", "4",
          "--ref_python", str(empty / "python"), "--llamacpp_bin", str(empty),
          "--vllm_python", str(empty / "python"), "--peak_size", "64", "--bandwidth_mb", "1",
          "--out", str(out)]
  r = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=core.REPO)
  assert r.returncode == 0, r.stderr[-3000:]
  with open(out / "peers.csv", newline="") as f:
    reader = csv.DictReader(f)
    assert reader.fieldnames == core.csv_columns((1, 2))
    rows = list(reader)
  doc = json.loads((out / "peers.json").read_text())
  assert doc["machine"]["cpu"] and doc["date"] and doc["commands"] and doc["complete"]
  assert len(doc["rows"]) == len(rows)
  by = {(r["engine"], r["weights"]): r for r in rows}
  for key in [("phaseserve", "bf16"), ("phaseserve", "int8 (weight_only)")]:
    assert by[key]["status"] == "ok"
    for b in (1, 2):
      assert float(by[key][f"prefill_tok_s_b{b}"]) > 0
      assert float(by[key][f"decode_ms_b{b}"]) > 0
  absent = {("transformers", "bf16"): ".venv-ref", ("llama.cpp", "BF16"): "peers-llamacpp",
            ("llama.cpp", "Q8_0"): "peers-llamacpp", ("vLLM (CPU)", "bf16"): "peers-vllm"}
  for key, target in absent.items():  # reported, never dropped, figures empty
    assert by[key]["status"] == "not installed", by[key]
    assert target in by[key]["note"]
    assert by[key]["prefill_tok_s_b1"] == "" and by[key]["ps_speedup_decode_b1"] == ""
  for engine in ("vLLM (CPU) OpenAI server", "phaseserve OpenAI server",
                 "phaseserve serve_offline"):
    assert by[(engine, "bf16")]["status"] == "not run" and by[(engine, "bf16")]["note"]
  # The files every engine reads were written once: a HF checkpoint and both GGUF files.
  assert (out / "model" / "hf" / "config.json").is_file()
  assert (out / "model" / "hf" / "tokenizer.json").is_file()
  assert (out / "model" / "model-bf16.gguf").is_file()
  assert (out / "model" / "model-q8_0.gguf").is_file()
  # Run again into the same directory: phaseserve's stage (all rows ok) is read back, not re-timed;
  # the absent peers' stages run again (they may have been installed since).
  again = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=core.REPO)
  assert again.returncode == 0, again.stderr[-3000:]
  doc2 = json.loads((out / "peers.json").read_text())
  assert doc2["resumed"] == ["phaseserve"] and doc2["complete"]
  assert [r for r in doc2["rows"] if r["engine"] == "phaseserve"] == [
      r for r in doc["rows"] if r["engine"] == "phaseserve"]
  assert "read back" in again.stderr
  assert doc2["stages"]["phaseserve"]["commands"] == doc["stages"]["phaseserve"]["commands"]


@pytest.mark.parametrize("bad", [["--model", "palm-8b"], ["--batches", "0"], ["--batches", "x"]])
def test_bench_peers_bad_flags(bad, tmp_path):
  r = subprocess.run([sys.executable, "-m", "launch.lab.bench_peers", "--out", str(tmp_path), *bad],
                     capture_output=True, text=True, timeout=120, cwd=core.REPO)
  assert r.returncode == 2 and r.stderr.startswith("error:"), r.stderr


def test_ratios_against_the_same_weight_class():
  ok = core.OK
  rows = [core.PeerRow("phaseserve", "bf16", ok, prefill_tok_s={1: 200.0}, decode_ms={1: 10.0}),
          core.PeerRow("phaseserve", "int8 (weight_only)", ok, prefill_tok_s={1: 400.0},
                       decode_ms={1: 5.0}),
          core.PeerRow("phaseserve serve_offline", "bf16", ok, offline_tok_s=300.0),
          core.PeerRow("llama.cpp", "BF16", ok, prefill_tok_s={1: 100.0}, decode_ms={1: 20.0}),
          core.PeerRow("llama.cpp", "Q8_0", ok, prefill_tok_s={1: 800.0}, decode_ms={1: 2.5}),
          core.PeerRow("vLLM (CPU)", "bf16", ok, offline_tok_s=600.0),
          core.PeerRow("transformers", "bf16", core.FAILED, "exit 1: boom")]
  core._ratios(rows, (1,))
  assert rows[3].ratios == {"prefill_b1": 2.0, "decode_b1": 2.0}
  assert rows[3].compared_to == "phaseserve bf16"
  assert rows[4].ratios == {"prefill_b1": 0.5, "decode_b1": 0.5}  # Q8_0 against int8
  assert rows[4].compared_to == "phaseserve int8 (weight_only)"
  assert rows[5].ratios == {"offline": 0.5}
  assert rows[6].ratios == {} and rows[0].ratios == {}
  # Capacity: phaseserve's OpenAI server against vLLM's, from the rows (so a read-back capacity
  # stage keeps it); a second call recomputes rather than appends.
  rows += [core.PeerRow("vLLM (CPU) OpenAI server", "bf16", ok, capacity_rps=1.0),
           core.PeerRow("phaseserve OpenAI server", "bf16", ok, capacity_rps=0.75)]
  core._ratios(rows, (1,))
  core._ratios(rows, (1,))
  assert rows[7].ratios == {"capacity": 0.75}
  assert rows[7].compared_to == "phaseserve OpenAI server"
  assert rows[5].compared_to == "serve_offline bf16"


def test_a_resume_needs_the_same_flags_code_and_cpu(tmp_path):
  cfg = core.PeersConfig(model="tiny", out=str(tmp_path))
  now = {"commit": "abc", "changes": "0", "cpu": "Xeon"}
  row = dataclasses.asdict(core.PeerRow("phaseserve", "bf16", core.OK, decode_ms={1: 2.0}))
  doc = {"config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
         "provenance": now, "raw": {"phaseserve_bench": 1},
         "stages": {"phaseserve": {"rows": [row], "raw": ["phaseserve_bench"], "commands": []},
                    "transformers": {"rows": [dict(row, status=core.NOT_INSTALLED)], "raw": []}}}
  (tmp_path / "peers.json").write_text(json.dumps(doc))
  found = core._earlier_stages(cfg, tmp_path, now)
  assert set(found) == {"phaseserve"}  # a stage with a row not ok runs again
  assert core._row_from_json(found["phaseserve"]["rows"][0]).decode_ms == {1: 2.0}
  assert core._earlier_stages(cfg, tmp_path, dict(now, commit="def")) == {}
  assert core._earlier_stages(dataclasses.replace(cfg, repeats=9), tmp_path, now) == {}
  assert core._earlier_stages(dataclasses.replace(cfg, timeout_s=5.0), tmp_path, now)


_FAKE_LOADGEN = '''
import argparse, json, os, urllib.request
ap = argparse.ArgumentParser()
for f in ("--api", "--target", "--out", "--model", "--vocab_size", "--max_context"):
  ap.add_argument(f)
ap.add_argument("--find_capacity", action="store_true")
a = ap.parse_args()
assert a.api == "openai"
req = urllib.request.Request(a.target + "/v1/completions", method="POST",
    data=json.dumps({"model": a.model, "prompt": "hi", "max_tokens": 2}).encode(),
    headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
  body = json.loads(r.read())
os.makedirs(a.out, exist_ok=True)
with open(os.path.join(a.out, "capacity.json"), "w") as f:
  json.dump({"best_rate_per_s": 1.25, "usage": body["usage"],
             "rows": [{"rate_per_s": 1.25, "meets_slo_p99": True}]}, f)
'''


@pytest.mark.slow
def test_capacity_step_with_a_stand_in_loadgen(tmp_path, monkeypatch):
  """The OpenAI-server capacity wiring (start, readiness, loadgen, capacity_rps, stop) against
  phaseserve's real server on `tiny`, with a stand-in for launch.lab.loadgen; vLLM absent."""
  (tmp_path / "fake_loadgen.py").write_text(_FAKE_LOADGEN)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(core.REPO)]))
  empty = tmp_path / "empty"
  empty.mkdir()
  cfg = core.PeersConfig(
      model="tiny", out=str(tmp_path / "out"), prompt=16, new_tokens=4, batches=(1,), repeats=1,
      offline=False, trace_requests=2, trace_prompt=8, trace_tokens=4,
      loadgen_module="fake_loadgen", loadgen_args="--find_capacity", capacity_context=256,
      ref_python=str(empty / "python"),
      llamacpp_bin=str(empty), vllm_python=str(empty / "python"), peak_size=64, bandwidth_mb=1,
      timeout_s=600)
  result = core.run(cfg)
  by = {r.engine: r for r in result.rows}
  assert by["phaseserve OpenAI server"].status == core.OK, by["phaseserve OpenAI server"].note
  assert by["phaseserve OpenAI server"].capacity_rps == 1.25
  assert "1.25/s met" in by["phaseserve OpenAI server"].note
  assert by["vLLM (CPU) OpenAI server"].status == core.NOT_INSTALLED
  assert any("launch.server" in c for c in result.commands)
