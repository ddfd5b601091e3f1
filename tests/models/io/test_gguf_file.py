"""``models.io.gguf_file.GGUFFile`` against ``gguf.GGUFReader`` (the reference parser) on a file
written here with every value type, empty and nested arrays and plain and quantized tensors, and on
SmolLM2's own file; bad files are ValueErrors."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from models.io.gguf_file import GGUFFile
from models.io.gguf_import import installed_smollm2_path


def _same(path) -> GGUFFile:
  ours, ref = GGUFFile(path), gguf.GGUFReader(path)
  assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
  for key, field in ours.fields.items():
    assert field.types == ref.fields[key].types, key
    assert field.contents() == ref.fields[key].contents(), key
  assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
  for a, b in zip(ours.tensors, ref.tensors):
    assert (a.tensor_type, a.shape.tolist(), a.n_elements) == (b.tensor_type, b.shape.tolist(),
                                                               b.n_elements)
    assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
    np.testing.assert_array_equal(a.data, b.data)
  return ours


def _write(path, alignment=None):
  w = gguf.GGUFWriter(path, "llama")
  if alignment:
    w.add_custom_alignment(alignment)
  w.add_uint8("t.u8", 200); w.add_int8("t.i8", -5); w.add_uint16("t.u16", 60000)
  w.add_int16("t.i16", -300); w.add_uint32("t.u32", 4_000_000_000); w.add_int32("t.i32", -7)
  w.add_float32("t.f32", 1e-5); w.add_uint64("t.u64", 2**40); w.add_int64("t.i64", -2**40)
  w.add_float64("t.f64", 0.1); w.add_bool("t.bool", True); w.add_string("t.str", "héllo")
  w.add_array("t.strings", ["a", "", "ü", "long " * 20]); w.add_array("t.ints", [1, -2, 3])
  w.add_array("t.floats", [0.5, 1.5]); w.add_array("t.bools", [True, False, True])
  rng = np.random.default_rng(0)
  w.add_tensor("plain", rng.standard_normal((3, 64)).astype(np.float32))
  w.add_tensor("half", rng.standard_normal((2, 32)).astype(np.float16))
  q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
  w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind_as_the_reference_reads_them(tmp_path, alignment):
  path = tmp_path / "t.gguf"
  _write(path, alignment)
  f = _same(path)
  assert f.get_field("t.bools").contents() == [True, False, True]
  assert f.get_field("missing") is None and f.path == str(path)


def test_an_empty_array_has_no_element_type(tmp_path):
  """Written by hand (GGUFWriter refuses empty arrays): header, one key, no tensor."""
  key = b"t.empty"
  path = tmp_path / "e.gguf"
  path.write_bytes(struct.pack("<IIQQ", 0x46554747, 3, 0, 1) + struct.pack("<Q", len(key)) + key
                   + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32, 0))
  f = _same(path)
  assert f.get_field("t.empty").types == [gguf.GGUFValueType.ARRAY]
  assert f.get_field("t.empty").contents() == [] and f.tensors == []


def test_smollm2_file_as_the_reference_reads_it():
  f = _same(installed_smollm2_path())
  assert len(f.get_field("tokenizer.ggml.tokens").contents()) == 49152


def test_bad_files_are_value_errors(tmp_path):
  path = tmp_path / "t.gguf"
  _write(path)
  blob = path.read_bytes()
  for name, data in [("magic", b"GGUX" + blob[4:]), ("version", blob[:4] + b"\x09" + blob[5:]),
                     ("header", blob[:300]), ("data", blob[:-200])]:
    bad = tmp_path / f"{name}.gguf"
    bad.write_bytes(data)
    with pytest.raises(ValueError):
      GGUFFile(bad)
