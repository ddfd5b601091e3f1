"""Device meshes with the paper's three torus axes ``('x', 'y', 'z')``.

Contract:
  * ``factorize(n) -> (x, y, z)``: the most balanced factorisation of ``n`` chips with
    ``x <= y <= z`` (8 -> (2, 2, 2), 4 -> (1, 2, 2), 2 -> (1, 1, 2), 12 -> (2, 2, 3)). ``x`` is the
    smallest axis because the 2D layouts put ``embed`` on x and ``mlp`` on yz, and the paper's
    optimum is X = sqrt(n * E / F) < sqrt(n) for F > E.
  * ``make_mesh(devices=None, shape=None) -> Mesh`` over all of ``devices`` (default: every
    device), axes ``MESH_AXES``, axis types ``Auto`` (shardings are placements, not types). A
    given ``shape`` must be three positive ints whose product is the device count, else
    ``ValueError``. With ``devices=None`` the device order comes from ``jax.make_mesh``
    (topology-aware rings on TPU); explicit ``devices`` are used in the order given.
  * ``split_devices(devices, n_prefill) -> (prefill, decode)``: two disjoint, ordered device
    lists; ``make_submeshes(devices, n_prefill, ...)`` builds one mesh on each (disaggregated
    prefill / decode: each phase runs its own layout on its own chips).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from partitioning.cost_model import MeshShape  # (x, y, z) chips: the cost model's, JAX-free

MESH_AXES: tuple[str, str, str] = ("x", "y", "z")


def _prime_factors(n: int) -> list[int]:
  out, p = [], 2
  while p * p <= n:
    while n % p == 0:
      out.append(p)
      n //= p
    p += 1
  if n > 1:
    out.append(n)
  return out


def factorize(n: int) -> MeshShape:
  """Balanced ``(x, y, z)`` with ``x * y * z == n`` and ``x <= y <= z``."""
  if n < 1:
    raise ValueError(f"device count must be >= 1, got {n}")
  dims = [1, 1, 1]
  for p in sorted(_prime_factors(n), reverse=True):  # largest first onto the smallest axis
    dims[dims.index(min(dims))] *= p
  x, y, z = sorted(dims)
  return (x, y, z)


def _check_shape(shape: Sequence[int], n: int) -> MeshShape:
  shape = tuple(shape)
  if len(shape) != 3 or any(not isinstance(s, (int, np.integer)) or s < 1 for s in shape):
    raise ValueError(f"mesh shape must be three positive ints (x, y, z), got {shape!r}")
  if math.prod(shape) != n:
    raise ValueError(f"mesh shape {shape} has {math.prod(shape)} chips but {n} devices are given")
  return (int(shape[0]), int(shape[1]), int(shape[2]))


def _auto_axis_types() -> dict:
  axis_type = getattr(jax.sharding, "AxisType", None)
  return {"axis_types": (axis_type.Auto,) * 3} if axis_type is not None else {}


def make_mesh(devices: Sequence[jax.Device] | None = None,
              shape: Sequence[int] | None = None) -> Mesh:
  """A ``('x', 'y', 'z')`` mesh over ``devices`` (default: all), shape validated or factorised."""
  explicit = devices is not None
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError("make_mesh needs at least one device")
  if len({d.id for d in devices}) != len(devices):
    raise ValueError("make_mesh: devices must be distinct")
  mesh_shape = factorize(len(devices)) if shape is None else _check_shape(shape, len(devices))
  if not explicit:
    try:
      return jax.make_mesh(mesh_shape, MESH_AXES, devices=devices, **_auto_axis_types())
    except (TypeError, ValueError, NotImplementedError):  # older jax / odd topologies
      pass
  return Mesh(np.asarray(devices, dtype=object).reshape(mesh_shape), MESH_AXES,
              **_auto_axis_types())


def mesh_shape(mesh: Mesh) -> MeshShape:
  """``(x, y, z)`` sizes of a mesh made by ``make_mesh``."""
  return (mesh.shape["x"], mesh.shape["y"], mesh.shape["z"])


def split_devices(devices: Sequence[jax.Device] | None, n_prefill: int
                  ) -> tuple[list[jax.Device], list[jax.Device]]:
  """First ``n_prefill`` devices for prefill, the rest for decode (both non-empty)."""
  devices = list(jax.devices() if devices is None else devices)
  if not 0 < n_prefill < len(devices):
    raise ValueError(f"n_prefill must be in [1, {len(devices) - 1}] for {len(devices)} devices, "
                     f"got {n_prefill}")
  return devices[:n_prefill], devices[n_prefill:]


def make_submeshes(devices: Sequence[jax.Device] | None, n_prefill: int,
                   prefill_shape: Sequence[int] | None = None,
                   decode_shape: Sequence[int] | None = None) -> tuple[Mesh, Mesh]:
  """(prefill mesh, decode mesh) on disjoint device subsets."""
  pre, dec = split_devices(devices, n_prefill)
  return make_mesh(pre, prefill_shape), make_mesh(dec, decode_shape)


__all__ = ["MESH_AXES", "MeshShape", "factorize", "make_mesh", "mesh_shape", "split_devices",
           "make_submeshes"]
