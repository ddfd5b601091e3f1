"""`make run`'s job, launch.demo, at tiny size: the server starts as a child on a free port, one
chat answer streams, the server is stopped and reaped; a failing server start exits 2."""

from tests import paths
import os
import subprocess
import sys
from tests.cli_env import CLI_XLA_FLAGS

ROOT = str(paths.REPO)


def _demo(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", "launch.demo", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS))


def test_demo_streams_one_answer_and_stops_the_server():
  r = _demo("--model", "tiny", "--quantize", "none", "--max_tokens", "4", "--prompt", "hi")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "--- 4 tokens" in r.stderr and "finish reason: length" in r.stderr
  assert "compiles each program on first use" in r.stderr  # no full warm-up by default
  assert "warm-up: 0 programs" in r.stderr and "stopped" in r.stderr


def test_demo_reports_a_server_that_cannot_start():
  r = _demo("--model", "no-such-model", "--ready_timeout_s", "120")
  assert r.returncode == 2
  assert "error: the server exited with 2 during start-up" in r.stderr
