"""Peak anonymous memory of a code region, net of the bytes it has placed so far (for the tests).

``ExcessWatch()`` samples ``RssAnon`` (``/proc/self/status``: anonymous pages, which is where
XLA:CPU keeps device buffers; a memory-mapped file's pages are file-backed and do not count
unless copied) from a thread every ``interval_s`` and at every ``placed(nbytes)`` call, and keeps
the maximum of ``RssAnon - baseline - placed_so_far``: what the region held beyond the arrays it
had made, at its worst. ``placed`` is called after a buffer exists, so a lagging count can only
overstate the excess. The sampler cannot see between samples: tests lower the interpreter's
switch interval so it runs often (numpy copies and XLA transfers release the GIL).
"""

from __future__ import annotations

import sys
import threading
import time


def rss_anon() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no RssAnon in /proc/self/status")


class ExcessWatch:
  """``with ExcessWatch() as w: ... w.placed(n) ...``; then ``w.excess``, ``w.peak``."""

  def __init__(self, interval_s: float = 0.0005):
    self.interval_s = interval_s
    self.baseline = 0
    self.placed_bytes = 0
    self.excess = 0  # max over samples of anon - baseline - placed
    self.peak = 0  # max over samples of anon - baseline
    self.samples = 0
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._switch = sys.getswitchinterval()

  def sample(self) -> None:
    anon = rss_anon() - self.baseline
    with self._lock:
      self.samples += 1
      self.peak = max(self.peak, anon)
      self.excess = max(self.excess, anon - self.placed_bytes)

  def placed(self, nbytes: int) -> None:
    with self._lock:
      self.placed_bytes += nbytes
    self.sample()

  def _run(self) -> None:
    while not self._stop.is_set():
      self.sample()
      time.sleep(self.interval_s)

  def __enter__(self) -> "ExcessWatch":
    sys.setswitchinterval(0.0002)
    self.baseline = rss_anon()
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self.sample()
    self._stop.set()
    self._thread.join()
    sys.setswitchinterval(self._switch)
