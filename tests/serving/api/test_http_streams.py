"""serving.api.http_server over the FakeEngine, in process: a live stream holds no thread, so more
live SSE streams than bridge threads all finish, none cut off as a slow consumer; a served
model id with a slash (Hugging Face's ``org/name``) is found by ``GET /v1/models/...``."""

from __future__ import annotations

import http.client
import json
import threading
import time

import prometheus_client as prom

from serving.api import http_server
from serving.api.auth import ApiKeys
from serving.api.frontend import FrontendConfig
from tests.serving.api.test_frontend import LIMITS, _frontend, _slow


def _stream_completion(port: int, results: list, i: int) -> None:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  try:
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": "m", "prompt": [1, 2 + i], "max_tokens": 50, "ignore_eos": True,
         "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = [line[6:] for line in resp.read().decode().splitlines()
              if line.startswith("data: ")]
    results[i] = (resp.status, events)
  finally:
    conn.close()


def test_more_live_streams_than_bridge_threads_all_finish():
  # 1 + 8 bridge threads, 3 decode slots, 12 streaming clients that all read promptly: 9 wait
  # in the queue while 3 stream. With a thread parked per live stream, the 9 waiting ones took
  # every thread and the 3 streaming ones went unread past the 0.5 s stall bound.
  fe = _frontend(slots=3, pages=256, config=FrontendConfig(LIMITS, stream_stall_s=0.5,
                                                           early_reject=False))
  fe.loop.engine.execute = _slow(fe.loop.engine.execute, 0.02)
  server = http_server.serve(fe, ApiKeys.none(), prom.CollectorRegistry(),
                             http_server.HttpOptions("m", max_concurrent=1, max_context=64))
  try:
    results: list = [None] * 12
    clients = [threading.Thread(target=_stream_completion, args=(server.port, results, i))
               for i in range(12)]
    for t in clients:
      t.start()
    for t in clients:
      t.join(60)
    for status, events in results:
      assert status == 200 and events[-1] == "[DONE]"
      chunks = [json.loads(e) for e in events[:-1]]
      assert not any("error" in c for c in chunks), chunks
      assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 5
    while fe.live and time.monotonic() < deadline:
      time.sleep(0.02)
    assert fe.live == 0 and fe.loop.scheduler.kv.pool.pages_used == 0
  finally:
    server.stop(2)
    fe.loop.stop(timeout=5)


def test_a_model_id_with_a_slash_is_found():
  """Hugging Face style ids (``org/name``) as the served model: ``GET /v1/models/org/name``."""
  fe = _frontend()
  server = http_server.serve(fe, ApiKeys.none(), prom.CollectorRegistry(),
                             http_server.HttpOptions("org/name", max_context=64))
  try:
    for path, status in (("/v1/models/org/name", 200), ("/v1/models/org%2Fname", 200),
                         ("/v1/models/org/other", 404)):
      conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
      try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = json.loads(resp.read())
      finally:
        conn.close()
      assert resp.status == status, (path, body)
      if status == 200:
        assert body["id"] == "org/name"
  finally:
    server.stop(2)
    fe.loop.stop(timeout=5)
