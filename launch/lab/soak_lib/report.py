"""The soak's report (``launch.lab.soak``): one record per request, and the analysis of a run.

Contract:
  * ``Rec``: one request as the report reads it (``REC_COLUMNS``: the columns of
    ``requests.csv``); ``category(status, tokens)`` sorts an end status into ``ok``,
    ``cancelled`` (by its own client), ``refused`` (HTTP 429, or RESOURCE_EXHAUSTED before any
    token) or ``error``; ``abandoned`` (by the soak) is set by the sender, not here.
  * ``analyze(cfg, recs, samples, gaps, drains, lane_tokens, lane_generations, ready_row,
    end_row, why, exit_code, kinds, log, bursts=0) -> dict``: the report without the run's
    header: ``ok``, ``failed`` (names), ``assertions`` (each ``{"pass": bool, ...numbers}``, as
    ``launch.lab.soak``'s docstring defines them) and the summaries (requests, errors, refusals,
    bursts, programs, slopes, idle gaps, drains, latency, prefix cache, the long generation, the
    steady batch, the server log's problems). Pure: no I/O, no clock.
"""

from __future__ import annotations

import collections
import dataclasses

MAPS_PER_THREAD = 3  # a thread's stack, its guard page and its malloc arena


@dataclasses.dataclass
class Rec:
  api: str
  kind: str
  role: str = "ordinary"  # ordinary | probe_quiet | probe_idle | long | steady
  t_s: float = 0.0        # sent, seconds since readiness
  status: str = ""
  category: str = ""      # ok | cancelled | refused | error | abandoned (by the soak)
  error: str = ""
  in_burst: bool = False
  stream: bool = True
  n: int = 1
  output_tokens: int = 0
  cached_tokens: int | None = None
  finish: str = ""
  ttft_s: float | None = None
  tpot_s: float | None = None
  e2e_s: float = 0.0
  lane: int | None = None


REC_COLUMNS = tuple(f.name for f in dataclasses.fields(Rec))


def category(status: str, tokens: int) -> str:
  if status == "ok":
    return "ok"
  if status == "cancelled_by_client":
    return "cancelled"
  if status == "http_429" or (status == "RESOURCE_EXHAUSTED" and tokens == 0):
    return "refused"
  return "error"


def _pct(xs: list[float]) -> dict:
  from launch.lab.soak_lib.server_proc import percentile
  return {"count": len(xs), "p50": percentile(xs, 0.5), "p99": percentile(xs, 0.99)}


def _assert(ok: bool, **numbers) -> dict:
  return {"pass": bool(ok), **numbers}


