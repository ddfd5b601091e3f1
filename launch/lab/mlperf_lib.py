"""LoadGen's Server scenario driving a streaming client (``launch.lab.mlperf_server``'s engine).

Contract: ``run_server_scenario(...) -> dict`` runs one LoadGen test (Server, PerformanceOnly,
token latencies) whose SUT sends each query through a ``launch.lab.loadgen_lib.drivers`` driver on
an asyncio loop in a background thread, writes LoadGen's logs and ``summary.json`` under
``out_dir`` and returns the summary (with ``metrics_url``, the server's step breakdown over the
run: ``launch.lab.server_steps``, and p50 TPOT over its decode-only step); it first waits up to ``ready_timeout_s`` for a one-token
request to succeed (a server warming up refuses; ``TimeoutError`` if it never does). ``read_detail(path)`` reads the ``:::MLLOG`` records of
``mlperf_log_detail.txt`` as {key: value}; ``side_by_side(dirs, names)`` is a markdown table of
their summaries (and of their server step breakdowns, where they have one).
"""

from __future__ import annotations

import array
import asyncio
import collections
import json
import os
import threading
import time
from typing import Sequence

import numpy as np

from launch.lab import server_steps
from launch.lab.loadgen_lib.drivers import REJECTED, DriverConfig, Outcome, make_driver
from launch.lab.loadgen_lib.workload import ids_to_text
from serving.step_timeline import PHASES

_PCTS = ("50.00", "90.00", "99.00")


