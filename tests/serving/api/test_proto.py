"""The checked-in gRPC modules are what `make proto` makes from the checked-in .proto files, and
serving/api/proto/jetstream/jetstream.proto is JetStream's published file, unchanged."""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import subprocess
import sys

from tests.refenv import REPO

PROTOS = ("serving/api/proto/phaseserve/v1/generation.proto", "serving/api/proto/jetstream/jetstream.proto")
# sha256 of jetstream/core/proto/jetstream.proto at AI-Hypercomputer/JetStream acd4f5ad (the
# last commit; the file last changed in 508a947, adding has_bos). tests/data/jetstream/ holds it.
JETSTREAM_SHA256 = "7f1a75f09cd5ce53a94cd71963072be39492d599971197339bfc583d2cfa107c"


def test_generated_modules_are_current(tmp_path):
  root = pathlib.Path(REPO)
  for p in PROTOS:
    (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(root / p, tmp_path / p)
  subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.",
                  "--pyi_out=.", "--grpc_python_out=.", *PROTOS], cwd=tmp_path, check=True)
  made = sorted(q.relative_to(tmp_path) for q in tmp_path.rglob("*_pb2*"))
  assert len(made) == 6
  for rel in made:
    assert (root / rel).read_bytes() == (tmp_path / rel).read_bytes(), (
        f"{rel} is stale: run `make proto`")


def test_jetstream_proto_is_the_published_file():
  ours = (pathlib.Path(REPO) / PROTOS[1]).read_bytes()
  published = (pathlib.Path(REPO) / "tests/data/jetstream/jetstream.proto").read_bytes()
  assert hashlib.sha256(published).hexdigest() == JETSTREAM_SHA256
  assert ours == published


def test_optional_fields_are_not_read_as_zero():
  from serving.api.grpc_service import _args
  from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
  a = _args(pb.GenerateRequest(text="x"))
  assert (a.max_tokens, a.temperature, a.top_k, a.top_p, a.seed, a.n, a.logprobs) == (None,) * 7
  b = _args(pb.GenerateRequest(text="x", max_tokens=0, n=0,
                               sampling=pb.Sampling(temperature=0.0, top_k=0, seed=0)))
  assert (b.max_tokens, b.n, b.temperature, b.top_k, b.seed) == (0, 0, 0.0, 0, 0)
