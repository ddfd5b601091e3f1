"""Replicas of ``launch.server`` on one host behind the SGLang Model Gateway (``smg``).

Contract: ``ReplicaSet(spec)``; ``start(timeout_s)`` spawns ``spec.replicas`` servers (each its
own process with its OpenAI HTTP API on 127.0.0.1, the port picked by the OS at first start and
kept across restarts; with ``spec.pin`` each is bound to its share of this process's CPUs), waits
until every one answers ``/ready``, then starts the gateway in front of them (``python -m smg
launch``: ``spec.policy``, health checks on the replicas' ``/ready`` every
``spec.health_interval_s``, its own Prometheus port) and returns once the gateway reports every
replica healthy. ``url`` is the gateway's endpoint, ``replicas[i].url`` a replica's;
``spec.extra_args`` gives replicas flags of their own (a canary); ``spec.roles`` makes them
prefill and decode servers (``--kv_role``) behind the gateway's prefill / decode mode.
``kill(i)`` ends a replica with SIGKILL (a crash), ``stop_replica(i)`` with SIGTERM (it
drains); ``take_out(i)`` removes it from the gateway's rotation; ``restart(i)`` starts a fresh
process on the same port (the gateway's health check takes it back); ``supervise(stop,
on_event)`` restarts replicas that exit until ``stop`` is set; ``healthy()`` is the gateway's
view (worker URL -> healthy). ``stop()`` ends the gateway, then the replicas (SIGTERM: they
drain), and is safe to call at any point.
The server's own address flags (``--host``, ``--port``, ``--http_port``, ``--port_file``) belong
to the set: ``ValueError`` if ``spec.server_args`` names one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Mapping, Sequence

_OWNED_FLAGS = ("--host", "--port", "--http_port", "--port_file")
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load",
            "consistent_hashing", "prefix_hash")  # smg's --policy values for regular workers


@dataclasses.dataclass(frozen=True)
class Spec:
  replicas: int
  server_args: tuple[str, ...]  # launch.server's flags (the model and the rest)
  workdir: str  # logs and port files
  host: str = "127.0.0.1"  # the gateway's address
  port: int = 0  # the gateway's port (0: a free one)
  policy: str = "cache_aware"  # smg's --policy
  pin: bool = True  # each replica on its own share of the CPUs
  health_interval_s: int = 5
  gateway_grace_s: int = 30  # how long the gateway's shutdown lets requests in flight finish
  gateway_args: tuple[str, ...] = ()  # more smg flags
  env: Mapping[str, str] | None = None  # the replicas' environment (None: this process's)
  extra_args: tuple[tuple[str, ...], ...] = ()  # per replica, after server_args (() : none)
  roles: tuple[str, ...] = ()  # per replica "prefill" / "decode": the gateway's PD mode


@dataclasses.dataclass
class Replica:
  index: int
  cores: tuple[int, ...]  # () when not pinned
  log_path: str
  port_file: str
  proc: subprocess.Popen | None = None
  http_port: int = 0
  restarts: int = 0

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.http_port}"

  @property
  def pid(self) -> int | None:
    return self.proc.pid if self.proc is not None else None


def free_port(host: str = "127.0.0.1") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
  try:
    with urllib.request.urlopen(url, timeout=timeout) as r:
      return r.status, r.read()
  except urllib.error.HTTPError as e:
    return e.code, e.read()
  except OSError:
    return 0, b""


def split_cores(cores: Sequence[int], n: int) -> list[tuple[int, ...]]:
  """``cores`` in ``n`` contiguous shares as even as they go; with fewer cores than replicas,
  replica i shares core i mod len(cores)."""
  cores = sorted(cores)
  if len(cores) < n:
    return [(cores[i % len(cores)],) for i in range(n)]
  base, extra = divmod(len(cores), n)
  out, at = [], 0
  for i in range(n):
    size = base + (i < extra)
    out.append(tuple(cores[at:at + size]))
    at += size
  return out


def _child_setup(cores: tuple[int, ...]):
  def setup() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if cores:
      os.sched_setaffinity(0, cores)
  return setup


class ReplicaSet:
  def __init__(self, spec: Spec):
    owned = [a for args in (spec.server_args, *spec.extra_args) for a in args
             if a.split("=", 1)[0] in _OWNED_FLAGS]
    if owned:
      raise ValueError(f"the replica set chooses {', '.join(owned)}: leave it out")
    if spec.replicas < 1:
      raise ValueError(f"replicas must be >= 1, got {spec.replicas}")
    if spec.extra_args and len(spec.extra_args) != spec.replicas:
      raise ValueError(f"extra_args: {len(spec.extra_args)} for {spec.replicas} replicas")
    if spec.roles and (len(spec.roles) != spec.replicas or
                       {"prefill", "decode"} != set(spec.roles)):
      raise ValueError(f"roles: one of prefill / decode per replica, both present: {spec.roles}")
    self.spec = spec
    os.makedirs(spec.workdir, exist_ok=True)
    shares = (split_cores(sorted(os.sched_getaffinity(0)), spec.replicas) if spec.pin
              else [()] * spec.replicas)
    self.replicas = [
        Replica(i, shares[i], os.path.join(spec.workdir, f"replica{i}.log"),
                os.path.join(spec.workdir, f"replica{i}.port")) for i in range(spec.replicas)]
    self.port = spec.port or free_port(spec.host)
    self.url = f"http://{'127.0.0.1' if spec.host in ('0.0.0.0', '') else spec.host}:{self.port}"
    self.gateway: subprocess.Popen | None = None
    self.gateway_log = os.path.join(spec.workdir, "gateway.log")
    self._lock = threading.Lock()

  # -- replicas -------------------------------------------------------------------------------

  def _spawn(self, r: Replica) -> None:
    for suffix in ("", ".http", ".metrics", ".tmp"):
      try:
        os.remove(r.port_file + suffix)
      except FileNotFoundError:
        pass
    extra = self.spec.extra_args[r.index] if self.spec.extra_args else ()
    if self.spec.roles:
      extra = (*extra, "--kv_role", self.spec.roles[r.index])
    argv = [sys.executable, "-m", "launch.server", *self.spec.server_args, *extra,
            "--host", "127.0.0.1",
            "--port", "0", "--port_file", r.port_file, "--http_port", str(r.http_port)]
    with open(r.log_path, "a") as log:
      r.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.spec.env,
                                stdin=subprocess.DEVNULL, preexec_fn=_child_setup(r.cores))

  def _wait_ready(self, r: Replica, deadline: float) -> None:
    assert r.proc is not None
    while True:
      if r.proc.poll() is not None:
        raise RuntimeError(f"replica {r.index} exited {r.proc.returncode} while starting: "
                           f"{_tail(r.log_path)}")
      if not r.http_port and os.path.exists(r.port_file + ".http"):
        r.http_port = int(open(r.port_file + ".http").read())
      if r.http_port and http_get(r.url + "/ready")[0] == 200:
        return
      if time.monotonic() > deadline:
        raise TimeoutError(f"replica {r.index} not ready in time: {_tail(r.log_path)}")
      time.sleep(0.2)

  def stop_replica(self, i: int, grace_s: float = 30.0) -> None:
    """SIGTERM (the replica drains its live requests), then SIGKILL after ``grace_s``."""
    proc = self.replicas[i].proc
    if proc is not None and proc.poll() is None:
      proc.send_signal(signal.SIGTERM)
      try:
        proc.wait(grace_s)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)

  def kill(self, i: int) -> None:
    proc = self.replicas[i].proc
    if proc is not None and proc.poll() is None:
      proc.kill()
      proc.wait(30)

  def restart(self, i: int, timeout_s: float = 300.0) -> None:
    """A fresh process for replica ``i`` on its port, once it is ready (the old one killed)."""
    r = self.replicas[i]
    with self._lock:
      self.kill(i)
      r.restarts += 1
      self._spawn(r)
    self._wait_ready(r, time.monotonic() + timeout_s)

  def supervise(self, stop: threading.Event, on_event: Callable[[dict], None],
                poll_s: float = 1.0) -> None:
    """Restarts each replica that exits, until ``stop`` is set; ``on_event`` hears of each exit,
    restart and failed restart (a dict with ``event`` and ``replica``)."""
    while not stop.wait(poll_s):
      for r in self.replicas:
        if r.proc is None or r.proc.poll() is None or stop.is_set():
          continue
        on_event({"event": "replica_exited", "replica": r.index, "returncode": r.proc.returncode})
        try:
          self.restart(r.index)
          on_event({"event": "replica_restarted", "replica": r.index, "url": r.url,
                    "pid": r.pid})
        except (RuntimeError, TimeoutError) as e:
          on_event({"event": "replica_failed", "replica": r.index, "error": str(e)[-500:]})

  # -- the gateway ----------------------------------------------------------------------------

  def _gateway_argv(self) -> list[str]:
    s = self.spec
    if s.roles:  # prefill and decode servers: the gateway sends each request to one, then one
      workers = [a for r, role in zip(self.replicas, s.roles) for a in (f"--{role}", r.url)]
      workers.insert(0, "--pd-disaggregation")
    else:
      workers = ["--worker-urls", *[r.url for r in self.replicas]]
    return [sys.executable, "-m", "smg", "launch", "--host", s.host, "--port", str(self.port),
            *workers, "--policy", s.policy,
            "--health-check-endpoint", "/ready",
            "--health-check-interval-secs", str(s.health_interval_s),
            "--health-failure-threshold", "1", "--health-success-threshold", "1",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--shutdown-grace-period-secs", str(s.gateway_grace_s),
            "--log-level", "info", *s.gateway_args]

  def model_id(self) -> str:
    """The model id the gateway serves (its ``/v1/models``)."""
    status, body = http_get(self.url + "/v1/models")
    if status != 200:
      raise RuntimeError(f"the gateway's /v1/models: HTTP {status}")
    return json.loads(body)["data"][0]["id"]

  def take_out(self, i: int, timeout_s: float = 60.0) -> bool:
    """Removes replica ``i`` from the gateway's rotation (its control plane: ``DELETE
    /workers/{id}``; the gateway drains it for 5 s, then drops it) and returns once the gateway
    no longer lists it: no new request goes to it; what it runs finishes. False when the gateway
    does not list it."""
    status, body = http_get(self.url + "/workers")
    if status != 200:
      raise RuntimeError(f"the gateway's /workers: HTTP {status}")
    url = self.replicas[i].url
    ids = [w["id"] for w in json.loads(body).get("workers", []) if w["url"] == url]
    if not ids:
      return False
    req = urllib.request.Request(f"{self.url}/workers/{ids[0]}", method="DELETE")
    with urllib.request.urlopen(req, timeout=10) as r:  # 202: the gateway drains it, then drops it
      if r.status >= 300:
        raise RuntimeError(f"DELETE /workers/{ids[0]}: HTTP {r.status}")
    deadline = time.monotonic() + timeout_s
    while url in self.healthy():
      if time.monotonic() > deadline:
        raise TimeoutError(f"the gateway still lists {url} {timeout_s} s after its removal")
      time.sleep(0.2)
    return True

  def healthy(self) -> dict[str, bool]:
    """The gateway's workers: URL -> healthy (empty when it does not answer)."""
    status, body = http_get(self.url + "/workers")
    if status != 200:
      return {}
    return {w["url"]: bool(w.get("is_healthy")) for w in json.loads(body).get("workers", [])}

  def wait_healthy(self, urls: Sequence[str], deadline: float) -> None:
    while True:
      if self.gateway is not None and self.gateway.poll() is not None:
        raise RuntimeError(f"the gateway exited {self.gateway.returncode}: "
                           f"{_tail(self.gateway_log)}")
      seen = self.healthy()
      if all(seen.get(u) for u in urls):
        return
      if time.monotonic() > deadline:
        raise TimeoutError(f"the gateway does not report {list(urls)} healthy ({seen}): "
                           f"{_tail(self.gateway_log)}")
      time.sleep(0.2)

  def start(self, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    try:
      for r in self.replicas:
        self._spawn(r)
      for r in self.replicas:
        self._wait_ready(r, deadline)
      with open(self.gateway_log, "a") as log:
        env = dict(os.environ, NO_COLOR="1")
        self.gateway = subprocess.Popen(self._gateway_argv(), stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, preexec_fn=_child_setup(()))
      self.wait_healthy([r.url for r in self.replicas], deadline)
    except BaseException:
      self.stop()
      raise

  def stop(self, grace_s: float | None = None) -> None:
    """SIGTERM to all, the gateway first; SIGKILL what is left after ``grace_s`` (default: the
    gateway's grace and 30 s more for the replicas to drain)."""
    if grace_s is None:
      grace_s = self.spec.gateway_grace_s + 30.0
    procs = ([self.gateway] if self.gateway is not None else []) + \
        [r.proc for r in self.replicas if r.proc is not None]
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in procs:
      try:
        p.wait(max(0.1, end - time.monotonic()))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait(30)


def _tail(path: str, n: int = 3000) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()[-n:]
  except OSError:
    return ""
