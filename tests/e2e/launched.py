"""A launch CLI that prints one JSON event a line (``launch.replicas``, ``launch.canary``) as a
test's child process: ``Launched(module, args, tmp)`` starts it on 127.0.0.1's servers (one CPU
device each, as a user's), reads its events on a thread (``next(timeout)``) and ``stop()`` sends
SIGTERM, waits, then kills; it returns the exit code."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from typing import Sequence

from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS


class Launched:
  def __init__(self, module: str, args: Sequence[str], tmp):
    self.proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=REPO, text=True,
        env=dict(os.environ, XLA_FLAGS=CLI_XLA_FLAGS, JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE,
        stderr=open(tmp / f"{module.rsplit('.', 1)[-1]}.err", "w"))
    self._events: queue.Queue[dict] = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    assert self.proc.stdout is not None
    for line in self.proc.stdout:
      self._events.put(json.loads(line))

  def next(self, timeout: float) -> dict:
    try:
      return self._events.get(timeout=timeout)
    except queue.Empty:
      raise TimeoutError(f"no event in {timeout} s (exit {self.proc.poll()})") from None

  def until(self, event: str, timeout: float) -> tuple[dict, list[dict]]:
    """The next event named ``event`` and the events before it."""
    seen = []
    while True:
      e = self.next(timeout)
      if e["event"] == event:
        return e, seen
      seen.append(e)

  def stop(self, timeout: float = 60.0) -> int:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        return self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        self.proc.kill()
    return self.proc.wait(30)
