"""Test set-up: 8 fake CPU devices, set before jax is first imported."""

import os

# LLVM's optimization level 0 for the programs the tests compile (XLA's HLO passes, hence the
# numerics, are unchanged; the tests are compile-bound: the sharded engine tests take 24% less
# CPU). Set the flag yourself to test another level. The servers and CLIs the tests start get
# the same level with flags of their own (tests/cli_env.py), not the 8 fake devices.
_xla = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _xla:
  _xla += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_xla + " --xla_force_host_platform_device_count=8").strip()
# CPU unless asked to test the accelerator (launch/device_check.sh sets PHASESERVE_TEST_ACCELERATOR=1).
if os.environ.get("PHASESERVE_TEST_ACCELERATOR") != "1":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLIs the tests start resolve their CPU backend with the fixed lowering policy
# (models.cpu.lowering.DEFAULT): deterministic, and no start-up measurement on a loaded CI machine;
# tests/models/cpu/test_cpu_lowering.py exercises the measurement itself. Library calls in tests
# take a backend value (tests/cpu_policies.py), never this switch.
os.environ.setdefault("PHASESERVE_CPU_AUTOTUNE", "0")


import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402


_OWN_CACHE: list[str] = []


def pytest_configure(config):
  """JAX's persistent compilation cache, shared by this process and every server / CLI the tests
  start (they inherit the environment): the many tiny servers compile the same programs (the
  service tests' four servers: 174 s -> 129 s, measured). Keyed by the program, XLA flags, jax
  version and backend, so a hit is the same executable. A fresh directory per session, removed at
  the end; set JAX_COMPILATION_CACHE_DIR to keep one across runs."""
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    path = tempfile.mkdtemp(prefix="phaseserve-jax-cache-")
    _OWN_CACHE.append(path)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  # No installed cost-model calibration (``partitioning.calibration.resolve("auto", ...)``) of
  # the user's leaks into the planner's choices under test: an empty directory of our own.
  calibrations = tempfile.mkdtemp(prefix="phaseserve-calibrations-")
  _OWN_CACHE.append(calibrations)
  os.environ["PHASESERVE_CALIBRATION_DIR"] = calibrations
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_unconfigure(config):
  for path in _OWN_CACHE:
    shutil.rmtree(path, ignore_errors=True)


MAX_MAPS = 30_000  # half the kernel's default vm.max_map_count (65,530)


def _maps() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's compiled programs after a test module when the process holds many memory
  mappings. Every XLA:CPU executable keeps its own; one pytest process compiling every module's
  programs passed the kernel's vm.max_map_count (65,530) and XLA segfaulted while compiling
  (measured: 26,000 maps after three modules, 719 with the caches dropped). Dropping only above
  ``MAX_MAPS`` keeps most programs that later modules share."""
  yield
  if _maps() > MAX_MAPS:
    import jax
    jax.clear_caches()
    gc.collect()


# The heaviest modules' seconds of CPU in a suite run (AMD EPYC Zen 4, 2 workers, 2026-12-06;
# `--durations`), run first: with `--dist loadfile --no-loadscope-reorder` (Makefile) xdist hands
# out modules in collection order, so the long ones start early and the two workers finish
# together (xdist's own order, most tests first, left a long module to run alone at the end).
_HEAVY_S = {
    "tests/partitioning/test_paged_layouts.py": 271, "tests/e2e/test_multihost.py": 120,
    "tests/serving/test_spec_real_model.py": 114, "tests/models/io/test_smollm2_reference.py": 113,
    "tests/launch/lab/test_soak.py": 71, "tests/launch/lab/test_quality.py": 69,
    "tests/launch/test_generate_cli.py": 62, "tests/partitioning/test_layouts.py": 60,
    "tests/launch/test_serve_offline.py": 50, "tests/launch/lab/test_loadgen.py": 46,
    "tests/e2e/test_real_model_tools.py": 46, "tests/serving/test_engine.py": 45,
    "tests/e2e/test_program_set.py": 44, "tests/e2e/test_openai_surface.py": 43,
    "tests/models/cpu/test_cpu_lowering.py": 40, "tests/serving/test_draft_model.py": 35,
    "tests/e2e/test_grpc_server.py": 33, "tests/launch/lab/test_sweep_partitioning.py": 32,
    "tests/models/test_scan_layers.py": 32, "tests/launch/lab/test_bench_spec.py": 31,
    "tests/e2e/test_grpc_lifecycle.py": 29, "tests/serving/test_prefix_cache.py": 29,
    "tests/launch/lab/test_bench_engine.py": 28, "tests/e2e/test_http_server.py": 27,
    "tests/test_types.py": 27, "tests/serving/test_lora_engine.py": 27,
}


def pytest_collection_modifyitems(config, items):
  """Heaviest modules first (a stable sort: each module's own order is kept)."""
  items.sort(key=lambda item: -_HEAVY_S.get(item.nodeid.split("::")[0], 0))
