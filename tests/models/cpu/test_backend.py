"""models.cpu.backend: the backend is a static value, part of the jit key (two values, two
programs; the native one calls the kernels, the default does not), and the ``PHASESERVE_*``
switches are read in one place only (``models/cpu/env.py``)."""

import os
import re

import jax
import jax.numpy as jnp

from models import transformer as T
from models.config import get_preset
from models.cpu.backend import CpuBackend
from models.kv_cache import init_cache
from models.weights import init_params
from tests.cpu_policies import NATIVE, needs_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
READ = re.compile(r"(environ|getenv)\W.*PHASESERVE_|PHASESERVE_\w*\W.*(environ|getenv)")


@needs_kernel
def test_the_backend_is_part_of_the_jit_key():
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0))
  toks = jnp.zeros((2,), jnp.int32)
  hlo = {}
  for name, backend in (("xla", CpuBackend()), ("native", NATIVE)):
    cache = init_cache(cfg, 2, 16, backend=backend).replace(lengths=jnp.full((2,), 3, jnp.int32))
    hlo[name] = T.jit_decode_step.lower(params, toks, cache, cfg=cfg, attend_len=16,
                                        backend=backend).as_text()
  before = T.jit_decode_step._cache_size()
  for backend in (CpuBackend(), NATIVE, CpuBackend()):
    cache = init_cache(cfg, 2, 16, backend=backend)
    T.jit_decode_step(params, toks, cache, cfg=cfg, attend_len=16, backend=backend)
  assert T.jit_decode_step._cache_size() - before == 2  # one program per value, reused
  assert "phaseserve_" not in hlo["xla"]
  assert "phaseserve_float_matmul" in hlo["native"] and "phaseserve_paged_decode" in hlo["native"]


def test_environment_switches_are_read_in_one_place():
  offenders = []
  for package in ("models", "partitioning", "serving", "launch"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
      for f in files:
        path = os.path.join(dirpath, f)
        if not f.endswith(".py") or path == os.path.join(ROOT, "models", "cpu", "env.py"):
          continue
        with open(path, encoding="utf-8") as fh:
          for i, line in enumerate(fh, 1):
            if READ.search(line):
              offenders.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
  assert not offenders, "PHASESERVE_* read outside models/cpu/env.py:\n" + "\n".join(offenders)
