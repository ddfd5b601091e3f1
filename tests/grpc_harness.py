"""Starts ``launch.server`` as a real process on 127.0.0.1 for the service tests, and always reaps it.

``ServerProc.start(tmp_path, *flags)`` binds a free port (``--port 0 --port_file``), waits for
readiness through the health service and returns; ``stop()`` sends SIGTERM, waits, then kills,
and returns the exit code. ``metrics()`` scrapes the Prometheus endpoint into {series: value}.
With ``--http_port 0`` among the flags, ``http_port`` is the OpenAI HTTP API's bound port (bound
before the port file is written, so before the warm-up), else None. ``xla_flags``: the server's
``XLA_FLAGS`` (``tests.cli_env.CLI_XLA_FLAGS`` unless given).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS

TINY = ("--model", "tiny", "--max_context", "128", "--max_slots", "8", "--kv_pages", "64",
        "--page_size", "16", "--max_chunk", "32", "--max_prefill_chunks", "2")


class ServerProc:
  def __init__(self, proc: subprocess.Popen, port: int, metrics_port: int | None, log_path: str,
               credentials: grpc.ChannelCredentials | None = None,
               http_port: int | None = None):
    self.proc = proc
    self.http_port = http_port
    self.port = port
    self.metrics_port = metrics_port
    self.log_path = log_path
    self.credentials = credentials
    self.target = f"127.0.0.1:{port}"

  @classmethod
  def start(cls, tmp_path, *flags: str, credentials=None, ready_timeout: float = 240.0,
            wait_ready: bool = True, xla_flags: str = CLI_XLA_FLAGS) -> "ServerProc":
    port_file = str(tmp_path / "port")
    log_path = str(tmp_path / "server.log")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.server", "--port", "0",
                             "--port_file", port_file, "--metrics_port", "0", *flags],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
      deadline = time.monotonic() + ready_timeout
      while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(f"server did not bind: {cls._tail(log_path)}")
        time.sleep(0.1)
      port = int(open(port_file).read())
      mport = int(open(port_file + ".metrics").read())
      hport = int(open(port_file + ".http").read()) if "--http_port" in flags else None
      server = cls(proc, port, mport, log_path, credentials, hport)
      if wait_ready:
        server.wait_health("phaseserve.v1.Generation", health_pb2.HealthCheckResponse.SERVING,
                           deadline - time.monotonic())
      return server
    except BaseException:
      proc.kill()
      proc.wait(10)
      raise

  @staticmethod
  def _tail(path: str) -> str:
    try:
      return open(path).read()[-3000:]
    except OSError:
      return ""

  def log(self) -> str:
    return self._tail(self.log_path)

  def channel(self, **options) -> grpc.Channel:
    opts = list(options.items())
    if self.credentials is not None:
      return grpc.secure_channel(self.target, self.credentials,
                                 options=opts + [("grpc.ssl_target_name_override", "localhost")])
    return grpc.insecure_channel(self.target, options=opts)

  def health(self, service: str = "") -> int:
    with self.channel() as ch:
      return health_pb2_grpc.HealthStub(ch).Check(
          health_pb2.HealthCheckRequest(service=service), timeout=5).status

  def wait_health(self, service: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
      if self.proc.poll() is not None:
        raise RuntimeError(f"server exited {self.proc.returncode}: {self.log()}")
      try:
        if self.health(service) == status:
          return
      except grpc.RpcError:
        pass
      if time.monotonic() > deadline:
        raise TimeoutError(f"health of {service!r} never became {status}: {self.log()}")
      time.sleep(0.1)

  def metrics(self, port: int | None = None) -> dict[str, float]:
    """``port``: scrape another endpoint of the same registry (the HTTP API's /metrics)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port or self.metrics_port}/metrics",
                                  timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
      m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
      if m and "_created" not in m.group(1):  # creation timestamps are not values
        out[m.group(1)] = float(m.group(2))
    return out

  def wait_idle(self, timeout: float = 30.0, port: int | None = None) -> dict[str, float]:
    """Until no sequence runs, no KV page is used and no stream is live (read from /metrics)."""
    deadline = time.monotonic() + timeout
    while True:
      m = self.metrics(port)
      if (m.get("phaseserve_running_sequences") == 0 and m.get("phaseserve_kv_pages_used") == 0
          and m.get("phaseserve_live_streams") == 0):
        return m
      if time.monotonic() > deadline:
        raise TimeoutError(f"not idle: running {m.get('phaseserve_running_sequences')}, pages "
                           f"{m.get('phaseserve_kv_pages_used')}, streams "
                           f"{m.get('phaseserve_live_streams')}")
      time.sleep(0.05)

  def signal(self, sig=signal.SIGTERM) -> None:
    self.proc.send_signal(sig)

  def stop(self, timeout: float = 30.0) -> int:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait(10)
    return self.proc.returncode
