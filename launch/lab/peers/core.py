"""Other engines side by side on the same model and weights: the flag-free core of bench_peers.

Contract: ``run(cfg: PeersConfig, log) -> PeersResult`` and ``write(result, out_dir)``.
  * The model (``cfg.model``: ``smollm2-135m`` or a random preset) is loaded once and written under
    ``<out>/model/``: ``hf/`` (a bf16 Hugging Face Llama checkpoint with tokenizer.json,
    ``launch.lab.hf_export``), ``model-<float>.gguf`` (BF16 or F16) and ``model-q8_0.gguf``
    (``launch.lab.gguf_export``; SmolLM2's tokenizer keys copied from its GGUF file). Every engine
    reads these files: phaseserve the HF directory, transformers and vLLM the same directory,
    llama.cpp the GGUF files. ``<out>/trace.jsonl`` is the offline trace (random prompt ids).
  * Engines, each in a subprocess of its own interpreter (never imported here):
      - phaseserve: ``launch.lab.bench_model`` (bf16, and int8 in the default mode) for prefill tok/s
        at ``cfg.batches`` x ``cfg.prompt`` tokens and decode ms/step at those batches (context
        ``cfg.prompt``, ``cfg.new_tokens`` steps); with ``cfg.offline``, ``launch.serve_offline``
        (bf16) on the trace;
      - Hugging Face transformers (``cfg.ref_python``: ``tests/reference/bench_hf.py``, static
        KV cache where it works, prefill computing the last logits only as phaseserve's does),
        bf16;
      - llama.cpp (``llama-batched-bench`` in ``cfg.llamacpp_bin``) on the float and Q8_0 GGUF
        files, median of ``cfg.llamacpp_repeats`` runs (the best run in ``note``: its threads
        spin-wait, so one busy core of a shared machine slows a run by up to 30x);
      - vLLM's CPU build (``cfg.vllm_python``: ``launch/lab/peers/vllm_offline.py``) offline
        throughput on the trace, with ``cfg.offline``;
      - capacity at SLO through ``launch.lab.loadgen --api openai`` (plus ``cfg.loadgen_args``)
        against vLLM's OpenAI server and phaseserve's (``launch.server --http_port``, early
        rejection off: vLLM has none), both at ``cfg.capacity_context`` tokens of context, each
        started, awaited (``/health``, ``/ready``) and stopped here; ``capacity_rps`` is
        ``best_rate_per_s`` of loadgen's ``capacity.json`` (requests/s meeting the SLO at
        p99). Run only when ``launch.lab.loadgen`` exists (else the rows say
        ``not run`` and why).
  * Every engine gives rows (``PeerRow``), none is dropped: ``status`` is ``ok``, ``not installed``
    (``note`` names the make target), ``not run`` (``note`` says why) or ``failed`` (``note``: the
    error, the tail of its output). Figures of a row that is not ``ok`` are None.
  * Ratios: ``ps_speedup_*`` = phaseserve's speed / the row's speed in this run (> 1: phaseserve
    is faster) against the phaseserve row of the same weight class (bf16 for float weights,
    int8 for Q8_0): prefill tok/s, decode ms/step inverted, offline tok/s, capacity.
  * ``write`` puts ``peers.csv`` (``CSV_COLUMNS``) and ``peers.json`` (model, date, machine,
    config, files, commands, rows, raw outputs, ``complete``, ``stages``, ``resumed``) in
    ``out_dir``; ``run`` also writes them after each engine (``complete: false``), so an
    interrupted run keeps what it measured.
  * Resuming (``run(..., resume=True)``, the default): the engines run in ``STAGES``; a stage of an
    earlier ``peers.json`` in ``out_dir`` whose rows are all ``ok``, written with the same
    configuration (all but ``out`` and ``timeout_s``) by the same code on the same CPU
    (``provenance``: commit, a hash of uncommitted changes, CPU model), is read back instead of
    run again (its
    rows, raw outputs and commands; named in ``resumed``); the others run. ``progress`` wraps
    the stage loop (``launch.lab.bench_peers``: a tqdm bar).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[3]
OK, NOT_INSTALLED, NOT_RUN, FAILED = "ok", "not installed", "not run", "failed"


@dataclasses.dataclass(frozen=True)
class PeersConfig:
  model: str = "smollm2-135m"
  out: str = "build/peers"
  prompt: int = 128
  new_tokens: int = 32
  batches: tuple[int, ...] = (1, 8)
  repeats: int = 3
  llamacpp_repeats: int = 5  # one llama-batched-bench run per repeat (about 1 s each)
  param_seed: int = 0
  gguf_float: str = "BF16"  # BF16 | F16
  offline: bool = True
  trace_requests: int = 64
  trace_prompt: int = 128
  trace_tokens: int = 128
  loadgen: bool = True
  # More launch.lab.loadgen flags: its capacity search at the MLPerf "server" SLO (2 s / 200 ms).
  loadgen_args: str = ("--find_capacity --profile interactive --slo server --rate 0.5 "
                       "--max_rate 2 --search_steps 2 --num_requests 24 --seed 0")
  loadgen_module: str = "launch.lab.loadgen"
  capacity_context: int = 1024  # both servers' context limit; loadgen clips to it
  ref_python: str = str(REPO / ".venv-ref" / "bin" / "python")
  llamacpp_bin: str = str(REPO / ".peers" / "llamacpp" / "build" / "bin")
  vllm_python: str = str(REPO / ".venv-vllm" / "bin" / "python")
  project_python: str = sys.executable
  threads: int = os.cpu_count() or 1
  peak_size: int = 1024
  bandwidth_mb: int = 256
  timeout_s: float = 1800.0


@dataclasses.dataclass
class PeerRow:
  engine: str
  weights: str
  status: str
  note: str = ""
  version: str = ""
  prefill_tok_s: dict[int, float] = dataclasses.field(default_factory=dict)
  decode_ms: dict[int, float] = dataclasses.field(default_factory=dict)
  offline_tok_s: float | None = None
  capacity_rps: float | None = None
  ratios: dict[str, float] = dataclasses.field(default_factory=dict)
  compared_to: str = ""


STAGES = ("phaseserve", "transformers", "llama.cpp", "vLLM offline", "phaseserve offline",
          "capacity")
# Configuration fields that do not change what a stage measures (a resumed stage may differ).
_NOT_COMPARED = ("out", "timeout_s")


@dataclasses.dataclass
class PeersResult:
  config: PeersConfig
  date: str
  machine: dict[str, object]
  files: dict[str, str]
  commands: list[str]
  rows: list[PeerRow]
  raw: dict[str, object]
  wall_s: float = 0.0
  complete: bool = True  # False in the files written after each engine, before the last
  # Per stage: {"rows": [...], "raw": [raw keys], "commands": [...]} (what a resume reads back).
  stages: dict[str, dict[str, object]] = dataclasses.field(default_factory=dict)
  resumed: list[str] = dataclasses.field(default_factory=list)
  provenance: dict[str, str] = dataclasses.field(default_factory=dict)  # ``provenance()``


def csv_columns(batches: Sequence[int]) -> list[str]:
  cols = ["engine", "weights", "status", "version"]
  for b in batches:
    cols += [f"prefill_tok_s_b{b}", f"decode_ms_b{b}"]
  cols += ["offline_tok_s", "capacity_rps"]
  for b in batches:
    cols += [f"ps_speedup_prefill_b{b}", f"ps_speedup_decode_b{b}"]
  return cols + ["ps_speedup_offline", "ps_speedup_capacity", "compared_to", "note"]


CSV_COLUMNS = csv_columns((1, 8))


class _Failed(Exception):
  """A peer command failed: the message is the row's note."""


