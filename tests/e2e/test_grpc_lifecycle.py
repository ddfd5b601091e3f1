"""launch.server processes on 127.0.0.1 for what ends a server's or a client's day: TLS, API keys,
quotas, a full queue, SIGTERM drain with the usage log complete (every authenticated request
exactly once), and the watchdog of a hung engine step; the OpenAI HTTP port beside gRPC shares
the TLS certificate, the keys, the queue bound and the failed state."""

from __future__ import annotations

import collections
import datetime
import http.client
import ipaddress
import json
import ssl
import threading
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2

from serving.api.proto.jetstream import jetstream_pb2 as js
from serving.api.proto.jetstream import jetstream_pb2_grpc as js_grpc
from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
from tests.grpc_harness import TINY, ServerProc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _self_signed(tmp) -> tuple[str, str]:
  key = ec.generate_private_key(ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
  now = datetime.datetime.now(datetime.timezone.utc)
  cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.SubjectAlternativeName([
              x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
              critical=False)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(key, hashes.SHA256()))
  cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
  cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
  key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
  return str(cert_path), str(key_path)


class Sent:
  """The client ids of every authenticated request this module sends (for the usage check)."""

  def __init__(self):
    self.ids: collections.Counter[str] = collections.Counter()
    self._lock = threading.Lock()

  def add(self, cid: str) -> str:
    with self._lock:
      self.ids[cid] += 1
    return cid


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("grpc_tls")
  cert, key = _self_signed(tmp)
  (tmp / "keys.json").write_text(json.dumps({
      "sk-alice": {"name": "alice"},
      "sk-limited": {"name": "limited", "requests_per_min": 2}}))
  creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
  s = ServerProc.start(tmp, *TINY, "--max_slots", "2", "--max_queue", "4", "--api_keys",
                       str(tmp / "keys.json"), "--tls_cert", cert, "--tls_key", key,
                       "--usage_log", str(tmp / "usage.jsonl"), "--grace_s", "60",
                       "--fault_injection", "--early_reject=false", "--http_port", "0",
                       credentials=creds)
  s.usage_path = tmp / "usage.jsonl"
  s.cert = cert
  s.sent = Sent()
  try:
    yield s
  finally:
    s.stop()


def _auth(key: str = "sk-alice"):
  return [("authorization", f"Bearer {key}")]


def _https(server, body, key="sk-alice", cid="", tls=True):
  """(status, headers, JSON) of one POST /v1/completions to the HTTP port."""
  if tls:
    ctx = ssl.create_default_context(cafile=server.cert)
    conn = http.client.HTTPSConnection("127.0.0.1", server.http_port, timeout=30, context=ctx)
  else:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
  try:
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={
        "Authorization": f"Bearer {key}", "X-Request-Id": server.sent.add(cid) if cid else ""})
    r = conn.getresponse()
    return r.status, dict(r.getheaders()), json.loads(r.read())
  finally:
    conn.close()


def _generate(server, req, key="sk-alice", timeout=60.0):
  with server.channel() as ch:
    return list(pb_grpc.GenerationStub(ch).Generate(req, metadata=_auth(key), timeout=timeout))


def test_tls_round_trip_and_plaintext_refused(tls_server):
  resp = _generate(tls_server, pb.GenerateRequest(
      text="hi", max_tokens=4, client_request_id=tls_server.sent.add("tls-1")))
  assert resp[-1].final.usage.completion_tokens >= 1
  with grpc.insecure_channel(tls_server.target) as ch:
    with pytest.raises(grpc.RpcError) as e:
      list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(text="hi"), metadata=_auth(),
                                               timeout=5))
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_https_shares_the_certificate_and_the_keys(tls_server):
  status, _, out = _https(tls_server, {"model": "tiny", "prompt": "hi", "max_tokens": 4},
                          cid="https-1")
  assert status == 200 and out["usage"]["completion_tokens"] >= 1, out
  status, _, out = _https(tls_server, {"model": "tiny", "prompt": "hi"}, key="sk-wrong")
  assert status == 401 and out["error"]["type"] == "authentication_error"
  with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
    _https(tls_server, {"model": "tiny", "prompt": "hi"}, tls=False)  # plaintext: no answer


def test_missing_or_wrong_key_is_unauthenticated(tls_server):
  for meta in ([], _auth("sk-wrong"), [("authorization", "sk-alice")]):
    with tls_server.channel() as ch:
      with pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(text="hi"), metadata=meta,
                                                 timeout=10))
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
      with pytest.raises(grpc.RpcError) as e:
        list(js_grpc.OrchestratorStub(ch).Decode(js.DecodeRequest(
            text_content=js.DecodeRequest.TextContent(text="hi"), max_tokens=2), metadata=meta,
            timeout=10))
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
  assert tls_server.health("phaseserve.v1.Generation") == SERVING  # health needs no key


def test_quota_is_resource_exhausted(tls_server):
  for i in range(2):
    _generate(tls_server, pb.GenerateRequest(
        text="hi", max_tokens=2, client_request_id=tls_server.sent.add(f"q-{i}")), "sk-limited")
  with pytest.raises(grpc.RpcError) as e:
    _generate(tls_server, pb.GenerateRequest(
        text="hi", max_tokens=2, client_request_id=tls_server.sent.add("q-2")), "sk-limited")
  assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota" in e.value.details()
  _generate(tls_server, pb.GenerateRequest(  # other keys are unaffected
      text="hi", max_tokens=2, client_request_id=tls_server.sent.add("q-alice")))