def analyze(cfg: dict, recs: list[Rec], samples: list[dict], gaps: list[dict], drains: list[dict],
            lane_tokens: list[int], lane_generations: list[int], ready_row: dict,
            end_row: dict | None, why: str, exit_code: int | None, kinds: list[tuple[str, str]],
            log: dict, bursts: int = 0) -> dict:
  from launch.lab.soak_lib.server_proc import slope_per_min
  by_kind: dict = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
  for r in recs:
    by_kind[r.api][r.kind][r.status] += 1
  errors = [r for r in recs if r.category == "error"]
  refused = [r for r in recs if r.category == "refused"]
  ordinary = [r for r in recs if r.role == "ordinary"]
  probes = [r for r in recs if r.role.startswith("probe")]
  outside = [r for r in recs if r.role in ("ordinary", "steady", "long") and not r.in_burst]
  refused_outside = [r for r in outside if r.category == "refused"]
  a: dict[str, dict] = {}
  a["no_request_errors"] = _assert(
      not errors, errors=len(errors),
      by_status=dict(collections.Counter(f"{r.api}/{r.kind}: {r.status}" for r in errors)),
      examples=[{"api": r.api, "kind": r.kind, "t_s": r.t_s, "status": r.status,
                 "error": r.error} for r in errors[:10]])
  live = [s for s in samples if s.get("phase") != "stopping"]
  bad_polls = collections.Counter()
  for s in live:
    for key, want in (("http_health", 200), ("http_ready", 200), ("grpc_live", "SERVING"),
                      ("grpc_ready", "SERVING")):
      if s.get(key) != want:
        bad_polls[f"{key}={s.get(key)}"] += 1
    if not s.get("alive"):
      bad_polls["dead"] += 1
  last = end_row or (live[-1] if live else {})
  failures = last.get("loop_failures")
  a["health_serving"] = _assert(
      not bad_polls and not why and (failures or 0) == 0, polls=len(live),
      bad_polls=dict(bad_polls), stopped_early=why or None, loop_failures=failures,
      loop_restarts=last.get("loop_restarts"))
  grow = lambda k: (None if last.get(k) is None or ready_row.get(k) is None
                    else last[k] - ready_row[k])
  faults, internal = grow("engine_faults"), grow("internal_errors")
  a["no_engine_faults"] = _assert((faults or 0) == 0 and (internal or 0) == 0,
                                  engine_faults_added=faults, internal_errors_added=internal)
  refused_idle = [r for r in probes if r.category == "refused"]
  a["no_refusal_while_idle"] = _assert(
      not refused_idle and bool(probes), probes=len(probes), refused=len(refused_idle),
      refused_at_t_s=[r.t_s for r in refused_idle][:20])
  frac = len(refused_outside) / len(outside) if outside else 0.0
  a["few_refusals_outside_bursts"] = _assert(
      frac <= cfg["max_refused_frac"], sent=len(outside), refused=len(refused_outside),
      fraction=round(frac, 4), bound=cfg["max_refused_frac"])
  p0, p1 = ready_row.get("compiled_programs"), last.get("compiled_programs")
  after = last.get("programs_after_ready")  # the server's own count since its readiness
  a["programs_constant"] = (_assert(True, skipped="the server exports no program count")
                            if p0 is None or p1 is None else
                            _assert(p0 == p1 and not after, at_ready=p0, at_end=p1,
                                    added=p1 - p0, server_after_ready=after))
  # second half of the samples, readiness to the last one before the server was stopped
  series = [s for s in live if s.get("alive") and s.get("t_s") is not None]
  t_end = series[-1]["t_s"] if series else 0.0
  half = [s for s in series if s["t_s"] >= t_end / 2]
  ts = [s["t_s"] for s in half]
  slopes = {}
  for s in half:  # a thread brings its stack, guard page and malloc arena: 3 mappings
    m, t = s.get("maps"), s.get("threads")
    s["maps_net"] = None if m is None else m - MAPS_PER_THREAD * (t or 0)
  for key, bound, unit in (("rss_bytes", None, "bytes"), ("fds", cfg["max_fds_per_min"], "fds"),
                           ("maps_net", cfg["max_maps_per_min"], "maps"),
                           ("threads", cfg.get("max_threads_per_min", 1.0), "threads")):
    ys = [s.get(key) for s in half]
    sl = slope_per_min(ts, ys)
    vals = [y for y in ys if y is not None]
    mean = sum(vals) / len(vals) if vals else None
    entry = {"slope_per_min": sl, "mean": mean, "first": vals[0] if vals else None,
             "last": vals[-1] if vals else None, "samples": len(vals),
             "window_s": [ts[0], ts[-1]] if ts else None}
    if key == "rss_bytes":
      pct = (sl * 10 / mean * 100) if sl is not None and mean else None
      entry.update(pct_of_mean_per_10min=pct, bound_pct_per_10min=cfg["max_rss_pct_per_10min"])
      a["rss_flat"] = _assert(pct is not None and pct < cfg["max_rss_pct_per_10min"], **entry)
    else:
      entry["bound_per_min"] = bound
      a[f"{unit}_flat"] = _assert(sl is not None and sl < bound, **entry)
    slopes[key] = entry
  raw = [s.get("maps") for s in half if s.get("maps") is not None]
  slopes["maps"] = {"slope_per_min": slope_per_min(ts, [s.get("maps") for s in half]),
                    "first": raw[0] if raw else None, "last": raw[-1] if raw else None}
  bad_gaps = [g for g in gaps if g.get("kv_pages_used") != 0 or g.get("running") != 0
              or g.get("queue") != 0]
  a["kv_pages_released"] = _assert(bool(gaps) and not bad_gaps, gaps=len(gaps),
                                   not_released=bad_gaps)
  a["drains_completed"] = _assert(bool(drains) and all(d["completed"] for d in drains),
                                  drains=drains)
  longs = [r for r in recs if r.role == "long"]
  long_ok = [r for r in longs if r.category == "ok"]
  long_tokens = max((r.output_tokens for r in longs), default=0)
  a["long_generation_complete"] = _assert(
      bool(long_ok) and long_ok[-1].output_tokens >= cfg["long_tokens"], tokens=long_tokens,
      target=cfg["long_tokens"], attempts=[{"status": r.status, "tokens": r.output_tokens,
                                            "e2e_s": r.e2e_s, "error": r.error} for r in longs])
  steps = min(lane_tokens) if lane_tokens else 0
  a["steady_steps_reached"] = _assert(
      steps >= cfg["steady_steps"], steps=steps, target=cfg["steady_steps"],
      tokens_per_lane=lane_tokens, generations_per_lane=lane_generations)
  ran = collections.defaultdict(int)
  for r in recs:
    if r.category in ("ok", "cancelled"):
      ran[(r.api, r.kind)] += 1
  wanted = list(kinds) + [("openai_completions", "long_sinks"), ("openai_chat", "probe"),
                          ("phaseserve_grpc", "probe")]
  if cfg["steady_rows"]:
    wanted.append(("phaseserve_grpc", "steady_ignore_eos"))
  missing = [f"{api}/{kind}" for api, kind in wanted if not ran[(api, kind)]]
  a["every_kind_ran"] = _assert(not missing, kinds=len(wanted), missing=missing)
  a["server_exit_clean"] = _assert(exit_code == 0, exit_code=exit_code)

  ttft = [r.ttft_s for r in ordinary if r.ttft_s is not None]
  tpot = [r.tpot_s for r in ordinary if r.tpot_s is not None]
  prefix = [r for r in recs if "prefix" in r.kind and r.category == "ok"]
  failed = [k for k, v in a.items() if not v["pass"]]
  return {
      "ok": not failed, "failed": failed, "assertions": a,
      "requests": {
          "total": len(recs),
          "by_category": dict(collections.Counter(r.category for r in recs)),
          "by_role": dict(collections.Counter(r.role for r in recs)),
          "by_api_kind_status": {api: {k: dict(c) for k, c in kk.items()}
                                 for api, kk in by_kind.items()}},
      "errors": {"count": len(errors), "by_status": dict(collections.Counter(
          r.status for r in errors))},
      "refusals": {"total": len(refused),
                   "in_bursts": sum(r.in_burst for r in refused),
                   "outside_bursts": len(refused_outside), "while_idle": len(refused_idle),
                   "by_status": dict(collections.Counter(r.status for r in refused))},
      "bursts": {"count": bursts, "requests_in_bursts": sum(r.in_burst for r in ordinary)},
      "programs": {"at_ready": p0, "at_end": p1},
      "slopes": slopes, "idle_gaps": gaps, "drains": drains,
      "latency_ordinary_streaming": {"ttft_s": _pct(ttft), "tpot_s": _pct(tpot)},
      "prefix_cache": {"prefix_requests_ok": len(prefix),
                       "with_cached_tokens": sum(1 for r in prefix if (r.cached_tokens or 0) > 0)},
      "long_generation": a["long_generation_complete"],
      "steady_batch": a["steady_steps_reached"],
      "server_log_errors": log,
  }

