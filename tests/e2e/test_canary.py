"""A canary on 127.0.0.1 (``python -m launch.canary``): a baseline and a deliberately slowed
candidate (``--fault_step_delay_s``: every engine step sleeps) of the tiny model behind the
gateway, round-robin; under steady traffic the canary finds the candidate's latency in breach,
takes it out of the gateway's rotation and stops it, no request fails, later requests all go to
the baseline, and the run ends with exit 1 and a summary. The verdict logic on made-up records:
tests/launch/test_canary_judge.py."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
import urllib.error
import urllib.request

from tests.e2e.launched import Launched
from tests.grpc_harness import TINY


def _complete(url: str, i: int) -> int:
  body = json.dumps({"model": "tiny", "prompt": f"request {i}", "max_tokens": 8}).encode()
  req = urllib.request.Request(url + "/completions", body, {"content-type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      r.read()
      return r.status
  except urllib.error.HTTPError as e:
    return e.code


def test_a_slow_candidate_is_taken_out_of_rotation(tmp_path):
  canary = Launched("launch.canary", [
      "--port", "0", "--workdir", str(tmp_path),
      "--candidate=--fault_injection --fault_step_delay_s 0.05", "--window_s", "3",
      "--min_requests", "5", "--health_interval_s", "1", "--gateway_grace_s", "1",
      "--duration_s", "120", "--ready_timeout_s", "240", "--", *TINY], tmp_path)
  stop_traffic = threading.Event()
  try:
    ready = canary.next(300)
    assert ready["event"] == "ready", ready
    url = ready["url"]
    roles = {r["url"]: r["role"] for r in ready["replicas"]}
    assert sorted(roles.values()) == ["baseline", "candidate"]
    statuses: list[int] = []

    def traffic() -> None:  # ~10 requests a second, 4 at a time, until told to stop
      with cf.ThreadPoolExecutor(4) as ex:
        i = 0
        while not stop_traffic.is_set():
          statuses.extend(ex.map(lambda k: _complete(url, k), range(i, i + 4)))
          i += 4
          time.sleep(0.3)
    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    removed, seen = canary.until("removed", 120)
    windows = [w for w in seen if w["event"] == "window"]
    assert windows[-1]["verdict"] == "breach", windows
    assert any("ttft" in r or "tpot" in r for r in removed["reasons"]), removed
    # Out of the gateway's rotation, and stopped; the baseline serves on.
    workers = json.load(urllib.request.urlopen(url.removesuffix("/v1") + "/workers", timeout=10))
    assert [roles[w["url"]] for w in workers["workers"]] == ["baseline"]
    n_before = len(statuses)
    deadline = time.monotonic() + 30
    while len(statuses) < n_before + 12 and time.monotonic() < deadline:
      time.sleep(0.1)
    stop_traffic.set()
    t.join(60)
    assert len(statuses) >= n_before + 12
    assert set(statuses) == {200}, sorted(set(statuses))
    assert canary.stop() == 1
    summary, _ = canary.until("summary", 10)
    assert summary["outcome"] == "removed" and summary["reasons"]
    assert summary["baseline"]["ok"] > summary["candidate"]["ok"] > 0
    assert summary["baseline"]["errors"] == summary["candidate"]["errors"] == 0
  finally:
    stop_traffic.set()
    canary.stop()
