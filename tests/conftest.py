"""Test set-up: 8 fake CPU devices, set before jax is first imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# CPU unless asked to test the accelerator (launch/device_check.sh sets PHASESERVE_TEST_ACCELERATOR=1).
if os.environ.get("PHASESERVE_TEST_ACCELERATOR") != "1":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A fixed CPU lowering policy (models.cpu_lowering.DEFAULT) for every test and the CLIs they start:
# deterministic, and no start-up measurement on a loaded CI machine; tests/test_cpu_lowering.py
# exercises the measurement itself.
os.environ.setdefault("PHASESERVE_CPU_AUTOTUNE", "0")


import gc  # noqa: E402

import pytest  # noqa: E402


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
