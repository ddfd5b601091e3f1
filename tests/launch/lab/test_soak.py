"""launch.lab.soak: the analysis on made-up numbers, and a short soak of a real tiny server.

The short soak (``test_short_soak_passes``) runs ``python -m launch.lab.soak --model tiny`` for about
a minute of traffic (plus the server's start-up) with scaled-down knobs, in its own process
group under a hard timeout (the server dies with it: ``PR_SET_PDEATHSIG``, and the group is
killed on any failure), and requires every assertion of its JSON report to pass and every
traffic kind to have run. Its slope bounds are looser than the soak's defaults: a 30 s second
half measures allocator and thread-pool noise, not a trend (measured on 2 cores: RSS 5-26% of
its mean per 10 min, mappings 14-56 per minute as the gRPC server's thread pool grows, two per
new worker thread), so at about 12 requests/s here they catch only gross leaks: an fd per
request, a mapping per 5 requests, 10 KB of RSS per request.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

# Not launch.lab.soak itself: importing it defines its absl flags (--model, ...) in this process,
# which collides with another CLI's test in the same pytest worker.
from launch.lab.soak_lib import report as soak_report, traffic as soak_traffic
from launch.cli import CliError
from launch.lab.soak_lib.server_proc import scrape, slope_per_min
from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS

# The tiny model's server, sized for few programs to warm up (20: decode rows 1-8 x 4 attended
# lengths, one 16-token prefill chunk x 4): context 128, 16-position pages. The flatness bounds
# are a short run's: over a 12 s window the open connections of a burst alone swing the fd slope
# to 14 a minute (fds 16 -> 13, a CI run), while a handle leaked per request at 4 qps adds 240.
SERVER = ("--max_context", "128", "--max_slots", "8", "--kv_pages", "128", "--page_size", "16",
          "--max_chunk", "16", "--max_prefill_chunks", "1")
KNOBS = ("--duration_s", "24", "--idle_s", "3", "--idle_every_s", "12", "--qps", "4",
         "--long_tokens", "3000", "--steady_steps", "2000", "--steady_rows", "4",
         "--max_tokens", "24", "--burst_every_s", "8", "--burst_s", "3", "--burst_grace_s", "4",
         "--sample_s", "1", "--ready_timeout_s", "360", "--drain_timeout_s", "90",
         "--request_timeout_s", "90", "--stop_grace_s", "20",
         "--max_rss_pct_per_10min", "100", "--max_fds_per_min", "40", "--max_maps_per_min", "150",
         "--max_threads_per_min", "60")
HARD_TIMEOUT_S = 600


def test_plan_and_bursts():
  assert soak_traffic.plan(100, 8, 50) == (2, 42.0)
  assert soak_traffic.plan(1800, 30, 300) == (6, 270.0)
  with pytest.raises(CliError):
    soak_traffic.plan(20, 15, 10)
  # bursts at 15, 45, 75 s of active time; the second stretch starts at 42 s of active time
  assert soak_traffic.bursts_in(0, 42, 30, 5) == [(15, 20)]
  assert soak_traffic.bursts_in(42, 84, 30, 5) == [(3, 8), (33, 38)]
  assert soak_traffic.bursts_in(0, 17, 30, 5) == [(15, 17)]  # clipped at the stretch's end
  assert soak_traffic.bursts_in(0, 42, 30, 0) == []


def test_status_categories():
  assert soak_report.category("ok", 5) == "ok"
  assert soak_report.category("cancelled_by_client", 3) == "cancelled"
  assert soak_report.category("http_429", 0) == "refused"
  assert soak_report.category("RESOURCE_EXHAUSTED", 0) == "refused"
  # RESOURCE_EXHAUSTED after tokens is a slow consumer cut off, not a refusal at arrival
  assert soak_report.category("RESOURCE_EXHAUSTED", 7) == "error"
  for status in ("http_500", "http_503", "INTERNAL", "UNAVAILABLE", "stream_error",
                 "stream_truncated", "bad_response", "http_400", "CANCELLED"):
    assert soak_report.category(status, 0) == "error"


def test_slope_per_min():
  ts = [0.0, 30.0, 60.0, 90.0, 120.0]
  assert slope_per_min(ts, [10, 11, 12, 13, 14]) == pytest.approx(2.0)
  assert slope_per_min(ts, [5, 5, 5, 5, 5]) == pytest.approx(0.0)
  assert slope_per_min(ts, [5, None, 5, None, 5]) == pytest.approx(0.0)
  assert slope_per_min(ts[:2], [1, 2]) is None  # too few points


def test_scrape_sums_labels_and_tells_absent_from_zero():
  text = "\n".join([
      "# HELP phaseserve_kv_pages_used KV pages in use",
      "# TYPE phaseserve_kv_pages_used gauge",
      "phaseserve_kv_pages_used 3.0",
      "# HELP phaseserve_loop_failures serving loop failures by kind",
      "# TYPE phaseserve_loop_failures counter",  # registered, never incremented: 0
      "# HELP phaseserve_internal_errors exceptions caught",
      "# TYPE phaseserve_internal_errors counter",
      'phaseserve_internal_errors_total{part="metrics"} 2.0',
      'phaseserve_internal_errors_total{part="trace"} 1.0',
      'phaseserve_internal_errors_created{part="trace"} 1.7e9',
      "# HELP phaseserve_engine_faults engine steps that raised",
      "# TYPE phaseserve_engine_faults gauge",
      "phaseserve_engine_faults 0.0", ""])
  m = scrape(text)
  assert m["kv_pages_used"] == 3.0 and m["internal_errors"] == 3.0
  assert m["loop_failures"] == 0.0 and m["engine_faults"] == 0.0
  assert m["compiled_programs"] is None  # not exported: the assertion is skipped
  m = scrape(text + "\n".join([
      "# HELP phaseserve_programs_loaded XLA programs", "# TYPE phaseserve_programs_loaded gauge",
      "phaseserve_programs_loaded 57.0", ""]))
  assert m["compiled_programs"] == 57.0 and m["programs_after_ready"] is None


def _analyze(**kw):
  cfg = {"max_refused_frac": 0.05, "max_fds_per_min": 1.0, "max_maps_per_min": 1.0,
         "max_threads_per_min": 1.0,
         "max_rss_pct_per_10min": 1.0, "long_tokens": 10, "steady_steps": 10, "steady_rows": 1}
  rows = [{"t_s": float(t), "phase": "active", "alive": True, "rss_bytes": 1e9, "fds": 20,
           "maps": 1000 + (t if kw.get("leak") else 0) + (6 if kw.get("pool") and t >= 420 else 0),
           "threads": 30 + (2 if kw.get("pool") and t >= 420 else 0) +
                      (t // 5 if kw.get("threads") else 0),
           "http_health": 200, "http_ready": 200,
           "grpc_live": "SERVING", "grpc_ready": "SERVING", "compiled_programs": 40,
           "loop_failures": 0.0, "engine_faults": 0.0, "internal_errors": 0.0}
          for t in range(0, 600, 5)]  # ten minutes
  R = soak_report.Rec
  recs = [R("openai_completions", "long_sinks", "long", 1, "ok", "ok", output_tokens=10),
          R("phaseserve_grpc", "steady_ignore_eos", "steady", 1, "ok", "ok", output_tokens=12),
          R("openai_chat", "probe", "probe_idle", 50, *kw.get("probe", ("ok", "ok"))),
          R("phaseserve_grpc", "probe", "probe_quiet", 40, "ok", "ok"),
          R("jetstream", "decode", "ordinary", 3, *kw.get("decode", ("ok", "ok")))]
  gaps = [{"kv_pages_used": kw.get("kv", 0), "running": 0, "queue": 0}]
  end = dict(rows[-1], compiled_programs=kw.get("programs_end", 40),
             programs_after_ready=kw.get("after_ready", 0))
  return soak_report.analyze(cfg, recs, rows, gaps, [{"cycle": 0, "completed": True}], [12], [1],
                             rows[0], end, "", 0, [("jetstream", "decode")],
                             {"lines": 0, "first": []})


def test_analyze_passes_a_clean_run_and_names_each_failure():
  assert _analyze()["failed"] == []
  assert _analyze(leak=True)["failed"] == ["maps_flat"]
  # a pool that reaches a new peak (2 threads, 3 mappings each): a step, not a leak
  pooled = _analyze(pool=True)
  assert pooled["failed"] == [] and pooled["slopes"]["maps"]["slope_per_min"] > 1
  assert _analyze(threads=True)["failed"] == ["threads_flat"]  # a thread per request
  assert _analyze(kv=3)["failed"] == ["kv_pages_released"]
  assert _analyze(programs_end=41)["failed"] == ["programs_constant"]
  assert _analyze(after_ready=1)["failed"] == ["programs_constant"]
  assert _analyze(probe=("http_429", "refused"))["failed"] == ["no_refusal_while_idle",
                                                                "every_kind_ran"]
  r = _analyze(decode=("INTERNAL", "error"))
  assert r["failed"] == ["no_request_errors", "every_kind_ran"]
  assert r["assertions"]["no_request_errors"]["by_status"] == {"jetstream/decode: INTERNAL": 1}


@pytest.mark.slow  # suite time (87 s): serving changes get the 10-minute soak (BUILD_NOTES)
def test_short_soak_passes(tmp_path):
  out = tmp_path / "soak"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS, PYTHONUNBUFFERED="1")
  cmd = [sys.executable, "-m", "launch.lab.soak", "--model", "tiny", *KNOBS, "--out", str(out),
         "--", *SERVER]
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    stdout, stderr = proc.communicate(timeout=HARD_TIMEOUT_S)
  finally:
    if proc.poll() is None:  # timed out (or interrupted): the soak and its server, at once
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate(timeout=60)
  log = lambda: (out / "server.log").read_text(errors="replace")[-3000:] \
      if (out / "server.log").exists() else ""
  assert stdout.strip(), f"no report (rc {proc.returncode}): {stderr[-3000:]}\n{log()}"
  report = json.loads(stdout.strip().splitlines()[-1])
  assert report == json.loads((out / "report.json").read_text())
  for name in ("samples.csv", "requests.csv", "server.log"):
    assert (out / name).stat().st_size > 0
  failed = {k: v for k, v in report["assertions"].items() if not v["pass"]}
  assert not failed and report["ok"] and proc.returncode == 0, (
      json.dumps(failed, indent=1)[:6000] + "\n" + log())
  # every traffic kind ran
  reqs = report["requests"]
  for role in ("ordinary", "steady", "long", "probe_quiet", "probe_idle"):
    assert reqs["by_role"].get(role, 0) > 0, role
  assert reqs["by_category"].get("cancelled", 0) > 0
  kinds = reqs["by_api_kind_status"]
  assert set(kinds) == {"openai_completions", "openai_chat", "phaseserve_grpc", "jetstream"}
  for api, by_kind in kinds.items():
    for kind, statuses in by_kind.items():
      assert sum(statuses.values()) > 0, (api, kind)
  assert report["bursts"]["count"] >= 2 and report["bursts"]["requests_in_bursts"] > 0
  assert len(report["idle_gaps"]) == 2 and report["prefix_cache"]["with_cached_tokens"] > 0
  assert report["long_generation"]["tokens"] >= 3000
  assert report["steady_batch"]["steps"] >= 2000
  assert report["latency_ordinary_streaming"]["ttft_s"]["count"] > 0
  assert "skipped" not in report["assertions"]["programs_constant"]  # the server counts them