def _tail(text: str, n: int = 600) -> str:
  return " ".join(text.strip().split())[-n:]


def _sh(cmd: Sequence[str], env: dict[str, str] | None = None) -> str:
  pre = " ".join(f"{k}={v}" for k, v in (env or {}).items())
  return (pre + " " if pre else "") + shlex.join(cmd)


class _Runner:
  """Runs the peers' commands, recording each (with its env additions) for the JSON."""

  def __init__(self, cfg: PeersConfig, log: Callable[[str], None]):
    self.cfg, self.log = cfg, log
    self.commands: list[str] = []
    self.loads: list[float] = []  # 1-minute load average when each command started

  def __call__(self, cmd: Sequence[str], env: dict[str, str] | None = None,
               cwd: str | None = None) -> str:
    self.commands.append(_sh(cmd, env))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0
    self.log(f"$ {_sh(cmd, env)}  (load {load:.2f})")
    self.loads.append(round(load, 2))
    full_env = dict(os.environ)
    full_env.update(env or {})
    t0 = time.perf_counter()
    try:
      r = subprocess.run(list(cmd), env=full_env, cwd=cwd or str(REPO), capture_output=True,
                         text=True, timeout=self.cfg.timeout_s)
    except subprocess.TimeoutExpired:
      raise _Failed(f"timed out after {self.cfg.timeout_s:.0f} s: {_sh(cmd)}") from None
    except OSError as e:
      raise _Failed(f"could not start {cmd[0]}: {e}") from None
    self.log(f"  ({time.perf_counter() - t0:.0f} s, exit {r.returncode})")
    if r.returncode != 0:
      raise _Failed(f"exit {r.returncode}: {_tail(r.stderr or r.stdout)}")
    return r.stdout + ("\n" + r.stderr if r.stderr else "")


