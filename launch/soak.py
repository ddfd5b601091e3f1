"""Soak: one phaseserve server under long, mixed traffic, and whether it stayed healthy.

  python -m launch.soak --model smollm2-135m --out results/soak -- --quantize int8
  python -m launch.soak --model tiny --duration_s 100 --idle_s 8 --idle_every_s 50 \
      --long_tokens 3000 --steady_steps 2000 --out /tmp/soak -- --max_context 128

Starts ``python -m launch.server --model MODEL [--attention_sinks] ARGS --port 0 --port_file F
--http_port 0 --metrics_port 0`` (ARGS: whatever follows ``--``; see ``launch.soak_lib``),
waits for readiness, drives it for ``--duration_s`` of traffic (plus the drains below), stops it
with SIGTERM, prints one JSON report and exits 1 if an assertion failed (2: bad flags or a
server that never became ready). ``--out DIR`` receives ``report.json``, ``samples.csv`` (one
row per sample), ``requests.csv`` (one row per request) and ``server.log`` (without ``--out``,
a fresh temporary directory, named in the report).

Timeline: ``round(duration_s / idle_every_s)`` (at least 1) cycles of [active stretch, drain,
quiet probe, idle gap of ``--idle_s``, post-idle probe]. In an active stretch, all at once:

* Poisson arrivals at ``--qps`` (default: ``QPS_DEFAULTS`` for the model, else 1) cycling
  through every request variant (``VARIANTS``): OpenAI ``/v1/completions`` and
  ``/v1/chat/completions`` (streaming and not; n=3 at temperature 1 with a seed; logprobs 0 and
  5 / ``logprobs: true, top_logprobs: 3``; stop strings; greedy and top_k/top_p; a long prefix
  shared by every such request, for prefix-cache hits; a client that closes the stream after 3
  chunks; a slow reader sleeping ``--slow_read_s`` between reads), phaseserve gRPC ``Generate``
  (the same kinds) and JetStream ``Decode``. The plain greedy requests go through the load
  generator's drivers (``launch.loadgen_lib.drivers``), the others through the same drivers'
  HTTP session and gRPC stub.
* One long generation, started with the first stretch: a streaming completion of
  ``--long_tokens`` with ``ignore_eos`` and ``"attention_sinks": {"window": --sink_window}`` (the
  server gets ``--attention_sinks``; its KV is a ring, so the length is not bounded by the
  context). The first drain waits for it, so it ends alone.
* A steady batch: ``--steady_rows`` lanes, each a greedy ``ignore_eos`` gRPC generation of
  ``max_context - 8`` tokens, restarted as it finishes; its decode steps are the fewest tokens
  any lane generated over the run (each token is one step of a batch holding every lane).
* Bursts: every ``--burst_every_s`` of active time (the first at half that), ``--burst_factor``
  times the qps for ``--burst_s``. Refusals (HTTP 429 / RESOURCE_EXHAUSTED before any token)
  of requests sent in a burst or the ``--burst_grace_s`` after it are expected.

A drain stops every sender and waits (up to ``--drain_timeout_s``) until nothing is in flight;
the quiet probe is then one HTTP chat and one gRPC request, alone; then nothing is sent for
``--idle_s``; at the gap's end the KV gauges are read and the post-idle probe (the same two
requests) goes first. Every ``--sample_s`` from outside: the server's RSS, open fds and
mappings (``/proc/PID``), the Prometheus series of ``launch.soak_lib.SERIES`` and the health of
``GET /health``, ``GET /ready`` and gRPC health (liveness and readiness).

Assertions (``report["assertions"][name]["pass"]``, with the numbers behind each):

* ``no_request_errors``: no request ended in anything but ok, a refusal, or its own client's
  cancellation (no 5xx, INTERNAL, UNAVAILABLE, stream error, truncated stream, a 4xx other than
  429, RESOURCE_EXHAUSTED after tokens (a slow consumer), or a malformed answer: n choices each
  with a stop/length finish, logprobs where asked).
* ``health_serving``: the server lived to the end, every poll of ``/health`` and ``/ready`` was
  200 and both gRPC health services SERVING, and ``phaseserve_loop_failures_total`` stayed 0.
* ``no_engine_faults``: ``phaseserve_engine_faults`` and ``phaseserve_internal_errors_total``
  did not grow after readiness.
* ``no_refusal_while_idle``: no probe (sent alone into an idle server) was refused.
* ``few_refusals_outside_bursts``: outside bursts at most ``--max_refused_frac`` (default 5%)
  of the requests were refused: at a qps below capacity the early-rejection predictor should
  refuse almost nothing; a predictor that locks up refuses nearly everything.
* ``programs_constant``: the server's program count (``phaseserve_programs_loaded``, or
  ``phaseserve_compiled_programs``) at the end equals its value at readiness, and
  ``phaseserve_programs_after_ready`` (where exported) is 0 (skipped without a count).
* ``rss_flat``, ``fds_flat``, ``maps_flat``: the least-squares slope over the second half of the
  samples (readiness to the last sample) is below ``--max_rss_pct_per_10min`` (default 1% of the
  mean RSS per 10 minutes: a leak that would add 144% a day; allocator noise averages out over
  a 15-minute half of the default run), ``--max_fds_per_min`` (1) and ``--max_maps_per_min``
  (1): a handle leaked per request, or an XLA program compiled after readiness (each adds
  mappings), grows faster than that at any qps worth soaking; connections open during a burst
  close within the client's 15 s keep-alive. Short runs need looser bounds (the test's flags).
* ``kv_pages_released``: at the end of every idle gap no KV page is used by a sequence, none
  runs and none waits. ``phaseserve_kv_pages_used`` counts pages a sequence holds; pages only
  the prefix cache holds are ``phaseserve_kv_pages_cached`` (reported, not asserted).
* ``drains_completed``: every drain emptied within ``--drain_timeout_s``.
* ``long_generation_complete``: the long stream ended ok with >= ``--long_tokens`` tokens.
* ``steady_steps_reached``: the steady batch ran >= ``--steady_steps`` decode steps.
* ``every_kind_ran``: each variant, the long generation, the steady lanes and the probes ran
  (at least one ok or client-cancelled request each).
* ``server_exit_clean``: SIGTERM at the end stopped the server with exit code 0.

The report: duration, requests by API / kind / status, errors (by status, the first examples),
refusals (in bursts / outside / while idle), programs at ready / end, the RSS / fd / mapping
slopes (and the thread count's, not asserted: each thread stack is two mappings), KV gauges
per idle gap, TTFT / TPOT p50 / p99 of the ordinary streaming requests (client clock; TPOT for
n = 1), the long generation, the steady batch, prefix-cache hits, and the server log's ERROR
lines.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from typing import Awaitable, Callable

from absl import flags

from launch import cli
from launch.cli import CliError

# Near capacity beside the steady batch and the long stream, on the 2-core development CPU
# (smollm2-135m int8: 0.6 ordinary requests/s served at --qps 2, half refused; tiny: none refused
# at 4, bursts of 12 included). Elsewhere measure it: launch.loadgen --find_capacity.
QPS_DEFAULTS = {"tiny": 4.0, "smollm2-135m": 0.5}

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "launch.server's --model")
_DURATION = flags.DEFINE_float("duration_s", 1800.0, "active traffic + idle gaps (drains extend "
                               "it)", lower_bound=1.0)
_QPS = flags.DEFINE_float("qps", None, "ordinary Poisson arrivals per second (default: near "
                          "capacity for the model, QPS_DEFAULTS, else 1)", lower_bound=1e-3)
_IDLE = flags.DEFINE_float("idle_s", 30.0, "length of each idle gap", lower_bound=0.0)
_IDLE_EVERY = flags.DEFINE_float("idle_every_s", 300.0, "one idle gap per this much of "
                                 "--duration_s", lower_bound=1.0)
_LONG_TOKENS = flags.DEFINE_integer("long_tokens", 10000, "the long generation's tokens",
                                    lower_bound=1)
_SINK_WINDOW = flags.DEFINE_integer("sink_window", 64, "the long generation's attention-sink "
                                    "window (0: no sinks; then it must fit the context)",
                                    lower_bound=0)
_STEADY_STEPS = flags.DEFINE_integer("steady_steps", 10000, "decode steps of the steady batch",
                                     lower_bound=0)
_STEADY_ROWS = flags.DEFINE_integer("steady_rows", 8, "generations in the steady batch",
                                    lower_bound=0)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "max_tokens of an ordinary request",
                                   lower_bound=4)
_PREFIX_TOKENS = flags.DEFINE_integer("prefix_tokens", 512, "the shared prefix (at most half of "
                                      "what the context leaves)", lower_bound=1)
_BURST_EVERY = flags.DEFINE_float("burst_every_s", 240.0, "a burst per this much active time",
                                  lower_bound=1.0)
_BURST_S = flags.DEFINE_float("burst_s", 10.0, "length of a burst", lower_bound=0.0)
_BURST_FACTOR = flags.DEFINE_float("burst_factor", 3.0, "qps multiplier in a burst",
                                   lower_bound=1.0)
_BURST_GRACE = flags.DEFINE_float("burst_grace_s", 20.0, "refusals this long after a burst "
                                  "still count as the burst's", lower_bound=0.0)
_SLOW_READ = flags.DEFINE_float("slow_read_s", 0.1, "the slow reader's sleep between reads",
                                lower_bound=0.0)
_SAMPLE = flags.DEFINE_float("sample_s", 2.0, "sampling period", lower_bound=0.1)
_SEED = flags.DEFINE_integer("seed", 0, "arrivals, prompts and sampling seeds")
_OUT = flags.DEFINE_string("out", None, "report.json, samples.csv, requests.csv, server.log "
                           "(default: a new temporary directory)")
_READY = flags.DEFINE_float("ready_timeout_s", 1800.0, "start-up bound", lower_bound=1.0)
_REQ_TIMEOUT = flags.DEFINE_float("request_timeout_s", 600.0, "deadline of one ordinary request",
                                  lower_bound=1.0)
_DRAIN_TIMEOUT = flags.DEFINE_float("drain_timeout_s", 1800.0, "a drain's bound",
                                    lower_bound=1.0)
_GRACE = flags.DEFINE_float("stop_grace_s", 30.0, "SIGTERM at the end: how long to wait "
                            "before SIGKILL", lower_bound=0.0)
_RSS_PCT = flags.DEFINE_float("max_rss_pct_per_10min", 1.0, "rss_flat's bound", lower_bound=0.0)
_FDS = flags.DEFINE_float("max_fds_per_min", 1.0, "fds_flat's bound", lower_bound=0.0)
_MAPS = flags.DEFINE_float("max_maps_per_min", 1.0, "maps_flat's bound", lower_bound=0.0)
_REFUSED_FRAC = flags.DEFINE_float("max_refused_frac", 0.05, "few_refusals_outside_bursts' "
                                   "bound", lower_bound=0.0)

STOPS = ["\n", "e"]  # "e": frequent in any model's text, so stop strings do end requests
OK_FINISH = frozenset({"stop", "length"})


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


def plan(duration_s: float, idle_s: float, idle_every_s: float) -> tuple[int, float]:
  """(idle gaps, active seconds per stretch)."""
  gaps = max(1, round(duration_s / idle_every_s))
  active = (duration_s - gaps * idle_s) / gaps
  if active < 1.0:
    raise CliError(f"--duration_s {duration_s:g} leaves no traffic around {gaps} idle gap(s) of "
                   f"--idle_s {idle_s:g}")
  return gaps, active


def bursts_in(a0: float, a1: float, every: float, length: float) -> list[tuple[float, float]]:
  """Bursts (offsets from the stretch's start) of a stretch spanning active time [a0, a1): one
  at every ``every * (k + 1/2)``, clipped to the stretch."""
  out = []
  if length <= 0:
    return out
  k = 0
  while True:
    b = every * (k + 0.5)
    if b >= a1:
      return out
    if b >= a0:
      out.append((b - a0, min(b + length, a1) - a0))
    k += 1


# -- the traffic --------------------------------------------------------------------------------


@dataclasses.dataclass
class Res:
  status: str
  error: str = ""
  sent: float = 0.0
  first: float | None = None
  end: float = 0.0
  tokens: int = 0
  cached: int | None = None
  finish: str = ""


class Traffic:
  """Every sender of one soak; ``records`` collects one ``Rec`` per request."""

  def __init__(self, server, model_name: str, vocab: int, max_context: int, t_ready: float,
               rng, cfg: dict):
    from launch.loadgen_lib import drivers
    self.server, self.model, self.vocab, self.max_context = server, model_name, vocab, max_context
    self.t_ready, self.rng, self.cfg = t_ready, rng, cfg
    timeout = cfg["request_timeout_s"]
    dc = lambda api, target, ignore_eos: drivers.DriverConfig(
        api, target, model_name, "", timeout, ignore_eos)
    self.oai = drivers.make_driver(dc("openai", server.http, False))
    self.ps = drivers.make_driver(dc("phaseserve", server.target, False))
    self.ps_eos = drivers.make_driver(dc("phaseserve", server.target, True))  # steady lanes
    self.js = drivers.make_driver(dc("jetstream", server.target, False))
    from serving.proto.phaseserve.v1 import generation_pb2 as pb
    self.pb = pb
    self.records: list[Rec] = []
    self.inflight = 0
    self.changed = asyncio.Condition()
    self.accepting = asyncio.Event()
    self.finished = False
    self.burst_windows: list[tuple[float, float]] = []  # monotonic [start, end + grace)
    self.bursting: list[tuple[float, float]] = []       # monotonic [start, end) (sampler phase)
    self.phase = "ready"
    self.counter = itertools.count()
    self.lane_tokens = [0] * cfg["steady_rows"]
    self.lane_generations = [0] * cfg["steady_rows"]
    self.drains: list[dict] = []
    self.tasks: set[asyncio.Task] = set()  # every request task, lane and the long generation
    self.variants = self._variants()
    self._setup_prompts()

  # ---- prompts

  def _tokenize(self, text: str | None = None, messages=None) -> list[int]:
    import grpc
    from serving.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
    pb = self.pb
    with grpc.insecure_channel(self.server.target) as ch:
      stub = pb_grpc.GenerationStub(ch)
      if messages is not None:
        req = pb.TokenizeRequest(messages=pb.Messages(messages=[
            pb.ChatMessage(role=r, content=c) for r, c in messages]))
      else:
        req = pb.TokenizeRequest(text=text, add_bos=True)
      return list(stub.Tokenize(req, timeout=30).token_ids)

  def _setup_prompts(self) -> None:
    from launch.loadgen_lib.workload import ids_to_text
    mt = self.cfg["max_tokens"]
    room = self.max_context - mt
    if room < 24:
      raise CliError(f"the server's context ({self.max_context}) leaves too little room for "
                     f"--max_tokens {mt}")
    target = max(8, min(self.cfg["prefix_tokens"], room // 2))
    words = list(range(0, 4 * target))
    text = ids_to_text(words)
    while True:  # the longest prefix of whole words within ``target`` tokens
      ids = self._tokenize(text)
      if len(ids) <= target or len(text.split()) <= 1:
        break
      text = " ".join(text.split()[:max(1, int(len(text.split()) * target / len(ids)) - 1)])
      text = " " + text
    self.prefix_text = "Background:" + text
    self.prefix_ids = self._tokenize(self.prefix_text)
    longest_user = self._question(None)
    for _ in range(20):  # the chat form must fit too (its template adds tokens)
      chat = self._tokenize(messages=[("system", self.prefix_text), ("user", longest_user)])
      plain = self._tokenize(self.prefix_text + " " + longest_user)
      if max(len(chat), len(plain)) + mt + 4 <= self.max_context:  # 4: tokenizer merges
        break
      words = self.prefix_text.split()
      self.prefix_text = " ".join(words[:max(1, int(len(words) * 0.8))])
      self.prefix_ids = self._tokenize(self.prefix_text)
    else:
      raise CliError("cannot fit the shared prefix in the server's context")
    if len(self._tokenize(messages=[("user", longest_user)])) + mt > self.max_context:
      raise CliError(f"--max_tokens {mt} does not fit the server's context ({self.max_context})")

  @staticmethod
  def _question(i: int | None) -> str:
    """A short question, distinct per ``i``; ``None``: the longest one (for the fit checks)."""
    from launch.loadgen_lib.workload import WORDS, ids_to_text
    if i is None:
      return "Request 999999:" + (" " + max(WORDS, key=len)) * 4 + "?"
    return f"Request {i % 10**6}:" + ids_to_text([i, i * 7 + 3, i * 13 + 5, i * 31 + 1]) + "?"

  def _ids(self, n: int) -> tuple[int, ...]:
    lo = min(100, self.vocab // 4)
    return tuple(int(x) for x in self.rng.integers(lo, self.vocab, n))

  def _seed(self) -> int:
    return int(self.rng.integers(0, 2**31))

  # ---- bookkeeping

  def rel(self, t: float) -> float:
    return round(t - self.t_ready, 3)

  def in_burst(self, t: float) -> bool:
    return any(a <= t < b for a, b in self.burst_windows)

  def sampler_phase(self) -> str:
    now = time.monotonic()
    if self.phase == "active" and any(a <= now < b for a, b in self.bursting):
      return "burst"
    return self.phase

  async def tracked(self, api: str, kind: str, role: str,
                    call: Callable[[], Awaitable[Res]], *, stream: bool = True, n: int = 1,
                    lane: int | None = None) -> Rec:
    async with self.changed:
      self.inflight += 1
    t = time.monotonic()
    try:
      r = await call()
    except asyncio.CancelledError:  # the soak gave up on it (drain timeout, dead server)
      self.records.append(Rec(api, kind, role, self.rel(t), "soak_cancelled", "abandoned",
                              "cancelled by the soak", stream=stream, n=n, lane=lane,
                              e2e_s=round(time.monotonic() - t, 4)))
      raise
    except Exception as e:  # a bug in a sender is an error of the soak, recorded as such
      r = Res(f"client_{type(e).__name__}", str(e)[:300], t, end=time.monotonic())
    finally:
      async with self.changed:
        self.inflight -= 1
        self.changed.notify_all()
    sent = r.sent or t
    ttft = (r.first - sent) if r.first is not None and r.status == "ok" else None
    tpot = ((r.end - r.first) / (r.tokens - 1)
            if ttft is not None and n == 1 and r.tokens > 1 and stream else None)
    rec = Rec(api, kind, role, self.rel(sent), r.status, category(r.status, r.tokens),
              r.error[:300], not role.startswith("probe") and self.in_burst(sent), stream, n,
              r.tokens,
              r.cached, r.finish, ttft if stream else None, tpot,
              round(max(0.0, r.end - sent), 4), lane)
    self.records.append(rec)
    return rec

  async def wait_drained(self, timeout_s: float) -> bool:
    async def empty():
      async with self.changed:
        await self.changed.wait_for(lambda: self.inflight == 0)
    try:
      await asyncio.wait_for(empty(), timeout_s)
      return True
    except TimeoutError:
      return False

  # ---- HTTP

  async def http(self, path: str, body: dict, *, cancel_after: int = 0, read_delay_s: float = 0.0,
                 timeout_s: float | None = None) -> Res:
    """One OpenAI request on the load generator's HTTP session; checks the answer's shape."""
    import aiohttp
    session = self.oai.session
    chat = path.endswith("chat/completions")
    stream = bool(body.get("stream"))
    n = body.get("n") or 1
    want_lp = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
    sent = time.monotonic()
    first, tokens, chunks, finish, usage, lp_ok = None, 0, 0, {}, None, True
    timeout = aiohttp.ClientTimeout(total=timeout_s or self.cfg["request_timeout_s"])
    try:
      async with session.post(self.server.http + path, json=body, timeout=timeout) as resp:
        if resp.status != 200:
          return Res(f"http_{resp.status}", (await resp.text())[:300], sent, None,
                     time.monotonic())
        if not stream:
          obj = await resp.json()
          end = time.monotonic()
          choices = obj.get("choices") or []
          finish = {c.get("index"): c.get("finish_reason") for c in choices}
          lp_ok = not want_lp or all(c.get("logprobs") for c in choices)
          usage = obj.get("usage") or {}
          tokens = int(usage.get("completion_tokens") or 0)
        else:
          done = False
          async for raw in resp.content:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
              continue
            data = line[5:].strip()
            if data == "[DONE]":
              done = True
              break
            obj = json.loads(data)
            if obj.get("error"):
              return Res("stream_error", str(obj["error"])[:300], sent, first, time.monotonic(),
                         chunks)
            for c in obj.get("choices") or ():
              piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
              if piece or c.get("logprobs"):
                first = first or time.monotonic()
                chunks += 1
                if want_lp and not c.get("logprobs"):
                  lp_ok = False
              if c.get("finish_reason"):
                finish[c.get("index")] = c["finish_reason"]
            usage = obj.get("usage") or usage
            if cancel_after and chunks >= cancel_after:
              resp.close()  # the client goes away mid-stream
              return Res("cancelled_by_client", "", sent, first, time.monotonic(), chunks)
            if read_delay_s:
              await asyncio.sleep(read_delay_s)
          end = time.monotonic()
          if not done:
            return Res("stream_truncated", "the stream ended before [DONE]", sent, first, end,
                       chunks)
          tokens = int(usage["completion_tokens"]) if usage else chunks
    except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as e:
      return Res(type(e).__name__, str(e)[:300], sent, first, time.monotonic(), chunks)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    reasons = sorted(str(v) for v in finish.values())
    problem = ""
    if sorted(finish) != list(range(n)):
      problem = f"finish reasons for choices {sorted(finish)}, expected {n}"
    elif not set(reasons) <= OK_FINISH:
      problem = f"finish reasons {reasons}"
    elif not lp_ok:
      problem = "logprobs missing"
    if problem:
      return Res("bad_response", problem, sent, first, end, tokens, cached, ",".join(reasons))
    return Res("ok", "", sent, first, end, tokens, cached, ",".join(reasons))

  def _body(self, chat: bool, i: int, prefix: bool = False, **kw) -> dict:
    q = self._question(i)
    mt = self.cfg["max_tokens"]
    if chat:
      msgs = ([{"role": "system", "content": self.prefix_text}] if prefix else []) + \
          [{"role": "user", "content": q}]
      body = {"model": self.model, "messages": msgs, "max_tokens": mt}
    else:
      body = {"model": self.model, "prompt": (self.prefix_text + " " + q) if prefix else q,
              "max_tokens": mt}
    body.setdefault("temperature", 0)
    body.update(kw)
    if body.get("stream"):
      body["stream_options"] = {"include_usage": True}
    return body

  # ---- gRPC

  async def grpc(self, req, *, n: int = 1, want_lp: bool = False, cancel_after: int = 0,
                 read_delay_s: float = 0.0) -> Res:
    import grpc
    pb = self.pb
    sent = time.monotonic()
    first, tokens, finals, cached, lp_ok = None, 0, {}, None, True
    call = self.ps.stub.Generate(req, timeout=self.cfg["request_timeout_s"])
    try:
      async for r in call:
        if r.token_ids:
          first = first or time.monotonic()
          tokens += len(r.token_ids)
          if want_lp and len(r.logprobs) != len(r.token_ids):
            lp_ok = False
        if r.HasField("final"):
          finals[r.index] = pb.FinishReason.Name(r.final.finish_reason).lower()
          if r.index == 0:
            cached = r.final.usage.cached_tokens
        if cancel_after and tokens >= cancel_after:
          call.cancel()
          return Res("cancelled_by_client", "", sent, first, time.monotonic(), tokens)
        if read_delay_s:
          await asyncio.sleep(read_delay_s)
    except grpc.aio.AioRpcError as e:
      return Res(e.code().name, e.details() or "", sent, first, time.monotonic(), tokens)
    end = time.monotonic()
    reasons = sorted(finals.values())
    problem = ""
    if sorted(finals) != list(range(n)):
      problem = f"final messages for samples {sorted(finals)}, expected {n}"
    elif not set(reasons) <= OK_FINISH:
      problem = f"finish reasons {reasons}"
    elif not lp_ok:
      problem = "logprobs missing"
    if problem:
      return Res("bad_response", problem, sent, first, end, tokens, cached, ",".join(reasons))
    return Res("ok", "", sent, first, end, tokens, cached, ",".join(reasons))

  def _greq(self, i: int, *, prefix: bool = False, text: bool = False, **kw):
    pb = self.pb
    mt = self.cfg["max_tokens"]
    sampling = kw.pop("sampling", None)
    if prefix:
      req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=self.prefix_ids + list(self._ids(8))),
                               max_tokens=mt, **kw)
    elif text:
      req = pb.GenerateRequest(text=self._question(i), max_tokens=mt, **kw)
    else:
      req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=self._ids(16)), max_tokens=mt, **kw)
    if sampling:
      for k, v in sampling.items():
        setattr(req.sampling, k, v)
    return req

  # ---- driver calls (the load generator's own clients)

  @staticmethod
  def _from_outcome(o) -> Res:
    return Res(o.status, o.error, o.sent_s, o.first_s, o.end_s, o.output_tokens, o.cached_tokens,
               o.finish_reason)

  async def _driver(self, driver, ids, text, max_tokens) -> Res:
    return self._from_outcome(await driver.generate(ids, text, max_tokens, ""))

  # ---- the variants: (api, kind, stream, n, factory(i) -> coroutine)

  def _variants(self):
    C, H = "/v1/completions", "/v1/chat/completions"
    mt = lambda: self.cfg["max_tokens"]
    slow = lambda: self.cfg["slow_read_s"]
    s = lambda: self._seed()
    sampled = lambda: dict(temperature=0.8, top_k=20, top_p=0.9, seed=s())
    v: list[tuple[str, str, bool, int, Callable[[int], Awaitable[Res]]]] = []
    for chat, api, path in ((False, "openai_completions", C), (True, "openai_chat", H)):
      b = lambda i, chat=chat, **kw: self._body(chat, i, **kw)
      if chat:
        v.append((api, "stream_greedy", True, 1,
                  lambda i, p=path, b=b: self.http(p, b(i, stream=True))))
      else:  # the load generator's own OpenAI driver
        v.append((api, "stream_greedy", True, 1,
                  lambda i: self._driver(self.oai, (), self._question(i), mt())))
      v += [
          (api, "nostream_greedy", False, 1, lambda i, p=path, b=b: self.http(p, b(i))),
          (api, "stream_n3_seed", True, 3, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True, n=3, temperature=1.0, seed=s()))),
          (api, "nostream_n3_seed", False, 3, lambda i, p=path, b=b: self.http(
              p, b(i, n=3, temperature=1.0, seed=s()))),
          (api, "stop_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True, stop=STOPS))),
          (api, "topk_topp_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True, **sampled()))),
          (api, "prefix_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, prefix=True, stream=True))),
          (api, "prefix_nostream", False, 1, lambda i, p=path, b=b: self.http(
              p, b(i, prefix=True))),
          (api, "cancel_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True), cancel_after=3)),
          (api, "slow_reader_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True), read_delay_s=slow())),
      ]
      if chat:
        v += [
            (api, "logprobs_top3", False, 1, lambda i, p=path, b=b: self.http(
                p, b(i, logprobs=True, top_logprobs=3))),
            (api, "logprobs_top3_stream", True, 1, lambda i, p=path, b=b: self.http(
                p, b(i, stream=True, logprobs=True, top_logprobs=3))),
        ]
      else:
        v += [
            (api, "logprobs0", False, 1, lambda i, p=path, b=b: self.http(p, b(i, logprobs=0))),
            (api, "logprobs5_stream", True, 1, lambda i, p=path, b=b: self.http(
                p, b(i, stream=True, logprobs=5))),
        ]
    api = "phaseserve_grpc"
    v += [
        (api, "generate_greedy", True, 1,  # the load generator's own gRPC driver
         lambda i: self._driver(self.ps, self._ids(16), "", mt())),
        (api, "text_n3_seed_logprobs", True, 3, lambda i: self.grpc(
            self._greq(i, text=True, n=3, logprobs=2, sampling=dict(temperature=1.0, seed=s())),
            n=3, want_lp=True)),
        (api, "stop_topk_topp", True, 1, lambda i: self.grpc(
            self._greq(i, text=True, stop=STOPS, sampling=dict(temperature=0.8, top_k=20,
                                                               top_p=0.9, seed=s())))),
        (api, "prefix", True, 1, lambda i: self.grpc(self._greq(i, prefix=True))),
        (api, "cancel", True, 1, lambda i: self.grpc(self._greq(i), cancel_after=3)),
        (api, "slow_reader", True, 1, lambda i: self.grpc(self._greq(i), read_delay_s=slow())),
        ("jetstream", "decode", True, 1,  # the load generator's own JetStream driver
         lambda i: self._driver(self.js, self._ids(16), "", mt())),
    ]
    return v

  def launch(self, role: str) -> None:
    i = next(self.counter)
    api, kind, stream, n, make = self.variants[i % len(self.variants)]
    self.spawn(self.tracked(api, kind, role, lambda: make(i), stream=stream, n=n))

  def spawn(self, coro) -> asyncio.Task:
    task = asyncio.create_task(coro)
    self.tasks.add(task)
    task.add_done_callback(self.tasks.discard)
    return task

  async def cancel_all(self) -> None:
    tasks = [t for t in self.tasks if not t.done()]
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

  # ---- probes, the long generation, the steady lanes

  async def probe(self, role: str) -> None:
    i = next(self.counter)
    await self.tracked("openai_chat", "probe", role, lambda: self.http(
        "/v1/chat/completions", self._body(True, i, max_tokens=8)), stream=False)
    await self.tracked("phaseserve_grpc", "probe", role,
                       lambda: self._driver(self.ps, self._ids(16), "", 8))

  async def long_generation(self) -> None:
    w = self.cfg["sink_window"]
    body = {"model": self.model, "prompt": "Once upon a time", "max_tokens":
            self.cfg["long_tokens"], "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if w:
      body["attention_sinks"] = {"window": w}
    timeout = self.cfg["duration_s"] + self.cfg["drain_timeout_s"] + self.cfg["request_timeout_s"]
    for _ in range(20):  # a refusal at the start is retried (and counted)
      rec = await self.tracked("openai_completions", "long_sinks", "long",
                               lambda: self.http("/v1/completions", body, timeout_s=timeout))
      if rec.category != "refused":
        return
      await asyncio.sleep(1.0)

  async def steady_lane(self, lane: int) -> None:
    prompt_len = 8
    max_tokens = min(1024, self.max_context - prompt_len)
    while True:
      await self.accepting.wait()
      if self.finished:
        return
      rec = await self.tracked(
          "phaseserve_grpc", "steady_ignore_eos", "steady",
          lambda: self._driver(self.ps_eos, self._ids(prompt_len), "", max_tokens), lane=lane)
      self.lane_generations[lane] += 1
      if rec.category == "ok":
        self.lane_tokens[lane] += rec.output_tokens
      elif rec.category == "refused":
        await asyncio.sleep(0.5)
      else:
        await asyncio.sleep(1.0)

  async def close(self) -> None:
    for d in (self.oai, self.ps, self.ps_eos, self.js):
      try:
        await d.close()
      except Exception:  # closing after a dead server
        pass


# -- the run ------------------------------------------------------------------------------------


async def _sleep_until(t: float) -> None:
  await asyncio.sleep(max(0.0, t - time.monotonic()))


async def drive(tr: Traffic, sampler, cfg: dict, gaps: list[dict]) -> None:
  from launch.loadgen_lib.arrivals import Arrivals, arrival_times_s
  n_gaps, active_s = plan(cfg["duration_s"], cfg["idle_s"], cfg["idle_every_s"])
  qps = cfg["qps"]
  lanes = [tr.spawn(tr.steady_lane(k)) for k in range(cfg["steady_rows"])]
  long_task = None
  try:
    for cycle in range(n_gaps):
      if cycle:
        tr.phase = "probe"
        await tr.probe("probe_idle")
      start = time.monotonic()
      tr.phase = "active"
      tr.accepting.set()
      if long_task is None:
        long_task = tr.spawn(tr.long_generation())
      sends = [(float(t), "ordinary") for t in
               arrival_times_s(Arrivals("poisson", qps), 0, active_s, tr.rng)]
      for b0, b1 in bursts_in(cycle * active_s, (cycle + 1) * active_s, cfg["burst_every_s"],
                              cfg["burst_s"]):
        tr.bursting.append((start + b0, start + b1))
        tr.burst_windows.append((start + b0, start + b1 + cfg["burst_grace_s"]))
        extra = qps * (cfg["burst_factor"] - 1.0)
        if extra > 0 and b1 > b0:
          sends += [(b0 + float(t), "ordinary") for t in
                    arrival_times_s(Arrivals("poisson", extra), 0, b1 - b0, tr.rng)]
      for t, role in sorted(sends):
        await _sleep_until(start + t)
        tr.launch(role)
      await _sleep_until(start + active_s)
      tr.accepting.clear()
      tr.phase = "drain"
      t_drain = time.monotonic()
      drained = await tr.wait_drained(cfg["drain_timeout_s"])
      tr.drains.append({"cycle": cycle, "drain_s": round(time.monotonic() - t_drain, 2),
                        "completed": drained})
      if not drained:
        await tr.cancel_all()
        return
      tr.phase = "probe"
      await tr.probe("probe_quiet")
      tr.phase = "idle"
      t_gap = time.monotonic()
      await asyncio.sleep(cfg["idle_s"])
      row = await asyncio.to_thread(sampler.sample, "idle_end")
      gaps.append({"cycle": cycle, "t_s": tr.rel(t_gap), "idle_s": cfg["idle_s"],
                   **{k: row.get(k) for k in ("kv_pages_used", "kv_pages_cached", "running",
                                              "queue", "live_streams", "rss_bytes", "fds",
                                              "maps", "compiled_programs",
                                              "programs_after_ready")}})
    tr.phase = "probe"
    await tr.probe("probe_idle")
    tr.phase = "end"
  finally:
    tr.finished = True
    tr.accepting.set()
    await tr.cancel_all()


async def run_traffic(server, sampler, cfg: dict, info: tuple[str, int, int], t_ready: float,
                      gaps: list[dict]) -> tuple[Traffic | None, str]:
  """Runs the timeline; returns the traffic and why it stopped early ("" if it did not)."""
  import numpy as np
  model_name, vocab, max_context = info
  tr = Traffic(server, model_name, vocab, max_context, t_ready,
               np.random.default_rng(cfg["seed"]), cfg)
  sampler.phase_fn = tr.sampler_phase
  main = asyncio.create_task(drive(tr, sampler, cfg, gaps))
  why = ""
  try:
    while not main.done():
      await asyncio.wait({main}, timeout=0.5)
      if server.proc.poll() is not None and not main.done():
        why = f"the server exited with code {server.proc.returncode} during the soak"
        main.cancel()
        await asyncio.gather(main, return_exceptions=True)
    if main.done() and not main.cancelled() and main.exception() is not None:
      raise main.exception()
  finally:
    if not main.done():
      main.cancel()
      await asyncio.gather(main, return_exceptions=True)
    await tr.cancel_all()  # a cancelled run: every request ends before the clients close
    await tr.close()
  return tr, why


# -- the report ---------------------------------------------------------------------------------


def _pct(xs: list[float]) -> dict:
  from launch.soak_lib import percentile
  return {"count": len(xs), "p50": percentile(xs, 0.5), "p99": percentile(xs, 0.99)}


def _assert(ok: bool, **numbers) -> dict:
  return {"pass": bool(ok), **numbers}


def analyze(cfg: dict, recs: list[Rec], samples: list[dict], gaps: list[dict], drains: list[dict],
            lane_tokens: list[int], lane_generations: list[int], ready_row: dict,
            end_row: dict | None, why: str, exit_code: int | None, kinds: list[tuple[str, str]],
            log: dict, bursts: int = 0) -> dict:
  from launch.soak_lib import slope_per_min
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
  for key, bound, unit in (("rss_bytes", None, "bytes"), ("fds", cfg["max_fds_per_min"], "fds"),
                           ("maps", cfg["max_maps_per_min"], "maps")):
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
  th = [s.get("threads") for s in half]
  slopes["threads"] = {"slope_per_min": slope_per_min(ts, th),  # reported: explains maps
                       "first": next((y for y in th if y is not None), None),
                       "last": next((y for y in reversed(th) if y is not None), None),
                       "max": max((y for y in th if y is not None), default=None)}
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


def _config() -> dict:
  qps = _QPS.value if _QPS.value is not None else QPS_DEFAULTS.get(_MODEL.value, 1.0)
  return {"model": _MODEL.value, "duration_s": _DURATION.value, "qps": qps,
          "idle_s": _IDLE.value, "idle_every_s": _IDLE_EVERY.value,
          "long_tokens": _LONG_TOKENS.value, "sink_window": _SINK_WINDOW.value,
          "steady_steps": _STEADY_STEPS.value, "steady_rows": _STEADY_ROWS.value,
          "max_tokens": _MAX_TOKENS.value, "prefix_tokens": _PREFIX_TOKENS.value,
          "burst_every_s": _BURST_EVERY.value, "burst_s": _BURST_S.value,
          "burst_factor": _BURST_FACTOR.value, "burst_grace_s": _BURST_GRACE.value,
          "slow_read_s": _SLOW_READ.value, "sample_s": _SAMPLE.value, "seed": _SEED.value,
          "request_timeout_s": _REQ_TIMEOUT.value, "drain_timeout_s": _DRAIN_TIMEOUT.value,
          "max_rss_pct_per_10min": _RSS_PCT.value, "max_fds_per_min": _FDS.value,
          "max_maps_per_min": _MAPS.value, "max_refused_frac": _REFUSED_FRAC.value}


def _server_info(server) -> tuple[str, int, int]:
  import urllib.request
  from launch.loadgen_lib import drivers
  info = drivers.server_info(drivers.DriverConfig("phaseserve", server.target))
  if info is None:
    raise CliError("the server answers no ServerInfo")
  with urllib.request.urlopen(server.http + "/v1/models", timeout=30) as r:
    model = json.loads(r.read())["data"][0]["id"]
  return model, info[0], info[1]


def main(argv: list[str]) -> None:
  from launch import soak_lib
  server_args = list(argv[1:])  # everything after "--"
  cfg = _config()
  plan(cfg["duration_s"], cfg["idle_s"], cfg["idle_every_s"])  # bad timing: exit 2 now
  out = _OUT.value or tempfile.mkdtemp(prefix="phaseserve-soak-")
  os.makedirs(out, exist_ok=True)
  argv_server = ["--model", _MODEL.value] + (["--attention_sinks"] if _SINK_WINDOW.value else []) \
      + server_args

  def on_term(signum, frame):  # SIGTERM: unwind like Ctrl-C, so the server is reaped
    raise KeyboardInterrupt
  signal.signal(signal.SIGTERM, on_term)
  t_start = time.monotonic()
  try:
    server = soak_lib.ServerProc.start(out, argv_server, _READY.value)
  except RuntimeError as e:
    raise CliError(f"{e} (log: {os.path.join(out, 'server.log')})") from None
  t_ready = time.monotonic()
  tr, why, exit_code, end_row = None, "", None, None
  gaps: list[dict] = []
  sampler = soak_lib.Sampler(server, lambda: "ready", cfg["sample_s"], t0=t_ready)
  try:
    info = _server_info(server)
    if not cfg["sink_window"] and cfg["long_tokens"] + 16 > info[2]:
      raise CliError(f"--long_tokens {cfg['long_tokens']} does not fit the context ({info[2]}) "
                     "without attention sinks (--sink_window)")
    ready_row = sampler.sample("ready")
    sampler.start()
    tr, why = asyncio.run(run_traffic(server, sampler, cfg, info, t_ready, gaps))
    sampler.stop()
    if server.proc.poll() is None:
      end_row = sampler.sample("end")
  finally:
    sampler.stop()
    sampler.phase_fn = lambda: "stopping"
    exit_code = server.stop(_GRACE.value)
  wall = time.monotonic() - t_start
  samples = sampler.snapshot()
  recs = tr.records if tr is not None else []
  kinds = [(api, kind) for api, kind, *_ in tr.variants] if tr is not None else []
  report = analyze(cfg, recs, samples, gaps, tr.drains if tr else [],
                   tr.lane_tokens if tr else [], tr.lane_generations if tr else [], ready_row,
                   end_row, why, exit_code, kinds,
                   soak_lib.log_problems(os.path.join(out, "server.log")),
                   len(tr.bursting) if tr else 0)
  report = {"ok": report.pop("ok"), "failed": report.pop("failed"),
            "wall_s": round(wall, 1), "startup_s": round(t_ready - t_start, 1),
            "traffic_s": round(samples[-1]["t_s"], 1) if samples else None,
            "config": cfg, "server": {"argv": server.argv[1:], "pid": server.pid,
                                      "exit_code": exit_code},
            "out": out, **report}
  soak_lib.write_csv(os.path.join(out, "samples.csv"), soak_lib.SAMPLE_COLUMNS, samples)
  soak_lib.write_csv(os.path.join(out, "requests.csv"), REC_COLUMNS,
                     [dataclasses.asdict(r) for r in recs])
  with open(os.path.join(out, "report.json.tmp"), "w") as f:
    json.dump(report, f, indent=2, default=str)
  os.replace(os.path.join(out, "report.json.tmp"), os.path.join(out, "report.json"))
  print(json.dumps(report, default=str))
  sys.stdout.flush()
  if not report["ok"]:
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
