"""Runs N local processes of one multi-controller JAX program for the tests, and always reaps them.

``run_workers(argv, n=2, devices=4, timeout=...)`` starts ``python -m <argv...>`` N times with
``--coordinator_address 127.0.0.1:<free port> --num_processes N --process_id i`` appended, each
process seeing ``devices`` fake CPU devices (so 2 x 4 form one 8-device mesh, CPU collectives
through gloo), waits for all of them within ``timeout`` seconds and returns one ``Worker`` per
process (exit code, combined stdout + stderr). Whatever happens (a timeout, a failed assertion
in the caller, KeyboardInterrupt) every process is killed and waited for before it returns or
raises. ``Workers`` is the context-manager form for tests that talk to the processes while
they run (start a server, kill one process, ...).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from tests.cli_env import CLI_XLA_FLAGS
from tests.refenv import REPO


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env(devices: int) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{CLI_XLA_FLAGS} --xla_force_host_platform_device_count={devices}",
             PHASESERVE_CPU_AUTOTUNE="0", PYTHONUNBUFFERED="1",
             PYTHONFAULTHANDLER="1")  # SIGABRT on a timeout prints every thread's stack
  # Gloo over loopback: keep it off any other interface the machine has.
  env.setdefault("GLOO_SOCKET_IFNAME", "lo")
  return env


@dataclasses.dataclass
class Worker:
  process_id: int
  proc: subprocess.Popen
  log_path: str
  returncode: int | None = None

  @property
  def output(self) -> str:
    with open(self.log_path, errors="replace") as f:
      return f.read()


class Workers:
  """``with Workers(tmp_path, argv, n, devices) as ws:`` N processes of one program, reaped on exit."""

  def __init__(self, tmp_path, argv: Sequence[str], n: int = 2, devices: int = 4,
               extra: Sequence[Sequence[str]] | None = None):
    self.tmp_path, self.argv, self.n, self.devices = tmp_path, list(argv), n, devices
    self.extra = [list(e) for e in extra] if extra else [[] for _ in range(n)]
    self.port = free_port()
    self.workers: list[Worker] = []

  @property
  def coordinator(self) -> str:
    return f"127.0.0.1:{self.port}"

  def __enter__(self) -> "Workers":
    try:
      for i in range(self.n):
        log_path = str(self.tmp_path / f"worker{i}.log")
        with open(log_path, "w") as log:
          proc = subprocess.Popen(
              [sys.executable, "-m", *self.argv, "--coordinator_address", self.coordinator,
               "--num_processes", str(self.n), "--process_id", str(i), *self.extra[i]],
              cwd=REPO, env=worker_env(self.devices), stdout=log, stderr=subprocess.STDOUT,
              start_new_session=True)
        self.workers.append(Worker(i, proc, log_path))
    except BaseException:
      self.reap()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.reap()

  def wait(self, timeout: float) -> list[Worker]:
    """Waits for every process to exit (``TimeoutError`` naming the stuck ones after ``timeout``)."""
    deadline = time.monotonic() + timeout
    for w in self.workers:
      try:
        w.returncode = w.proc.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        stuck = [x.process_id for x in self.workers if x.proc.poll() is None]
        for x in self.workers:  # where they hang: faulthandler's stacks into the logs
          if x.proc.poll() is None:
            x.proc.send_signal(signal.SIGABRT)
        for x in self.workers:
          try:
            x.proc.wait(5)
          except subprocess.TimeoutExpired:
            pass
        raise TimeoutError(f"processes {stuck} still running after {timeout:.0f} s:\n"
                           + self.logs()) from None
    return self.workers

  def kill(self, process_id: int, sig: int = signal.SIGKILL) -> None:
    self.workers[process_id].proc.send_signal(sig)

  def logs(self, tail: int = 3000) -> str:
    return "\n".join(f"--- process {w.process_id} (rc {w.proc.poll()}) ---\n{w.output[-tail:]}"
                     for w in self.workers)

  def reap(self) -> None:
    for w in self.workers:
      if w.proc.poll() is None:
        try:
          os.killpg(w.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    for w in self.workers:
      try:
        w.returncode = w.proc.wait(30)
      except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
        pass


def run_workers(tmp_path, argv: Sequence[str], n: int = 2, devices: int = 4,
                timeout: float = 180.0) -> list[Worker]:
  """Runs ``python -m argv`` as N processes to completion; returns them (all reaped)."""
  with Workers(tmp_path, argv, n, devices) as ws:
    return ws.wait(timeout)
