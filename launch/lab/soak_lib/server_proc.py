"""The soak's server process, sampler, slopes and files (``launch.lab.soak`` is the CLI).
Nothing here imports JAX.

Contract:
  * ``ServerProc.start(out_dir, argv, ready_timeout_s)`` runs ``python -m launch.server ARGV
    --port 0 --port_file OUT/server.port --http_port 0 --metrics_port 0`` with its output in
    ``OUT/server.log``, in the caller's process group and with ``PR_SET_PDEATHSIG`` = SIGKILL
    (it dies with the soak, even a SIGKILLed one), waits for the three port files and then for
    readiness (gRPC health of ``phaseserve.v1.Generation`` SERVING and ``GET /ready`` 200);
    raises ``RuntimeError`` with the log's tail if it exits or is not ready in time, after
    killing it. ``ServerProc.spawn(...)`` starts it and returns a ``Spawned`` at once, whose
    ``wait(ready_timeout_s)`` is the rest of ``start`` (several servers warming up side by side;
    spawn from a thread that outlives the server: the death signal follows the forking
    thread). ``stop(grace_s)``: SIGTERM, wait, SIGKILL; returns the exit code.
  * ``scrape(text) -> dict``: the soak's series from a Prometheus text page (``SERIES``: sums
    over labels; a family that is registered but has no sample yet, a labelled counter never
    incremented, reads 0; a family that is not registered at all reads ``None``).
  * ``Sampler(server, phase_fn, period_s)``: a thread that every ``period_s`` records one row
    (``SAMPLE_COLUMNS``): the process's RSS (``/proc/PID/status`` VmRSS), open fds
    (``/proc/PID/fd``), mappings (lines of ``/proc/PID/maps``), threads (``/proc/PID/task``),
    the scraped series, and the health seen from outside (``GET /health``, ``GET /ready``, gRPC
    health of ``""`` and ``phaseserve.v1.Generation``). ``sample(phase)`` takes one row now
    (any thread).
  * ``slope_per_min(ts, ys)``: the least-squares slope (units per minute) of ``ys`` over ``ts``
    (seconds); ``percentile(xs, q)`` is nearest-rank (``launch.lab.loadgen_lib.report``'s).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Sequence

import numpy as np

from launch.lab.loadgen_lib.report import percentile  # noqa: F401 (for soak_lib.report)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
READY_SERVICE = "phaseserve.v1.Generation"

# report key -> Prometheus sample names (the first one registered wins; counters end in _total).
SERIES: dict[str, tuple[str, ...]] = {
    "kv_pages_used": ("phaseserve_kv_pages_used",),
    "kv_pages_cached": ("phaseserve_kv_pages_cached",),
    "kv_pages_free": ("phaseserve_kv_pages_free",),
    "running": ("phaseserve_running_sequences",),
    "queue": ("phaseserve_queue_length",),
    "live_streams": ("phaseserve_live_streams",),
    "compiled_programs": ("phaseserve_compiled_programs", "phaseserve_programs_loaded"),
    "programs_after_ready": ("phaseserve_programs_after_ready",),
    "memory_mappings": ("phaseserve_memory_mappings",),  # the server's own count (cf. maps)
    "internal_errors": ("phaseserve_internal_errors_total",),
    "loop_failures": ("phaseserve_loop_failures_total",),
    "loop_restarts": ("phaseserve_loop_restarts_total",),
    "engine_faults": ("phaseserve_engine_faults", "phaseserve_engine_faults_total"),
}
SAMPLE_COLUMNS = ("t_s", "phase", "alive", "rss_bytes", "fds", "maps", "threads", *SERIES,
                  "scrape_error", "http_health", "http_ready", "grpc_live", "grpc_ready")


def _die_with_parent() -> None:  # runs in the child between fork and exec
  try:
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):  # not Linux: the soak's finally still reaps it
    pass


def _tail(path: str, chars: int = 3000) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()[-chars:]
  except OSError:
    return ""


class ServerProc:
  def __init__(self, proc: subprocess.Popen, argv: list[str], log_path: str, port: int,
               http_port: int, metrics_port: int):
    self.proc, self.argv, self.log_path = proc, argv, log_path
    self.port, self.http_port, self.metrics_port = port, http_port, metrics_port
    self.target = f"127.0.0.1:{port}"
    self.http = f"http://127.0.0.1:{http_port}"
    self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

  @property
  def pid(self) -> int:
    return self.proc.pid

  @classmethod
  def start(cls, out_dir: str, server_argv: Sequence[str], ready_timeout_s: float,
            env: dict[str, str] | None = None) -> "ServerProc":
    return cls.spawn(out_dir, server_argv, env).wait(ready_timeout_s)

  @classmethod
  def spawn(cls, out_dir: str, server_argv: Sequence[str],
            env: dict[str, str] | None = None) -> "Spawned":
    """Start the process and return at once (``Spawned.wait`` waits for readiness), so that
    several servers warm up side by side. Call it from a thread that outlives the server:
    ``PR_SET_PDEATHSIG`` fires when the forking *thread* ends."""
    port_file = os.path.join(out_dir, "server.port")
    for suffix in ("", ".http", ".metrics", ".tmp"):
      try:
        os.remove(port_file + suffix)
      except FileNotFoundError:
        pass
    log_path = os.path.join(out_dir, "server.log")
    argv = [sys.executable, "-m", "launch.server", *server_argv, "--port", "0",
            "--port_file", port_file, "--http_port", "0", "--metrics_port", "0"]
    with open(log_path, "w") as log:
      proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    return Spawned(cls, proc, argv, log_path, port_file, time.monotonic())

  def wait_ready(self, deadline: float) -> None:
    while True:
      if self.proc.poll() is not None:
        raise RuntimeError(f"the server exited {self.proc.returncode} while warming up: "
                           f"{_tail(self.log_path)}")
      if grpc_health(self.target, READY_SERVICE) == "SERVING" and \
          http_status(self.http + "/ready") == 200:
        return
      if time.monotonic() > deadline:
        raise RuntimeError(f"the server was not ready in time: {_tail(self.log_path)}")
      time.sleep(0.25)

  def stop(self, grace_s: float = 30.0) -> int | None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(grace_s + 15.0)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        try:
          self.proc.wait(30)
        except subprocess.TimeoutExpired:  # pragma: no cover - ignores SIGKILL
          return None
    return self.proc.returncode


class Spawned:
  """A server process that may not be ready yet."""

  def __init__(self, cls: type[ServerProc], proc: subprocess.Popen, argv: list[str],
               log_path: str, port_file: str, t0: float):
    self.cls, self.proc, self.argv = cls, proc, argv
    self.log_path, self.port_file, self.t0 = log_path, port_file, t0

  def wait(self, ready_timeout_s: float) -> ServerProc:
    """The ready server (``ready_timeout_s`` from the spawn), or ``RuntimeError`` with the log's
    tail after killing it."""
    proc, port_file, log_path = self.proc, self.port_file, self.log_path
    try:
      deadline = self.t0 + ready_timeout_s
      while not os.path.exists(port_file):
        if proc.poll() is not None:
          raise RuntimeError(f"the server exited {proc.returncode} before binding: "
                             f"{_tail(log_path)}")
        if time.monotonic() > deadline:
          raise RuntimeError(f"the server did not bind in {ready_timeout_s:g} s: "
                             f"{_tail(log_path)}")
        time.sleep(0.1)
      read = lambda p: int(open(p).read().strip())
      server = self.cls(proc, self.argv, log_path, read(port_file), read(port_file + ".http"),
                        read(port_file + ".metrics"))
      server.wait_ready(deadline)
      return server
    except BaseException:
      self.kill()
      raise

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait(30)


def http_status(url: str, timeout_s: float = 5.0) -> int | str:
  """The HTTP status of a GET (an int), or the failure's class name."""
  try:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
      r.read()
      return r.status
  except urllib.error.HTTPError as e:
    return e.code
  except (OSError, ValueError) as e:  # URLError, timeouts, refused connections
    return type(e).__name__


