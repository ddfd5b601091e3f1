"""JAX's persistent compilation cache for the serving CLIs: a second start-up skips the compiles.

Contract: ``configure(directory)`` must run before the first compile; it returns the directory in
use, or None when the cache is off.
  * ``JAX_COMPILATION_CACHE_DIR`` set in the environment wins (the test suite sets a fresh one per
    session); JAX reads it itself, so nothing is changed.
  * ``directory == ""``: off.
  * ``directory is None``: ``<PHASESERVE_CACHE_DIR or ~/.cache/phaseserve>/jax/<cpu>``, where
    ``<cpu>`` is a hash of this CPU's model and AVX-512 / AMX flags. JAX's own key covers the
    program, XLA flags, jax version and backend, but on CPU not the instruction set the executable
    was compiled for: a home directory shared by an AMX Xeon and an EPYC must not hand one the
    other's executables (an illegal instruction), so each CPU gets its own directory.
  * anything else: that directory.
Programs that compile in under a second are not stored (JAX's default threshold), so the cache
holds the engine's bucketed programs, not every small helper.
"""

from __future__ import annotations

import hashlib
import os


def default_directory() -> str:
  from models.cpu import cpuinfo, env
  cpu = hashlib.sha256(cpuinfo.key().encode()).hexdigest()[:16]
  return os.path.join(env.cache_dir(), "jax", cpu)


def configure(directory: str | None) -> str | None:
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  if directory == "":
    return None
  import jax
  path = os.path.expanduser(directory) if directory else default_directory()
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  return path