def _last_json(text: str) -> dict:
  for line in reversed(text.strip().splitlines()):
    line = line.strip()
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        continue
  raise _Failed(f"no JSON object in the output: {_tail(text)}")


def _executable(path: str) -> bool:
  return os.path.isfile(path) and os.access(path, os.X_OK)


def _peer_row(engine: str, weights: str, python: str, make_target: str) -> PeerRow:
  """The peer's row: ``ok`` so far, or ``not installed`` when its interpreter is missing."""
  if _executable(python):
    return PeerRow(engine, weights, OK)
  return PeerRow(engine, weights, NOT_INSTALLED,
                 note=f"no interpreter at {python}: run `make {make_target}`")


# --- the model, written once -------------------------------------------------------------------

def write_model(cfg: PeersConfig, out: Path) -> tuple[dict[str, str], dict[str, int | str]]:
  """Writes the HF dir, the GGUF files and the trace; returns (files, model info)."""
  import jax.numpy as jnp
  import numpy as np
  from models.io import loader
  from launch.lab.gguf_export import write_gguf
  from launch.lab.hf_export import byte_tokenizer, save_hf_checkpoint

  mcfg, params, tok = loader.load_model(cfg.model, dtype=jnp.float32, param_seed=cfg.param_seed)
  tokenizer_from = None
  if cfg.model in loader.TRAINED_MODELS:
    from models.io.gguf_import import installed_smollm2_path, open_gguf
    from models.text.gguf_tokenizer import build_tokenizer, read_gguf_vocab
    tokenizer_from = str(installed_smollm2_path())
    hf_tok = build_tokenizer(read_gguf_vocab(open_gguf(tokenizer_from)))
  else:
    hf_tok = byte_tokenizer()
  root = out / "model"
  hf_dir = save_hf_checkpoint(mcfg, params, root / "hf", "bfloat16", tokenizer=hf_tok,
                              bos_id=tok.bos_id, eos_id=tok.eos_id)
  fl = cfg.gguf_float.upper()
  files = {"hf_checkpoint": str(hf_dir),
           "gguf_float": str(write_gguf(mcfg, params, root / f"model-{fl.lower()}.gguf", fl,
                                        tokenizer_from)),
           "gguf_q8_0": str(write_gguf(mcfg, params, root / "model-q8_0.gguf", "Q8_0",
                                       tokenizer_from))}
  rng = np.random.default_rng(cfg.param_seed)
  trace = out / "trace.jsonl"
  with open(trace, "w", encoding="utf-8") as f:
    for _ in range(cfg.trace_requests):
      ids = rng.integers(0, min(mcfg.vocab_size, 1 << 15), cfg.trace_prompt).tolist()
      f.write(json.dumps({"prompt_ids": ids, "max_tokens": cfg.trace_tokens, "temperature": 0.0,
                          "ignore_eos": True}) + "\n")
  files["trace"] = str(trace)
  info: dict[str, int | str] = {
      "name": mcfg.name, "source": cfg.model, "param_count": mcfg.param_count(),
      "layers": mcfg.num_layers, "hidden": mcfg.embed_dim, "heads": mcfg.num_heads,
      "kv_heads": mcfg.num_kv_heads, "ffn": mcfg.mlp_dim, "vocab": mcfg.vocab_size}
  return files, info


# --- engines ----------------------------------------------------------------------------------

