"""Meshes: factorisation, validation of user shapes, disjoint prefill/decode sub-meshes."""

import jax
import pytest

from partitioning.mesh import (MESH_AXES, factorize, make_mesh, make_submeshes, mesh_shape,
                               split_devices)


@pytest.mark.parametrize("n,shape", [(1, (1, 1, 1)), (2, (1, 1, 2)), (4, (1, 2, 2)),
                                     (8, (2, 2, 2)), (6, (1, 2, 3)), (12, (2, 2, 3)),
                                     (16, (2, 2, 4)), (64, (4, 4, 4)), (7, (1, 1, 7))])
def test_factorize(n, shape):
  assert factorize(n) == shape


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_make_mesh_over_device_subsets(n):
  devices = jax.devices()[:n]
  mesh = make_mesh(devices)
  assert mesh.axis_names == MESH_AXES
  assert mesh_shape(mesh) == factorize(n)
  assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]


def test_make_mesh_default_uses_every_device():
  mesh = make_mesh()
  assert mesh.size == len(jax.devices()) == 8
  assert mesh_shape(mesh) == (2, 2, 2)


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 4, 1), (1, 2, 4)])
def test_user_shape(shape):
  assert mesh_shape(make_mesh(shape=shape)) == shape


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 3), (0, 8, 1), (2, 2, 2, 1), (-2, -2, 2)])
def test_bad_user_shape(shape):
  with pytest.raises(ValueError):
    make_mesh(shape=shape)


def test_split_devices_and_submeshes_are_disjoint():
  pre, dec = split_devices(None, 4)
  assert len(pre) == len(dec) == 4 and not {d.id for d in pre} & {d.id for d in dec}
  m_pre, m_dec = make_submeshes(None, 2, decode_shape=(1, 2, 3))
  assert mesh_shape(m_pre) == (1, 1, 2) and mesh_shape(m_dec) == (1, 2, 3)
  assert not {d.id for d in m_pre.devices.flat} & {d.id for d in m_dec.devices.flat}
  for bad in (0, 8):
    with pytest.raises(ValueError):
      split_devices(None, bad)
  with pytest.raises(ValueError):
    make_mesh([jax.devices()[0]] * 2)
