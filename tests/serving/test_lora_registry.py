"""serving.lora's host bookkeeping: the registry (names, uids, rank limit, host LRU re-reads, an
unload while a request holds the adapter), the device slots (pinned while used, least recently
used given over, none while every slot is held), ``build_registry``'s automatic sizes, and the
``--lora_modules`` parser."""

from __future__ import annotations

import numpy as np
import pytest

from launch.lab.make_adapters import write_peft_adapter
from models.config import get_preset
from serving.lora import (LoraConfig, LoraLoad, LoraRegistry, LoraSlots, build_registry,
                          parse_modules)

CFG = get_preset("tiny")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
  root = tmp_path_factory.mktemp("ad")
  return {n: str(write_peft_adapter(root / n, CFG, rank=r, seed=i))
          for i, (n, r) in enumerate((("a", 8), ("b", 16), ("c", 4), ("big", 32)))}


def test_registry_names_uids_ranks_and_host_lru(paths):
  reg = LoraRegistry(CFG, max_rank=16, max_cpu_loras=2)
  a, b, c = (reg.load(n, paths[n]) for n in "abc")
  assert [r.name for r in reg.names()] == ["a", "b", "c"] and len({a.uid, b.uid, c.uid}) == 3
  assert reg.listing()[1] == (b, paths["b"])
  assert reg.slot_rank == 16 and reg.host_adapters == 2  # a's arrays dropped
  wa, _ = reg.weights(a.uid)  # read again from its files
  assert wa["q"].shape == (CFG.num_layers, CFG.embed_dim, 16) and not wa["q"][..., 8:].any()
  with pytest.raises(ValueError, match="rank 32, above --max_lora_rank 16"):
    reg.load("big", paths["big"])
  with pytest.raises(KeyError, match="already loaded"):
    reg.load("a", paths["a"])
  assert reg.unload("a") == a
  with pytest.raises(LookupError, match=r"unknown LoRA adapter 'a' \(loaded: b, c\)"):
    reg.resolve("a")
  reg.load("c2", paths["c"]), reg.load("b2", paths["b"])  # a's arrays leave host memory
  got, _ = reg.weights(a.uid)  # a request admitted before the unload still gets it
  np.testing.assert_array_equal(got["q"], wa["q"])
  again = reg.load("a", paths["a"])
  assert again.uid != a.uid  # a new adapter: its KV is never the old one's


def test_slots_pin_lru_and_refuse_when_all_are_held():
  slots = LoraSlots(2)
  refs = [type("R", (), {"uid": u})() for u in (1, 2, 3)]
  s1, s2 = slots.acquire(refs[0]), slots.acquire(refs[1])
  assert {s1, s2} == {0, 1} and slots.take_loads() == (LoraLoad(s1, 1), LoraLoad(s2, 2))
  assert slots.acquire(refs[2]) is None  # both held
  assert slots.acquire(refs[0]) == s1 and slots.take_loads() == ()  # resident: no load
  slots.release(s1), slots.release(s1)
  assert slots.acquire(refs[2]) == s1 and slots.take_loads() == (LoraLoad(s1, 3),)
  slots.release(s2)
  with pytest.raises(ValueError, match="which no sequence holds"):
    slots.release(s2)
  assert slots.held == 1 and slots.loads == 3


def test_build_registry_sizes_and_errors(paths):
  assert build_registry(CFG, LoraConfig()) == (None, 0)
  reg, n = build_registry(CFG, LoraConfig((("a", paths["a"]), ("b", paths["b"]))))
  assert n == 2 and reg.max_rank == 16 and reg.max_cpu_loras == 2
  reg, n = build_registry(CFG, LoraConfig(max_loras=3))  # run-time adapters only
  assert n == 3 and reg.max_rank == 16 and reg.names() == []
  with pytest.raises(ValueError, match="--lora_modules x=/nonexistent"):
    build_registry(CFG, LoraConfig((("x", "/nonexistent"),), max_rank=8))


def test_lora_modules_flag_parses_vllm_style():
  assert parse_modules(["a=/p/a b=/p/b", "c=/p/c,d=/p/d"]) == (
      ("a", "/p/a"), ("b", "/p/b"), ("c", "/p/c"), ("d", "/p/d"))
  with pytest.raises(ValueError, match="is not name=path"):
    parse_modules(["a"])
  with pytest.raises(ValueError, match="given twice"):
    parse_modules(["a=/x", "a=/y"])