def _phaseserve(cfg: PeersConfig, run: _Runner, files: dict[str, str], raw: dict[str, object]
                ) -> list[PeerRow]:
  bs = ",".join(str(b) for b in cfg.batches)
  cmd = [cfg.project_python, "-m", "launch.lab.bench_model", "--model", files["hf_checkpoint"],
         "--dtype", "bfloat16", "--quantize", "both", "--prefill_tokens", str(cfg.prompt),
         "--prefill_batches", bs, "--prefill_max_tokens", str(max(cfg.batches) * cfg.prompt),
         "--decode_batches", bs, "--steps", str(cfg.new_tokens), "--context", str(cfg.prompt),
         "--repeats", str(cfg.repeats), "--floor_batches=", "--peak_size", str(cfg.peak_size),
         "--bandwidth_mb", str(cfg.bandwidth_mb), "--json"]
  try:
    res = _last_json(run(cmd))
  except _Failed as e:
    return [PeerRow("phaseserve", w, FAILED, str(e)) for w in ("bf16", "int8")]
  raw["phaseserve"] = {k: res.get(k) for k in ("prefill", "decode", "hardware", "cpu_lowering")}
  rows = []
  for quant in sorted({p["quantize"] for p in res["prefill"]}, key=lambda q: q != "none"):
    row = PeerRow("phaseserve", "bf16" if quant == "none" else f"int8 ({quant})", OK,
                  version=f"jax {res.get('jax_version', '')}")
    for p in res["prefill"]:
      if p["quantize"] == quant:
        row.prefill_tok_s[p["batch"]] = p["tokens_per_s"]
    for d in res["decode"]:
      if d["quantize"] == quant:
        row.decode_ms[d["batch"]] = d["ms_per_step"]
    rows.append(row)
  return rows


