"""Prefill and decode in separate processes on 127.0.0.1 (``python -m launch.replicas --pd``): a
prefill server and a decode server of the tiny model behind the gateway's prefill / decode
mode. A request's greedy answer through the pair equals the prefill server's own answer
computed in one process, and the decode server computed only the prompt's last partial page
(the rest came from the prefill server's pages); a dead prefill server fails requests with a
status while the decode server still serves, and the other way round."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import urllib.error
import urllib.request

import pytest

from tests.e2e.launched import Launched
from tests.grpc_harness import TINY

PROMPT = "The two phases of inference: prefill computes the prompt, decode its answer. "  # 78


def _post(url: str, body: dict) -> tuple[int, dict]:
  req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                               {"content-type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, {"error": e.read().decode(errors="replace")}


BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}


@contextlib.contextmanager
def _deployment(tmp):
  """The launcher with a prefill and a decode server (no restarts); yields (gateway URL,
  prefill, decode) as the launcher's ready event describes them; always stopped."""
  launched = Launched("launch.replicas", [
      "--pd", "--port", "0", "--norestart", "--health_interval_s", "1", "--gateway_grace_s", "1",
      "--workdir", str(tmp), "--ready_timeout_s", "240", "--", *TINY, "--nowarmup"], tmp)
  try:
    ready = launched.next(300)
    assert ready["event"] == "ready", ready
    roles = {r["role"]: r for r in ready["replicas"]}
    yield ready["url"].removesuffix("/v1"), roles["prefill"], roles["decode"]
  finally:
    launched.stop()


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
  with _deployment(tmp_path_factory.mktemp("pd")) as d:
    yield d


def test_the_pair_answers_as_one_process(pd):
  gateway, prefill, decode = pd
  status, alone = _post(prefill["url"], BODY)  # one process computes prompt and answer
  assert status == 200, alone
  assert alone["kv_transfer_params"]["phaseserve"]["url"] == prefill["url"]
  status, pair = _post(gateway, BODY)
  assert status == 200, pair
  assert pair["choices"][0]["text"] == alone["choices"][0]["text"]
  assert pair["usage"]["completion_tokens"] == 12
  # The decode server took the prompt's 4 whole pages (of 16) from the prefill server.
  assert pair["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"] == 78
  assert pair["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
  # A prompt the decode server has never seen is no different.
  body = dict(BODY, prompt=PROMPT[::-1])
  assert _post(gateway, body)[1]["choices"][0]["text"] == \
      _post(prefill["url"], body)[1]["choices"][0]["text"]


def test_the_prefill_side_refuses_a_bad_page_request(pd):
  _, prefill, _ = pd
  req = urllib.request.Request(prefill["url"] + "/v1/kv/pages", b'{"prompt_token_ids": "x"}',
                               {"content-type": "application/json"})
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(req, timeout=10)
  assert e.value.code == 400
  req = urllib.request.Request(prefill["url"] + "/v1/kv/pages",
                               json.dumps({"prompt_token_ids": list(range(3, 60))}).encode(),
                               {"content-type": "application/json"})
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(req, timeout=10)
  assert e.value.code == 404  # never computed


def test_a_dead_prefill_server_fails_requests_and_the_decode_server_serves(pd):
  gateway, prefill, decode = pd
  os.kill(prefill["pid"], signal.SIGKILL)
  status, body = _post(gateway, BODY)
  assert status >= 500, body  # a status, not a hang (urlopen's timeout is 60 s)
  status, body = _post(decode["url"], BODY)  # the decode server alone computes it all
  assert status == 200 and body["usage"]["completion_tokens"] == 12


def test_a_dead_decode_server_fails_requests_and_the_prefill_server_serves(tmp_path):
  with _deployment(tmp_path) as (gateway, prefill, decode):
    assert _post(gateway, BODY)[0] == 200
    os.kill(decode["pid"], signal.SIGKILL)
    status, body = _post(gateway, BODY)
    assert status >= 500, body
    status, body = _post(prefill["url"], BODY)
    assert status == 200 and body["usage"]["completion_tokens"] == 12


def test_the_pages_route_takes_the_servers_keys(tmp_path):
  """The pages say which prompts a server computed: with API keys, only a key reads them (the
  decode server presents its client's)."""
  from serving.kv_transfer import KvPages
  from tests.e2e.http_harness import KEY, request, served
  with served(tmp_path, *TINY, "--kv_role", "prefill", "--nowarmup") as s:
    status, _, body = request(s, "POST", "/v1/completions",
                              {"model": "tiny", "prompt": PROMPT, "max_tokens": 1})
    assert status == 200, body
    ids = body["kv_transfer_params"]["phaseserve"]["prompt_token_ids"]
    assert len(ids) == 78
    page_request = {"prompt_token_ids": ids}
    assert request(s, "POST", "/v1/kv/pages", page_request, key=None)[0] == 401
    assert request(s, "POST", "/v1/kv/pages", page_request, key="sk-wrong")[0] == 401
    req = urllib.request.Request(f"http://127.0.0.1:{s.http_port}/v1/kv/pages",
                                 json.dumps(page_request).encode(),
                                 {"content-type": "application/json",
                                  "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:  # the prompt's 4 whole pages
      assert KvPages.from_bytes(r.read()).tokens == tuple(ids[:64])