def test_full_queue_is_resource_exhausted_at_once_and_admitted_requests_finish(tls_server):
  """2 slots + a queue of 4: six slow requests fill both; the next ones are refused at once."""
  results = {}

  def run(i):
    try:
      out = _generate(tls_server, pb.GenerateRequest(
          token_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=30, ignore_eos=True,
          client_request_id=tls_server.sent.add("fault:slow:0.02")))
      results[i] = out[-1].final.usage.completion_tokens
    except grpc.RpcError as e:
      results[i] = e.code()

  def wait_for(series, n):
    deadline = time.monotonic() + 20
    while tls_server.metrics().get(series, 0) < n:
      assert time.monotonic() < deadline, (series, n)
      time.sleep(0.02)

  threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
  for t in threads[:2]:
    t.start()
  wait_for("phaseserve_running_sequences", 2)
  for t in threads[2:]:
    t.start()
  wait_for("jetstream_prefill_backlog_size", 4)
  t0 = time.monotonic()
  with pytest.raises(grpc.RpcError) as e:
    _generate(tls_server, pb.GenerateRequest(
        text="hi", max_tokens=2, client_request_id=tls_server.sent.add("full")))
  assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert "queue is full" in e.value.details() and time.monotonic() - t0 < 2
  status, headers, out = _https(tls_server, {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                cid="full-http")  # the same bound over HTTP: 429, retry soon
  assert status == 429 and out["error"]["code"] == "queue_full"
  assert "queue is full" in out["error"]["message"] and headers["Retry-After"] == "1"
  for t in threads:
    t.join(60)
  assert results == {i: 30 for i in range(6)}
  tls_server.wait_idle()


def test_sigterm_drains_then_exits_with_the_usage_log_complete(tls_server):
  """After SIGTERM a short request finishes; a request sent then is UNAVAILABLE; a second
  SIGTERM cancels the long one with UNAVAILABLE at once (long before --grace_s 60 ends; the end
  of the grace period itself is tests/serving/api/test_frontend.py's drain test); exit 0; every
  authenticated request of this module is in the usage log exactly once."""
  results = {}

  def run(name, slow, max_tokens):
    try:
      out = _generate(tls_server, pb.GenerateRequest(
          token_ids=pb.TokenIds(ids=[4, 5]), max_tokens=max_tokens, ignore_eos=True,
          client_request_id=tls_server.sent.add(f"fault:slow:{slow}")))
      results[name] = ("ok", sum(len(r.token_ids) for r in out))
    except grpc.RpcError as e:
      results[name] = (e.code().name, e.details())

  threads = [threading.Thread(target=run, args=("short", 0.01, 20)),
             threading.Thread(target=run, args=("long", 0.1, 100))]
  for t in threads:
    t.start()
  deadline = time.monotonic() + 20
  while tls_server.metrics().get("phaseserve_running_sequences", 0) < 2:
    assert time.monotonic() < deadline
    time.sleep(0.02)
  tls_server.signal()
  tls_server.wait_health("phaseserve.v1.Generation", NOT_SERVING, 10)
  with pytest.raises(grpc.RpcError) as e:
    _generate(tls_server, pb.GenerateRequest(
        text="hi", max_tokens=2, client_request_id=tls_server.sent.add("after-sigterm")))
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE
  threads[0].join(30)
  assert results["short"] == ("ok", 20) and "long" not in results
  t0 = time.monotonic()
  tls_server.signal()  # the second one: stop waiting
  threads[1].join(30)
  assert time.monotonic() - t0 < 15
  assert results["long"][0] == "UNAVAILABLE" and "shutting down" in results["long"][1]
  tls_server.proc.wait(30)
  assert tls_server.proc.returncode == 0, tls_server.log()
  records = [json.loads(l) for l in tls_server.usage_path.read_text().splitlines()]
  assert collections.Counter(r["client_request_id"] for r in records) == tls_server.sent.ids
  status = {r["client_request_id"]: r["status"] for r in records}
  want = {"after-sigterm": "unavailable", "full": "rejected", "q-2": "rejected", "tls-1": "ok",
          "full-http": "rejected", "https-1": "ok"}
  for cid in set(want) & set(tls_server.sent.ids):  # (all of them when the module runs whole)
    assert status[cid] == want[cid], cid
  assert all(r["api_key"] in ("alice", "limited") for r in records)


def test_watchdog_fails_the_streams_of_a_hung_step_then_the_process_exits_1(tmp_path):
  """A hung step: the stream ends UNAVAILABLE within seconds, new requests are UNAVAILABLE,
  health and /health report NOT_SERVING for --failure_exit_delay_s, then the process exits 1
  by itself (for its supervisor)."""
  s = ServerProc.start(tmp_path, *TINY, "--watchdog_s", "1", "--fault_injection",
                       "--http_port", "0", "--failure_exit_delay_s", "8")
  try:
    t0 = time.monotonic()
    with s.channel() as ch:
      stub = pb_grpc.GenerationStub(ch)
      with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=8,
                                              client_request_id="fault:hang:30"), timeout=20))
      assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "hung" in e.value.details()
      assert time.monotonic() - t0 < 10
      with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text="hi", max_tokens=2), timeout=10))
      assert e.value.code() == grpc.StatusCode.UNAVAILABLE
      assert not js_grpc.OrchestratorStub(ch).HealthCheck(js.HealthCheckRequest(),
                                                          timeout=5).is_live
    assert s.health("") == NOT_SERVING and s.health("phaseserve.v1.Generation") == NOT_SERVING
    for path in ("/health", "/ready"):  # HTTP's liveness and readiness fail with the engine
      conn = http.client.HTTPConnection("127.0.0.1", s.http_port, timeout=10)
      conn.request("GET", path)
      r = conn.getresponse()
      assert (r.status, json.loads(r.read())) == (503, {"status": "failed"})
      conn.close()
    assert s.proc.wait(30) == 1, s.log()
    assert "exit 1 after a loop failure" in s.log()
  finally:
    s.stop()