def _phaseserve_offline(cfg: PeersConfig, run: _Runner, files: dict[str, str],
                        raw: dict[str, object]) -> PeerRow:
  row = PeerRow("phaseserve serve_offline", "bf16", OK)
  if not cfg.offline:
    row.status, row.note = NOT_RUN, "offline trace off (--offline=false)"
    return row
  slots = min(cfg.trace_requests, 64)
  ctx = cfg.trace_prompt + cfg.trace_tokens
  cmd = [cfg.project_python, "-m", "launch.serve_offline", "--model", files["hf_checkpoint"],
         "--dtype", "bfloat16", "--requests", files["trace"], "--max_slots", str(slots),
         "--max_context", str(max(256, 1 << (ctx - 1).bit_length())),
         "--kv_pages", str(max(64, slots * ((ctx + 63) // 64) + 8)), "--json"]
  try:
    summary = _last_json(run(cmd))["summary"]
  except (_Failed, KeyError) as e:
    row.status, row.note = FAILED, str(e)
    return row
  raw["phaseserve_offline"] = summary
  row.offline_tok_s = summary["throughput_tok_s"]
  row.note = f"{summary['requests']} requests, {summary['seconds']} s after warm-up"
  return row


def _hf(cfg: PeersConfig, run: _Runner, files: dict[str, str], raw: dict[str, object]
        ) -> PeerRow:
  row = _peer_row("transformers", "bf16", cfg.ref_python, ".venv-ref/.stamp")
  if row.status == NOT_INSTALLED:
    return row
  cmd = [cfg.ref_python, str(REPO / "tests" / "reference" / "bench_hf.py"), "--checkpoint",
         files["hf_checkpoint"], "--dtype", "bfloat16", "--prompt", str(cfg.prompt),
         "--new_tokens", str(cfg.new_tokens), "--batches", ",".join(map(str, cfg.batches)),
         "--repeats", str(cfg.repeats), "--cache", "static", "--last_logits", "--json"]
  try:
    res = _last_json(run(cmd))
  except _Failed as e:
    row.status, row.note = FAILED, str(e)
    return row
  raw["transformers"] = res
  row.version = res.get("engine", "")
  row.note = f"cache: {res.get('cache')}; {res.get('threads')} threads"
  row.prefill_tok_s = {p["batch"]: p["tok_per_s"] for p in res["prefill"]}
  row.decode_ms = {d["batch"]: d["ms_per_token"] for d in res["decode"]}
  return row


def _llamacpp(cfg: PeersConfig, run: _Runner, files: dict[str, str], raw: dict[str, object]
              ) -> list[PeerRow]:
  binary = os.path.join(cfg.llamacpp_bin, "llama-batched-bench")
  weights = {cfg.gguf_float.upper(): files["gguf_float"], "Q8_0": files["gguf_q8_0"]}
  if not _executable(binary):
    return [PeerRow("llama.cpp", w, NOT_INSTALLED,
                    f"no {binary}: run `make peers-llamacpp` (about 10 minutes)")
            for w in weights]
  rows = []
  ctx = max(cfg.batches) * (cfg.prompt + cfg.new_tokens)
  for w, path in weights.items():
    row = PeerRow("llama.cpp", w, OK, version="llama-cpp-python sdist (vendored llama.cpp)")
    cmd = [binary, "-m", path, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp",
           str(cfg.prompt), "-ntg", str(cfg.new_tokens), "-npl", ",".join(map(str, cfg.batches)),
           "-t", str(cfg.threads), "--output-format", "jsonl"]
    try:
      runs: dict[int, list[dict]] = {}
      for _ in range(cfg.llamacpp_repeats):
        out = run(cmd)
        for line in out.splitlines():
          line = line.strip()
          if line.startswith("{") and '"speed_pp"' in line:
            rec = json.loads(line)
            runs.setdefault(int(rec["pl"]), []).append(rec)
      missing = [b for b in cfg.batches if b not in runs]
      if missing:
        raise _Failed(f"llama-batched-bench gave no result for batch {missing}: {_tail(out)}")
    except (_Failed, json.JSONDecodeError) as e:
      row.status, row.note = FAILED, str(e)
      rows.append(row)
      continue
    raw[f"llama.cpp {w}"] = runs
    best = []
    for b, recs in sorted(runs.items()):
      row.prefill_tok_s[b] = b * cfg.prompt / statistics.median(r["t_pp"] for r in recs)
      row.decode_ms[b] = statistics.median(r["t_tg"] for r in recs) / cfg.new_tokens * 1e3
      best.append(f"b{b} {b * cfg.prompt / min(r['t_pp'] for r in recs):.0f} tok/s, "
                  f"{min(r['t_tg'] for r in recs) / cfg.new_tokens * 1e3:.2f} ms/step")
    row.note = (f"{cfg.threads} threads, median of {cfg.llamacpp_repeats} runs; best run: "
                + "; ".join(best))
    rows.append(row)
  return rows


def _vllm(cfg: PeersConfig, run: _Runner, files: dict[str, str], raw: dict[str, object]
          ) -> PeerRow:
  row = _peer_row("vLLM (CPU)", "bf16", cfg.vllm_python, "peers-vllm")
  if row.status == NOT_INSTALLED:
    return row
  if not cfg.offline:
    row.status, row.note = NOT_RUN, "offline trace off (--offline=false)"
    return row
  out = Path(cfg.out) / "raw" / "vllm.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  ctx = cfg.trace_prompt + cfg.trace_tokens
  env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cfg.threads - 1}"}
  cmd = [cfg.vllm_python, str(REPO / "launch" / "peers" / "vllm_offline.py"), "--checkpoint",
         files["hf_checkpoint"], "--trace", files["trace"], "--out", str(out),
         "--max_model_len", str(max(512, 1 << (ctx - 1).bit_length())),
         "--max_num_seqs", str(min(cfg.trace_requests, 64))]
  try:
    run(cmd, env=env)
    res = json.loads(out.read_text())
  except (_Failed, OSError, json.JSONDecodeError) as e:
    row.status, row.note = FAILED, str(e)
    return row
  raw["vllm"] = res
  row.version = res.get("engine", "")
  row.offline_tok_s = res["throughput_tok_s"]
  row.note = (f"start-up {res['startup_s']:.0f} s; batch 1 {res['batch1_tok_s']:.1f} tok/s; "
              f"threads bound {env['VLLM_CPU_OMP_THREADS_BIND']}")
  return row


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _find_number(obj: object, key: str) -> float | None:
  """The first numeric value of ``key`` anywhere in a JSON document."""
  if isinstance(obj, dict):
    v = obj.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
      return float(v)
    children: list[object] = list(obj.values())
  elif isinstance(obj, list):
    children = list(obj)
  else:
    return None
  for c in children:
    found = _find_number(c, key)
    if found is not None:
      return found
  return None


def _serve_and_load(cfg: PeersConfig, run: _Runner, name: str, server_cmd: list[str],
                    ready_path: str, port: int, out: Path, served: str, vocab: int,
                    max_context: int, env: dict[str, str] | None = None
                    ) -> tuple[float, str]:
  """Starts ``server_cmd``, waits for ``ready_path`` to answer 200, runs ``launch.lab.loadgen --api
  openai`` against it and returns the capacity of its output (``capacity.json``'s
  ``best_rate_per_s``: the highest rate meeting the SLO at p99) and the rates tried; the server
  is stopped."""
  import signal
  import urllib.error
  import urllib.request
  out.mkdir(parents=True, exist_ok=True)
  run.commands.append(_sh(server_cmd, env) + " &")
  run.loads.append(round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else -1.0)
  run.log(f"$ {_sh(server_cmd, env)} &")
  full_env = dict(os.environ)
  full_env.update(env or {})
  with open(out / "server.log", "w", encoding="utf-8") as logf:
    proc = subprocess.Popen(server_cmd, env=full_env, cwd=str(REPO), stdout=logf,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
      deadline = time.monotonic() + cfg.timeout_s
      while True:
        if proc.poll() is not None:
          raise _Failed(f"{name} server exited {proc.returncode} before ready: "
                        f"{_tail((out / 'server.log').read_text())}")
        try:
          with urllib.request.urlopen(f"http://127.0.0.1:{port}{ready_path}", timeout=5) as r:
            if r.status == 200:
              break
        except (urllib.error.URLError, OSError):
          pass
        if time.monotonic() > deadline:
          raise _Failed(f"{name} server not ready after {cfg.timeout_s:.0f} s")
        time.sleep(2.0)
      run([cfg.project_python, "-m", cfg.loadgen_module, "--api", "openai", "--target",
           f"http://127.0.0.1:{port}", "--model", served, "--vocab_size", str(vocab),
           "--max_context", str(max_context), *shlex.split(cfg.loadgen_args), "--out",
           str(out / "loadgen")])
    finally:
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
  path = out / "loadgen" / "capacity.json"
  try:
    doc = json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise _Failed(f"launch.lab.loadgen wrote no readable {path}: {e}") from None
  value = _find_number(doc, "best_rate_per_s")
  tried = ", ".join(f"{r.get('rate_per_s')}/s {'met' if r.get('meets_slo_p99') else 'missed'}"
                    for r in doc.get("rows", []) if isinstance(r, dict))
  if value is None:
    raise _Failed(f"no rate met the SLO ({tried}); {path}")
  return value, f"rates: {tried} (the search stops at its --max_rate)"


def _capacity(cfg: PeersConfig, run: _Runner, files: dict[str, str], served: str, vocab: int,
              raw: dict[str, object]) -> list[PeerRow]:
  """Capacity at SLO of vLLM's and phaseserve's OpenAI servers through launch.lab.loadgen."""
  vllm_row = PeerRow("vLLM (CPU) OpenAI server", "bf16", OK)
  ps_row = PeerRow("phaseserve OpenAI server", "bf16", OK)
  rows = [vllm_row, ps_row]
  why = ""
  if not cfg.loadgen:
    why = "capacity at SLO off (--loadgen=false)"
  elif importlib.util.find_spec(cfg.loadgen_module) is None:
    why = ("launch.lab.loadgen is not on this branch yet (issue #11 item 4): capacity at SLO with "
           "`launch.lab.loadgen --api openai` not measured")
  if why:
    for r in rows:
      r.status, r.note = NOT_RUN, why
    return rows
  max_context = cfg.capacity_context
  ctx = str(max_context)
  root = Path(cfg.out) / "raw"
  if not _executable(cfg.vllm_python):
    vllm_row.status = NOT_INSTALLED
    vllm_row.note = f"no interpreter at {cfg.vllm_python}: run `make peers-vllm`"
  else:
    port = _free_port()
    cmd = [cfg.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
           files["hf_checkpoint"], "--served-model-name", served, "--dtype", "bfloat16",
           "--max-model-len", ctx, "--host", "127.0.0.1", "--port", str(port)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cfg.threads - 1}"}
    try:
      vllm_row.capacity_rps, vllm_row.note = _serve_and_load(
          cfg, run, "vLLM", cmd, "/health", port, root / "capacity_vllm", served, vocab,
          max_context, env)
    except _Failed as e:
      vllm_row.status, vllm_row.note = FAILED, str(e)
  port = _free_port()
  cmd = [cfg.project_python, "-m", "launch.server", "--model", files["hf_checkpoint"],
         "--dtype", "bfloat16", "--port", "0", "--http_port", str(port), "--served_model_name",
         served, "--max_context", ctx, "--early_reject=false"]
  try:
    ps_row.capacity_rps, ps_row.note = _serve_and_load(
        cfg, run, "phaseserve", cmd, "/ready", port, root / "capacity_phaseserve", served, vocab,
        max_context)
  except _Failed as e:
    ps_row.status, ps_row.note = FAILED, str(e)
  raw["capacity"] = {r.engine: r.capacity_rps for r in rows}
  return rows  # the capacity ratio is ``_ratios``'s


def _ratios(rows: list[PeerRow], batches: Sequence[int]) -> None:
  ps = {r.weights.split(" ")[0]: r for r in rows if r.engine == "phaseserve" and r.status == OK}
  offline = next((r for r in rows if r.engine == "phaseserve serve_offline" and r.status == OK
                  and r.offline_tok_s), None)
  server = next((r for r in rows if r.engine == "phaseserve OpenAI server" and r.capacity_rps),
                None)
  for r in rows:
    if r.status != OK or r.engine.startswith("phaseserve"):
      continue
    r.ratios = {}  # recomputed from this run's rows on every call
    against: list[str] = []
    ref = ps.get("int8" if r.weights.upper().startswith("Q8") else "bf16")
    if ref is not None:
      for b in batches:
        if b in r.prefill_tok_s and b in ref.prefill_tok_s:
          r.ratios[f"prefill_b{b}"] = ref.prefill_tok_s[b] / r.prefill_tok_s[b]
        if b in r.decode_ms and b in ref.decode_ms:
          r.ratios[f"decode_b{b}"] = r.decode_ms[b] / ref.decode_ms[b]
      if r.ratios:
        against.append(f"phaseserve {ref.weights}")
    if r.offline_tok_s and offline is not None:
      r.ratios["offline"] = offline.offline_tok_s / r.offline_tok_s
      against.append("serve_offline bf16")
    if r.capacity_rps and server is not None:
      r.ratios["capacity"] = server.capacity_rps / r.capacity_rps
      against.append(server.engine)
    r.compared_to = "; ".join(against)


def _row_from_json(d: dict) -> PeerRow:
  d = dict(d, ratios={}, compared_to="")  # ratios are recomputed from the rows of this run
  for k in ("prefill_tok_s", "decode_ms"):
    d[k] = {int(b): v for b, v in d[k].items()}
  return PeerRow(**d)


def provenance() -> dict[str, str]:
  """What else a measurement depends on: this checkout's commit and uncommitted changes (a hash
  of ``git diff HEAD``), and the CPU (``launch.machine``); empty strings outside a git tree."""
  import hashlib
  from launch import machine

  def git(*args: str) -> str:
    try:
      return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                            timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
      return ""
  return {"commit": git("rev-parse", "HEAD").strip(),
          "changes": hashlib.sha256(git("diff", "HEAD").encode()).hexdigest()[:16],
          "cpu": str(machine.describe().get("cpu", ""))}


def _earlier_stages(cfg: PeersConfig, out: Path, now: dict[str, str]) -> dict[str, dict]:
  """The stages of an earlier peers.json in ``out`` that can be read back (see the contract):
  the same configuration, commit, uncommitted changes and CPU (``provenance``)."""
  try:
    doc = json.loads((out / "peers.json").read_text())
  except (OSError, ValueError):
    return {}
  same = lambda c: {k: v for k, v in c.items() if k not in _NOT_COMPARED}
  config = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
  if same(doc.get("config", {})) != same(config) or doc.get("provenance") != now:
    return {}
  raw = doc.get("raw", {})
  found = {}
  for name, st in doc.get("stages", {}).items():
    rows = st.get("rows") or []
    if name not in STAGES or not rows or any(r.get("status") != OK for r in rows):
      continue
    if any(k not in raw for k in st.get("raw", [])):
      continue
    found[name] = {**st, "raw_values": {k: raw[k] for k in st.get("raw", [])}}
  return found


def run(cfg: PeersConfig, log: Callable[[str], None] = lambda m: None, *, resume: bool = True,
        progress: Callable[[Sequence[str]], Sequence[str]] = lambda it: it) -> PeersResult:
  from launch import machine
  t0 = time.perf_counter()
  out = Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  made_by = provenance()
  earlier = _earlier_stages(cfg, out, made_by) if resume else {}
  log(f"writing {cfg.model} under {out / 'model'}")
  files, info = write_model(cfg, out)
  runner = _Runner(cfg, log)
  raw: dict[str, object] = {"model": info}
  rows: list[PeerRow] = []
  stages: dict[str, dict[str, object]] = {}
  resumed: list[str] = []

  def result(complete: bool) -> PeersResult:
    _ratios(rows, cfg.batches)
    return PeersResult(
        config=cfg,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=machine.describe(), files=files, commands=runner.commands, rows=list(rows),
        raw=raw | {"load_avg_1m_per_command": runner.loads},
        wall_s=time.perf_counter() - t0, complete=complete, stages=dict(stages),
        resumed=list(resumed), provenance=made_by)

  def offline_stage() -> list[PeerRow]:
    if any(r.engine == "vLLM (CPU)" and r.status == OK for r in rows):
      return [_phaseserve_offline(cfg, runner, files, raw)]
    return [PeerRow("phaseserve serve_offline", "bf16", NOT_RUN,
                    "run only beside vLLM's offline trace (vLLM row not ok)")]

  engines: dict[str, Callable[[], list[PeerRow]]] = {
      "phaseserve": lambda: _phaseserve(cfg, runner, files, raw),
      "transformers": lambda: [_hf(cfg, runner, files, raw)],
      "llama.cpp": lambda: _llamacpp(cfg, runner, files, raw),
      "vLLM offline": lambda: [_vllm(cfg, runner, files, raw)],
      "phaseserve offline": offline_stage,
      "capacity": lambda: _capacity(cfg, runner, files, str(info["name"]), int(info["vocab"]),
                                    raw),
  }
  for name in progress(STAGES):
    # The offline stage is only as valid as the vLLM stage it runs beside.
    reuse = name in earlier and (name != "phaseserve offline" or "vLLM offline" in resumed)
    if reuse:
      st = earlier[name]
      new_rows = [_row_from_json(r) for r in st["rows"]]
      raw.update(st["raw_values"])
      runner.commands.extend(st.get("commands", []))
      runner.loads.extend(st.get("loads") or [None] * len(st.get("commands", [])))
      resumed.append(name)
      log(f"{name}: read back from the earlier {out / 'peers.json'}")
    else:
      keys, n_cmds = set(raw), len(runner.commands)
      new_rows = engines[name]()
      st = {"raw": sorted(set(raw) - keys), "commands": runner.commands[n_cmds:],
            "loads": runner.loads[n_cmds:]}
    stages[name] = {"rows": [dataclasses.asdict(r) for r in new_rows],
                    "raw": st["raw"], "commands": list(st.get("commands", [])),
                    "loads": list(st.get("loads") or [])}
    rows.extend(new_rows)
    write(result(complete=False), out)  # the files so far survive an interrupted run
  return result(complete=True)


def _csv_row(r: PeerRow, batches: Sequence[int]) -> dict[str, object]:
  d: dict[str, object] = {"engine": r.engine, "weights": r.weights, "status": r.status,
                          "version": r.version, "offline_tok_s": r.offline_tok_s,
                          "capacity_rps": r.capacity_rps,
                          "ps_speedup_offline": r.ratios.get("offline"),
                          "ps_speedup_capacity": r.ratios.get("capacity"),
                          "compared_to": r.compared_to, "note": r.note}
  for b in batches:
    d[f"prefill_tok_s_b{b}"] = r.prefill_tok_s.get(b)
    d[f"decode_ms_b{b}"] = r.decode_ms.get(b)
    d[f"ps_speedup_prefill_b{b}"] = r.ratios.get(f"prefill_b{b}")
    d[f"ps_speedup_decode_b{b}"] = r.ratios.get(f"decode_b{b}")
  return {k: ("" if v is None else round(v, 4) if isinstance(v, float) else v)
          for k, v in d.items()}


def write(result: PeersResult, out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  cols = csv_columns(result.config.batches)
  csv_path, json_path = out / "peers.csv", out / "peers.json"
  with open(csv_path, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    for r in result.rows:
      w.writerow(_csv_row(r, result.config.batches))
  doc = {"date": result.date, "complete": result.complete, "machine": result.machine,
         "config": dataclasses.asdict(result.config), "files": result.files,
         "commands": result.commands, "wall_s": result.wall_s,
         "rows": [dataclasses.asdict(r) for r in result.rows], "raw": result.raw,
         "stages": result.stages, "resumed": result.resumed, "provenance": result.provenance}
  json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
  return csv_path, json_path


def table(result: PeersResult) -> str:
  bs = result.config.batches
  head = (["engine", "weights", "status"] + [f"prefill b{b}" for b in bs]
          + [f"ms/step b{b}" for b in bs] + ["offline tok/s", "capacity req/s"]
          + [f"ps x pf b{b}" for b in bs] + [f"ps x dec b{b}" for b in bs]
          + ["ps x offline", "ps x capacity"])
  lines = [f"{result.raw.get('model', {})} on {result.machine.get('cpu')} at {result.date}",
           " | ".join(head)]

  def f(v: float | None, p: int = 1) -> str:
    return "-" if v is None else f"{v:.{p}f}"

  for r in result.rows:
    cells = ([r.engine, r.weights, r.status] + [f(r.prefill_tok_s.get(b), 0) for b in bs]
             + [f(r.decode_ms.get(b), 2) for b in bs]
             + [f(r.offline_tok_s, 0), f(r.capacity_rps, 2)]
             + [f(r.ratios.get(f"prefill_b{b}"), 2) for b in bs]
             + [f(r.ratios.get(f"decode_b{b}"), 2) for b in bs]
             + [f(r.ratios.get("offline"), 2), f(r.ratios.get("capacity"), 2)])
    lines.append(" | ".join(cells) + (f"  ({r.note})" if r.note and r.status != OK else ""))
  return "\n".join(lines)


__all__ = ["CSV_COLUMNS", "FAILED", "NOT_INSTALLED", "NOT_RUN", "OK", "PeerRow", "PeersConfig",
           "PeersResult", "STAGES", "csv_columns", "run", "table", "write", "write_model"]