def grpc_health(target: str, service: str, timeout_s: float = 5.0) -> str:
  """``SERVING`` / ``NOT_SERVING`` / ..., or the RPC's status code name."""
  import grpc
  from grpc_health.v1 import health_pb2, health_pb2_grpc
  with grpc.insecure_channel(target) as ch:
    try:
      r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                               timeout=timeout_s)
    except grpc.RpcError as e:
      return e.code().name if hasattr(e, "code") else type(e).__name__
  return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def scrape(text: str) -> dict[str, float | None]:
  from prometheus_client.parser import text_string_to_metric_families
  families: set[str] = set()
  values: dict[str, float] = {}
  for fam in text_string_to_metric_families(text):
    families.add(fam.name)
    for s in fam.samples:
      values[s.name] = values.get(s.name, 0.0) + s.value
  out: dict[str, float | None] = {}
  for key, names in SERIES.items():
    out[key] = None
    for name in names:
      family = name[:-len("_total")] if name.endswith("_total") else name
      if name in values:
        out[key] = values[name]
        break
      if family in families or name in families:
        out[key] = 0.0  # registered, no labelled sample yet
        break
  return out


def proc_stats(pid: int) -> tuple[int | None, int | None, int | None, int | None]:
  """(RSS bytes, open fds, mappings, threads) of a live process; None for what cannot be
  read."""
  rss = fds = maps = threads = None
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          rss = int(line.split()[1]) * 1024
          break
  except (OSError, ValueError, IndexError):
    pass
  try:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
  except OSError:
    pass
  try:
    with open(f"/proc/{pid}/maps") as f:
      maps = sum(1 for _ in f)
  except OSError:
    pass
  try:
    threads = len(os.listdir(f"/proc/{pid}/task"))
  except OSError:
    pass
  return rss, fds, maps, threads


