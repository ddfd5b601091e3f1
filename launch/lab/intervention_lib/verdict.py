"""The verdict's files: ``verdict.json``, ``verdict.txt`` (the tables) and ``verdict.png``.

Contract: ``table(result)`` renders, per candidate, one block per workload segment (its
verdict, the rate compared, capacity at SLO and failed requests of A and B, then each metric:
A, B, the relative change with its 95% interval and the call, with the reason when a quantile
had too few requests; the server's phase breakdown, p50 ms) and one row per quality gate
(held / degraded, token match, KL, task score delta with its interval, the checks that
failed), then the command that reproduces it. ``write(out_dir, result)`` writes the three files
(the PNG: per segment the relative change of each latency and throughput metric with its
interval; per gate the token match and the score delta).
"""

from __future__ import annotations

import json
import math
import os

PHASES = ("queue", "prefill", "first_token", "decode")


def _ms(x) -> str:
  return "-" if x is None else f"{x * 1e3:.0f}"


def _num(x, fmt: str) -> str:
  return "-" if x is None else format(x, fmt)


def _value(metric: str, x) -> str:
  if x is None:
    return "-"
  return f"{x * 1e3:.1f}" if metric.startswith(("ttft", "tpot")) else f"{x:.4g}"


def _capacity(side: dict) -> str:
  cap = side["capacity_per_s"]
  if cap is None:
    return "none of the ladder"
  return (">= " if side.get("capacity_at_least") else "") + f"{cap:g}"


def _segment(name: str, s: dict) -> list[str]:
  sa, sb = s["a"], s["b"]
  out = [f"{name}: {s['verdict'].upper()} (rate {s['rate_per_s']:g}/s, {s['paired_requests']} "
         f"requests ok in both; capacity at SLO A {_capacity(sa)} / B {_capacity(sb)} per s; "
         f"failed A {sa['failed']} / B {sb['failed']})",
         f"  {'metric':<22} {'A':>9} {'B':>9}  {'change [95% CI]':<26} call"]
  for c in s["changes"]:
    unit = " ms" if c["metric"].startswith(("ttft", "tpot")) else ""
    ci = (f"{c['rel'] * 100:+.1f}% [{c['lo'] * 100:+.1f}, {c['hi'] * 100:+.1f}]"
          if math.isfinite(c["rel"]) else "-")
    call = c["call"] + (f" ({c['note']})" if c["note"] else "")
    out.append(f"  {c['metric'] + unit:<22} {_value(c['metric'], c['a']):>9} "
               f"{_value(c['metric'], c['b']):>9}  {ci:<26} {call}")
  pa, pb = sa["phases_s"], sb["phases_s"]
  out.append("  server phases, p50 ms A/B: " + ", ".join(
      f"{k.replace('_', ' ')} {_ms(pa[k])}/{_ms(pb[k])}" for k in PHASES))
  return out


def table(result: dict) -> str:
  lines = [f"{result['model']} on {result['machine']['cpu']} ({result['started']}, "
           f"{result['seconds']} s); SLOs x{result['slo_scale']:g}; a change is called when its "
           f"95% interval excludes 0, it is >= {result['min_effect'] * 100:g}% and the quantile "
           "has the requests it needs"]
  for comp in result["comparisons"]:
    a, b = comp["baseline"], comp["candidate"]
    flags_a = " ".join(result["configs"][a]) or "(defaults)"
    flags_b = " ".join(result["configs"][b]) or "(defaults)"
    lines += ["", f"== {b} [{flags_b}] against {a} [{flags_a}]"]
    for name, s in comp["segments"].items():
      lines += [""] + _segment(name, s)
    lines += ["", f"{'gate':<13} {'quality':<9} {'token match':>11} {'KL':>8} "
              f"{'score A -> B (delta [95% CI])':>36}  failed checks"]
    for name, g in comp["gates"].items():
      sc = g.get("score")
      score = (f"{sc['a']:.2f} -> {sc['b']:.2f} ({sc['delta']:+.2f} [{sc['lo']:+.2f}, "
               f"{sc['hi']:+.2f}])" if sc else "-")
      failed = ", ".join(f"{c['check']} {c['value']:.4g} (bound {c['bound']:g})"
                         for c in g["checks"] if not c["ok"]) or "-"
      lines.append(f"{name:<13} {'held' if g['held'] else 'DEGRADED':<9} "
                   f"{_num(g.get('token_match'), '.3f'):>11} {_num(g.get('kl'), '.4f'):>8} "
                   f"{score:>36}  {failed}")
  lines += ["", f"reproduce: {result['command']}"]
  return "\n".join(lines) + "\n"


def _plot(path: str, result: dict) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  comps = result["comparisons"]
  fig, axes = plt.subplots(len(comps), 2, figsize=(14, 4 * len(comps)), squeeze=False)
  metrics = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "tokens_per_s_per_core")
  for row, comp in zip(axes, comps):
    ax = row[0]
    segs = list(comp["segments"])
    width = 0.8 / len(metrics)
    for k, m in enumerate(metrics):
      xs: list[float] = []
      ys: list[float] = []
      errs: list[list[float]] = [[], []]
      for i, name in enumerate(segs):
        c = next((c for c in comp["segments"][name]["changes"] if c["metric"] == m), None)
        if c is None:
          continue
        xs.append(i + k * width)
        ys.append(c["rel"] * 100)
        errs[0].append(max(0.0, (c["rel"] - c["lo"]) * 100))
        errs[1].append(max(0.0, (c["hi"] - c["rel"]) * 100))
      ax.bar(xs, ys, width, yerr=errs, capsize=2, label=m)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(segs))], segs)
    ax.set(ylabel="B vs A (%)", title=f"{comp['candidate']} vs {comp['baseline']}: load")
    ax.legend(fontsize=7)
    ax = row[1]
    gates = list(comp["gates"])
    ax.bar([i - 0.2 for i in range(len(gates))],
           [comp["gates"][g].get("token_match") or 0 for g in gates], 0.4, label="token match")
    deltas = [(comp["gates"][g].get("score") or {}).get("delta", 0.0) for g in gates]
    ax.bar([i + 0.2 for i in range(len(gates))], deltas, 0.4, label="score delta")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(gates)), gates)
    ax.set(title=f"{comp['candidate']} vs {comp['baseline']}: quality gates")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path + ".tmp.png", dpi=80)
  plt.close(fig)
  os.replace(path + ".tmp.png", path)


def write(out_dir: str, result: dict) -> None:
  with open(os.path.join(out_dir, "verdict.json.tmp"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2, sort_keys=True)
  os.replace(os.path.join(out_dir, "verdict.json.tmp"), os.path.join(out_dir, "verdict.json"))
  with open(os.path.join(out_dir, "verdict.txt"), "w", encoding="utf-8") as f:
    f.write(table(result))
  _plot(os.path.join(out_dir, "verdict.png"), result)
