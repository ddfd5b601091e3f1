"""launch.compile_cache: where the serving CLIs keep JAX's persistent compilation cache."""

import os

import jax
import pytest

from launch import compile_cache
from models.cpu import cpuinfo


@pytest.fixture
def no_env(monkeypatch, tmp_path):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path))
  before = jax.config.jax_compilation_cache_dir
  yield tmp_path
  jax.config.update("jax_compilation_cache_dir", before)


def test_environment_wins(monkeypatch, tmp_path):
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  before = jax.config.jax_compilation_cache_dir
  assert compile_cache.configure(str(tmp_path / "flag")) == str(tmp_path / "env")
  assert jax.config.jax_compilation_cache_dir == before  # JAX reads the variable itself
  assert not (tmp_path / "flag").exists()


def test_empty_turns_it_off(no_env):
  before = jax.config.jax_compilation_cache_dir
  assert compile_cache.configure("") is None
  assert jax.config.jax_compilation_cache_dir == before


def test_default_is_per_cpu_under_the_cache_dir(no_env, monkeypatch):
  path = compile_cache.configure(None)
  assert os.path.dirname(path) == os.path.join(str(no_env), "jax")
  assert os.path.isdir(path) and jax.config.jax_compilation_cache_dir == path
  # Another CPU model (say an AMX Xeon after an EPYC) gets another directory.
  monkeypatch.setattr(cpuinfo, "key", lambda: "Intel(R) Xeon(R) (amx_int8)")
  assert compile_cache.default_directory() != path


def test_explicit_directory(no_env):
  target = no_env / "mine"
  assert compile_cache.configure(str(target)) == str(target)
  assert target.is_dir() and jax.config.jax_compilation_cache_dir == str(target)