class Sampler:
  def __init__(self, server: ServerProc, phase_fn: Callable[[], str], period_s: float = 2.0,
               t0: float | None = None):
    self.server = server
    self.phase_fn = phase_fn
    self.period_s = period_s
    self.t0 = time.monotonic() if t0 is None else t0
    self.rows: list[dict] = []
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def sample(self, phase: str | None = None) -> dict:
    pid = self.server.pid
    alive = self.server.proc.poll() is None
    row: dict = {"t_s": round(time.monotonic() - self.t0, 3),
                 "phase": phase or self.phase_fn(), "alive": alive}
    row["rss_bytes"], row["fds"], row["maps"], row["threads"] = (
        proc_stats(pid) if alive else (None,) * 4)
    row["scrape_error"] = ""
    try:
      with urllib.request.urlopen(self.server.metrics_url, timeout=5.0) as r:
        row.update(scrape(r.read().decode("utf-8")))
    except (OSError, ValueError) as e:
      row.update({k: None for k in SERIES})
      row["scrape_error"] = type(e).__name__
    row["http_health"] = http_status(self.server.http + "/health")
    row["http_ready"] = http_status(self.server.http + "/ready")
    row["grpc_live"] = grpc_health(self.server.target, "")
    row["grpc_ready"] = grpc_health(self.server.target, READY_SERVICE)
    with self._lock:
      self.rows.append(row)
    return row

  def _run(self) -> None:
    next_t = time.monotonic()
    while not self._stop.is_set():
      try:
        self.sample()
      except Exception as e:  # never lose the soak to a sampling bug; the row says so
        with self._lock:
          self.rows.append({"t_s": round(time.monotonic() - self.t0, 3),
                            "phase": self.phase_fn(), "alive": self.server.proc.poll() is None,
                            "scrape_error": f"sampler: {type(e).__name__}: {e}"})
      next_t += self.period_s
      self._stop.wait(max(0.0, next_t - time.monotonic()))

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(30)

  def snapshot(self) -> list[dict]:
    with self._lock:
      return list(self.rows)


def slope_per_min(ts: Sequence[float], ys: Sequence[float]) -> float | None:
  pts = [(t, y) for t, y in zip(ts, ys) if y is not None]
  if len(pts) < 3 or pts[-1][0] - pts[0][0] <= 0:
    return None
  t = np.asarray([p[0] for p in pts], np.float64) / 60.0
  y = np.asarray([p[1] for p in pts], np.float64)
  t = t - t.mean()
  denom = float((t * t).sum())
  if denom <= 0:
    return None
  return float((t * (y - y.mean())).sum() / denom)


def write_csv(path: str, columns: Sequence[str], rows: Sequence[dict]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
    w.writeheader()
    for row in rows:
      w.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
  os.replace(tmp, path)


def log_problems(path: str, limit: int = 20) -> dict:
  """Lines of the server log at ERROR / FATAL level (absl's E / F prefix) or in a traceback."""
  lines: list[str] = []
  count = 0
  try:
    with open(path, errors="replace") as f:
      in_tb = False
      for line in f:
        bad = line[:1] in ("E", "F") and line[1:5].isdigit()
        if line.startswith("Traceback"):
          in_tb = True
        if bad or in_tb:
          count += 1
          if len(lines) < limit:
            lines.append(line.rstrip()[:400])
        if in_tb and line.strip() and not line.startswith((" ", "Traceback")):
          in_tb = False  # the exception's own line ends a traceback
  except OSError:
    pass
  return {"lines": count, "first": lines}
