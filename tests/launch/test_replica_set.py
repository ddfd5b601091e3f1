"""The replica launcher's own logic: CPU shares, the flags it owns, its CLI's refusals (no
process is started; tests/e2e/test_replicas.py runs a deployment)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch.replica_set import ReplicaSet, Spec, split_cores
from tests.refenv import REPO


@pytest.mark.parametrize("cores,n,want", [
    ([0, 1], 2, [(0,), (1,)]),
    ([0, 1, 2, 3, 4], 2, [(0, 1, 2), (3, 4)]),
    ([3, 1, 2, 0], 4, [(0,), (1,), (2,), (3,)]),
    ([0, 1], 3, [(0,), (1,), (0,)]),  # fewer cores than replicas: shared round-robin
    ([5], 1, [(5,)]),
])
def test_split_cores(cores, n, want):
  assert split_cores(cores, n) == want


@pytest.mark.parametrize("arg", ["--port", "--http_port=0", "--host", "--port_file"])
def test_the_set_owns_the_address_flags(tmp_path, arg):
  with pytest.raises(ValueError, match="chooses"):
    ReplicaSet(Spec(2, ("--model", "tiny", arg, "1"), str(tmp_path)))


def test_replicas_must_be_positive(tmp_path):
  with pytest.raises(ValueError, match=">= 1"):
    ReplicaSet(Spec(0, ("--model", "tiny"), str(tmp_path)))


def test_unpinned_replicas_have_no_cores(tmp_path):
  rs = ReplicaSet(Spec(3, ("--model", "tiny"), str(tmp_path), pin=False))
  assert [r.cores for r in rs.replicas] == [(), (), ()]
  assert rs.url.startswith("http://127.0.0.1:") and rs.port > 0


@pytest.mark.parametrize("args,message", [
    ([], "give each server's flags after --"),
    (["--", "--model", "tiny", "--http_port", "9"], "the replica set chooses --http_port"),
    (["--policy", "fastest", "--", "--model", "tiny"], "fastest"),
])
def test_cli_refuses_bad_flags(args, message):
  p = subprocess.run([sys.executable, "-m", "launch.replicas", *args], cwd=REPO,
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 2, p.stderr
  assert message in p.stderr