def _samples(n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int
             ) -> list[tuple[tuple[int, ...], str, int]]:
  rng = np.random.default_rng(seed)
  lo_id = min(100, vocab // 4)
  out = []
  for _ in range(n):
    ids = tuple(int(i) for i in rng.integers(lo_id, vocab, int(rng.integers(prompt[0],
                                                                            prompt[1] + 1))))
    out.append((ids, ids_to_text(ids), int(rng.integers(output[0], output[1] + 1))))
  return out


def read_detail(path: str) -> dict[str, object]:
  got: dict[str, object] = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.startswith(":::MLLOG"):
        rec = json.loads(line[len(":::MLLOG"):])
        got[rec["key"]] = rec["value"]
  return got


def _ms(detail: dict[str, object], key: str) -> float | None:
  v = detail.get(key)
  return round(float(v) / 1e6, 1) if isinstance(v, (int, float)) else None


def run_server_scenario(*, api: str, target: str, model: str, out_dir: str, qps: float,
                        queries: int, min_duration_s: float, ttft_s: float, tpot_s: float,
                        samples: int, prompt: tuple[int, int], output: tuple[int, int],
                        vocab_size: int, seed: int, timeout_s: float,
                        ready_timeout_s: float = 600.0, metrics_url: str = "") -> dict:
  import mlperf_loadgen as lg
  os.makedirs(out_dir, exist_ok=True)
  data = _samples(samples, prompt, output, vocab_size, seed)
  driver_cfg = DriverConfig(api, target, model=model, timeout_s=timeout_s)
  loop = asyncio.new_event_loop()
  thread = threading.Thread(target=loop.run_forever, name="mlperf-client", daemon=True)
  thread.start()
  driver = asyncio.run_coroutine_threadsafe(_make(driver_cfg), loop).result()
  probe = data[0][0][:4], ids_to_text(data[0][0][:4])
  if not asyncio.run_coroutine_threadsafe(_ready(driver, probe, ready_timeout_s),
                                          loop).result():
    asyncio.run_coroutine_threadsafe(driver.close(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    raise TimeoutError(f"{target} did not answer a one-token request within "
                       f"{ready_timeout_s:g} s")
  statuses: collections.Counter[str] = collections.Counter()
  errors: list[str] = []
  lock = threading.Lock()

  def respond(qid: int, n_tokens: int, first: bool) -> None:
    buf = array.array("B", np.zeros(max(1, n_tokens), np.int32).tobytes())
    addr, size = buf.buffer_info()
    resp = [lg.QuerySampleResponse(qid, addr, size, n_tokens)]
    (lg.FirstTokenComplete if first else lg.QuerySamplesComplete)(resp)

  async def one(qid: int, index: int) -> None:
    ids, text, max_tokens = data[index]
    sent_first = []

    def on_first() -> None:
      sent_first.append(True)
      respond(qid, 1, True)

    try:
      got: Outcome = await driver.generate(ids, text, max_tokens, "", on_first=on_first)
      status, tokens, error = got.status, got.output_tokens, got.error
    except Exception as e:  # a client bug must still complete the query, or LoadGen waits forever
      status, tokens, error = type(e).__name__, 0, str(e)[:300]
    with lock:
      statuses[status] += 1
      if status != "ok" and status not in REJECTED and len(errors) < 5:
        errors.append(f"{status}: {error}")
    if not sent_first:  # refused or failed before a token: the query still completes
      respond(qid, 1, True)
    respond(qid, tokens if status == "ok" else 0, False)

  def issue(query_samples) -> None:
    for q in query_samples:
      asyncio.run_coroutine_threadsafe(one(q.id, q.index), loop)

  settings = lg.TestSettings()
  settings.scenario = lg.TestScenario.Server
  settings.mode = lg.TestMode.PerformanceOnly
  settings.server_target_qps = qps
  settings.use_token_latencies = True
  settings.ttft_latency = int(ttft_s * 1e9)
  settings.tpot_latency = int(tpot_s * 1e9)
  settings.min_query_count = queries
  settings.max_query_count = queries
  settings.min_duration_ms = int(min_duration_s * 1e3)
  settings.schedule_rng_seed = settings.sample_index_rng_seed = seed + 1
  log_out = lg.LogOutputSettings()
  log_out.outdir = out_dir
  log_out.copy_summary_to_stdout = False
  log_settings = lg.LogSettings()
  log_settings.log_output = log_out
  log_settings.enable_trace = False  # a ~25 MB trace per run; the summary and detail suffice
  sut = lg.ConstructSUT(issue, lambda: None)
  qsl = lg.ConstructQSL(len(data), len(data), lambda s: None, lambda s: None)
  before = server_steps.scrape(metrics_url) if metrics_url else {}
  t0 = time.monotonic()
  try:
    lg.StartTestWithLogSettings(sut, qsl, settings, log_settings)
    steps = (server_steps.breakdown(before, server_steps.scrape(metrics_url),
                                    time.monotonic() - t0) if metrics_url else None)
  finally:
    lg.DestroyQSL(qsl)
    lg.DestroySUT(sut)
    asyncio.run_coroutine_threadsafe(driver.close(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)
  detail = read_detail(os.path.join(out_dir, "mlperf_log_detail.txt"))
  refused = sum(n for s, n in statuses.items() if s in REJECTED)
  failed = sum(n for s, n in statuses.items() if s != "ok" and s not in REJECTED)
  summary = {
      "api": api, "target": target, "target_qps": qps, "queries": sum(statuses.values()),
      "ttft_target_ms": ttft_s * 1e3, "tpot_target_ms": tpot_s * 1e3,
      "result": detail.get("result_validity"),
      "invalid_reason": detail.get("result_invalid_reason") or None,
      "perf_constraints_met": detail.get("result_perf_constraints_met"),
      "early_stopping_met": detail.get("early_stopping_met"),
      "min_queries_met": detail.get("result_min_queries_met"),
      "early_stopping_ttft": detail.get("early_stopping_ttft_result"),
      "early_stopping_tpot": detail.get("early_stopping_tpot_result"),
      "completed_qps": detail.get("result_completed_samples_per_sec"),
      "ttft_ms": {p.split(".")[0]: _ms(detail, f"result_first_token_{p}_percentile_latency_ns")
                  for p in _PCTS},
      "tpot_ms": {p.split(".")[0]: _ms(detail, f"result_time_per_output_token_{p}_percentile_ns")
                  for p in _PCTS},
      "refused": refused, "failed": failed, "statuses": dict(statuses), "errors": errors,
      "server_steps": steps}
  tpot50, decode = summary["tpot_ms"]["50"], steps and steps.get("decode_only_step_ms")
  summary["tpot_p50_over_decode_step"] = tpot50 / decode if tpot50 and decode else None
  with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  return summary


async def _ready(driver, probe: tuple[tuple[int, ...], str], timeout_s: float) -> bool:
  """Until a one-token request succeeds (a server still warming up answers 503 / UNAVAILABLE)."""
  deadline = asyncio.get_running_loop().time() + timeout_s
  while True:
    got = await driver.generate(probe[0], probe[1], 1, "")
    if got.status == "ok":
      return True
    if asyncio.get_running_loop().time() > deadline:
      return False
    await asyncio.sleep(1.0)


async def _make(cfg: DriverConfig):
  return make_driver(cfg)  # in the loop's thread: aiohttp's session belongs to its loop


def _ratios(steps: dict) -> str:
  pred = steps.get("ttft_prediction") or {}
  if not pred.get("requests"):
    return "-"
  return " / ".join(f"{pred[k]:.2f}" for k in ("ratio_p10", "ratio_p50", "ratio_p90"))


def side_by_side(dirs: Sequence[str], names: Sequence[str]) -> str:
  rows = ["| server | target QPS | completed QPS | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 "
          "ms | refused | failed | LoadGen |", "|---|---:|---:|---|---|---:|---:|---|"]
  summaries = []
  for d, name in zip(dirs, names):
    with open(os.path.join(d, "summary.json"), encoding="utf-8") as f:
      s = json.load(f)
    summaries.append(s)
    trio = lambda m: " / ".join("-" if m.get(p) is None else f"{m[p]:,.1f}" for p in ("50", "90",
                                                                                      "99"))
    qps = s["completed_qps"]
    rows.append(f"| {name} | {s['target_qps']:g} | {'-' if qps is None else f'{qps:.2f}'} | "
                f"{trio(s['ttft_ms'])} | {trio(s['tpot_ms'])} | {s['refused']} | {s['failed']} | "
                f"{s['result']} |")
  steps = [(name, s) for name, s in zip(names, summaries) if s.get("server_steps")]
  if steps:
    rows += ["", "| server | steps/s | decode rows | prefill tok/step | " + " | ".join(
        f"{p} ms" for p in PHASES) + " | host off-CPU ms | decode-only step ms | TPOT p50 / "
        "decode step | compiled | TTFT actual / predicted p10 / p50 / p90 |",
        "|---|" + "---:|" * (len(PHASES) + 8)]
    for name, s in steps:
      st, f = s["server_steps"], lambda v, fmt: "-" if v is None else format(v, fmt)
      rows.append(f"| {name} | {f(st.get('steps_per_s'), '.1f')} | "
                  f"{f(st.get('mean_decode_rows'), '.1f')} | "
                  f"{f(st.get('prefill_tokens_per_step'), '.1f')} | " +
                  " | ".join(f(st['phases_ms'][p]['wall'], '.2f') for p in PHASES) +
                  f" | {f(st.get('host_off_cpu_ms'), '.2f')} | "
                  f"{f(st.get('decode_only_step_ms'), '.1f')} | "
                  f"{f(s.get('tpot_p50_over_decode_step'), '.2f')} | "
                  f"{f(st.get('programs_after_ready'), '.0f')} | {_ratios(st)} |")
  return "\n".join(rows) + "\n"
