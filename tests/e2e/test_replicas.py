"""Two replicas of the tiny model behind the gateway (``python -m launch.replicas``), on 127.0.0.1.

One deployment for the module, in this order: requests sharing a prefix land on one replica and
hit its prefix cache; distinct prompts spread over both; a replica killed mid-run ends its
in-flight streams with an error event (no hang) while the other's complete and no later request
is lost (the gateway retries); the launcher restarts it and the gateway routes to it again;
SIGTERM to the launcher reaps every process. The replicas run with ``--fault_injection``: an
``X-Request-Id: fault:slow:S`` header (the gateway passes it on) makes each of a request's steps
sleep S seconds, so that streams are still running when the replica dies.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import signal
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.launched import Launched
from tests.grpc_harness import TINY


def _get(url: str) -> bytes:
  with urllib.request.urlopen(url, timeout=10) as r:
    return r.read()


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
  req = urllib.request.Request(url, json.dumps(body).encode(),
                               {"content-type": "application/json", **(headers or {})})
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, {"error": e.read().decode(errors="replace")}


def _stream(url: str, body: dict, headers: dict, out: list[dict | str]) -> list[dict | str]:
  """The server-sent events' payloads (parsed JSON, or the string ``[DONE]``), appended to
  ``out`` as they come."""
  req = urllib.request.Request(url, json.dumps(dict(body, stream=True)).encode(),
                               {"content-type": "application/json", **headers})
  with urllib.request.urlopen(req, timeout=60) as r:
    for line in r:
      if line.startswith(b"data:"):
        data = line[5:].strip().decode()
        out.append(data if data == "[DONE]" else json.loads(data))
  return out


class Deployment:
  def __init__(self, tmp):
    self.launched = Launched("launch.replicas", [
        "--replicas", "2", "--port", "0", "--health_interval_s", "1", "--gateway_grace_s", "1",
        "--workdir", str(tmp), "--ready_timeout_s", "240", "--", *TINY, "--fault_injection",
        "--nowarmup"], tmp)
    try:
      ready = self.launched.next(300)
    except BaseException:
      self.launched.stop()
      raise
    assert ready["event"] == "ready", ready
    self.url = ready["url"]  # .../v1
    self.replicas = [r["url"] for r in ready["replicas"]]
    self.pids = [r["pid"] for r in ready["replicas"]]

  def served(self) -> list[float]:
    """Requests each replica ended with status ok."""
    out = []
    for u in self.replicas:
      text = _get(u + "/metrics").decode()
      out.append(sum(float(m.group(1)) for m in re.finditer(
          r'^phaseserve_requests_total\{[^}]*status="ok"[^}]*\} (\S+)$', text, re.M)))
    return out

  def live(self, i: int) -> float:
    text = _get(self.replicas[i] + "/metrics").decode()
    m = re.search(r"^phaseserve_live_streams (\S+)$", text, re.M)
    assert m
    return float(m.group(1))

  def gateway_health(self) -> dict[str, bool]:
    body = json.loads(_get(self.url.removesuffix("/v1") + "/workers"))
    return {w["url"]: w["is_healthy"] for w in body["workers"]}

@pytest.fixture(scope="module")
def dep(tmp_path_factory):
  d = Deployment(tmp_path_factory.mktemp("replicas"))
  yield d
  d.launched.stop()
  for pid in d.pids:  # the launcher reaped its replicas (and the gateway with them)
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


def test_each_replica_reports_its_load(dep):
  body = json.loads(_get(dep.replicas[0] + "/v1/loads"))
  assert body["dp_rank_count"] == 1
  (rank,) = body["loads"]
  assert rank["max_running_requests"] == 8  # TINY's --max_slots
  assert rank["max_total_num_tokens"] == 64 * 16  # --kv_pages x --page_size
  assert 0.0 <= rank["token_usage"] <= 1.0
  metrics = _get(dep.replicas[0] + "/metrics").decode()
  for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc"):
    assert re.search(rf"^{name} \S+$", metrics, re.M), name


def test_a_shared_prefix_lands_on_one_replica(dep):
  before = dep.served()
  prefix = "The quick brown fox jumps over the lazy dog, again and again. " + "ABCDEFGHIJ" * 3
  usages = []
  for i in range(5):
    status, body = _post(dep.url + "/completions",
                         {"model": "tiny", "prompt": f"{prefix} q{i}", "max_tokens": 3})
    assert status == 200, body
    usages.append(body["usage"])
  delta = sorted(a - b for a, b in zip(dep.served(), before))
  assert delta == [0, 5], delta
  assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
  for u in usages[1:]:  # 96 prompt tokens: the five full 16-token pages of the shared prefix
    assert u["prompt_tokens_details"]["cached_tokens"] == 80, usages


def test_distinct_prompts_spread_over_both(dep):
  before = dep.served()
  rnd = random.Random(1)
  prompts = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(60))
             for _ in range(12)]
  with cf.ThreadPoolExecutor(12) as ex:
    results = list(ex.map(lambda p: _post(dep.url + "/completions",
                                          {"model": "tiny", "prompt": p, "max_tokens": 16}),
                          prompts))
  assert [s for s, _ in results] == [200] * 12
  delta = [a - b for a, b in zip(dep.served(), before)]
  assert sum(delta) == 12 and min(delta) >= 1, delta


def test_a_killed_replica_fails_its_streams_and_loses_no_later_request(dep):
  slow = {"X-Request-Id": "fault:slow:0.1"}  # 40 tokens: ~4 s a stream
  body = {"model": "tiny", "max_tokens": 40, "ignore_eos": True}
  got: list[list[dict | str]] = [[] for _ in range(6)]
  with cf.ThreadPoolExecutor(6) as ex:
    rnd = random.Random(3)
    prompts = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(40))
               for _ in range(6)]
    futs = [ex.submit(_stream, dep.url + "/completions", dict(body, prompt=prompts[i]), slow,
                      got[i]) for i in range(6)]
    deadline = time.monotonic() + 20  # every stream has sent tokens (the gateway retries a
    while min(map(len, got)) < 3 and time.monotonic() < deadline:  # request that sent none)
      time.sleep(0.05)
    live = [dep.live(0), dep.live(1)]
    assert sum(live) == 6 and min(map(len, got)) >= 3, (live, list(map(len, got)))
    victim = live.index(max(live))
    os.kill(dep.pids[victim], signal.SIGKILL)
    t_kill = time.monotonic()
    after = [_post(dep.url + "/completions",
                   {"model": "tiny", "prompt": f"after {i}", "max_tokens": 4})[0]
             for i in range(10)]
    streams = [f.result(timeout=30) for f in futs]
  assert after == [200] * 10  # retried on the live replica
  ended = [s for s in streams if s and isinstance(s[-2], dict) and "error" in s[-2]]
  done = [s for s in streams if s and isinstance(s[-2], dict) and "choices" in s[-2]]
  # the victim's streams (started: not retried) end with an error; the other's complete
  assert (len(ended), len(done)) == (live[victim], 6 - live[victim]), [s[-2:] for s in streams]
  for s in ended:  # an error event, then the end of the stream, not a hang
    assert s[-1] == "[DONE]" and s[-2]["error"]["message"]
  for s in done:  # the other replica's streams ran to their length
    assert s[-1] == "[DONE]" and s[-2]["choices"][0]["finish_reason"] == "length", s[-2:]
  assert time.monotonic() - t_kill < 30

  # The launcher restarts it on its port, and the gateway sends requests to it again.
  events = [dep.launched.next(120), dep.launched.next(240)]
  assert [e["event"] for e in events] == ["replica_exited", "replica_restarted"], events
  assert events[1]["url"] == dep.replicas[victim]
  dep.pids[victim] = events[1]["pid"]
  deadline = time.monotonic() + 30
  while not all(dep.gateway_health().values()) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert all(dep.gateway_health().values()), dep.gateway_health()
  before = dep.served()
  rnd = random.Random(2)
  with cf.ThreadPoolExecutor(12) as ex:
    results = list(ex.map(lambda p: _post(dep.url + "/completions",
                                          {"model": "tiny", "prompt": p, "max_tokens": 16}),
                          ["".join(rnd.choice("abcdefghij ") for _ in range(60))
                           for _ in range(12)]))
  assert [s for s, _ in results] == [200] * 12
  delta = [a - b for a, b in zip(dep.served(), before)]
  assert delta[victim] >= 1, delta
