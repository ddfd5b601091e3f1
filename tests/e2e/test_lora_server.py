"""Multi-LoRA through launch.server as a real process (the tiny chat model of
tests/e2e/http_harness.py, two adapters given by ``--lora_modules``): the ``openai`` client
selects an adapter by ``model`` (as with vLLM), ``/v1/models`` lists the adapters, JetStream's
``lora_adapter_id`` and phaseserve's ``lora_adapter`` run the same adapter to the same ids, an
unknown adapter is a 404 / NOT_FOUND naming it, and an admin key loads and unloads adapters at
run time (another key gets a 403). Numerics: tests/models/test_lora.py (against peft) and
tests/serving/test_lora_engine.py (mixed batches)."""

from __future__ import annotations

import grpc
import pytest

from launch.lab.make_adapters import write_peft_adapter
from models.config import get_preset
from serving.api.proto.jetstream import jetstream_pb2 as js
from serving.api.proto.jetstream import jetstream_pb2_grpc as js_grpc
from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
from tests.e2e import http_harness as harness
from tests.e2e.http_harness import KEY, MODEL, request

pytestmark = pytest.mark.timeout(300)

ADMIN = "sk-admin"
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
CFG = get_preset("tiny")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
  root = tmp_path_factory.mktemp("adapters")
  return {name: str(write_peft_adapter(root / name, CFG, rank=rank, seed=seed, strength=1.0))
          for name, rank, seed in (("ad0", 8, 0), ("ad1", 16, 1), ("late", 8, 2))}


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapters):
  d = tmp_path_factory.mktemp("model") / "ckpt"
  harness.write_model(d)
  with harness.served(tmp_path_factory.mktemp("http"), "--model", str(d), "--max_context",
                      "128", "--max_slots", "8", "--kv_pages", "64", "--page_size", "16",
                      "--max_chunk", "32", "--lora_modules",
                      f"ad0={adapters['ad0']} ad1={adapters['ad1']}", "--lora_admin",
                      keys={ADMIN: {"name": "ops", "admin": True}}) as s:
    yield s


def _ids(server, model: str, prompt=PROMPT) -> list[int]:
  client = harness.client(server)
  out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                  logprobs=0, extra_body={"ignore_eos": True,
                                                          "return_tokens_as_token_ids": True})
  assert out.model == model
  return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def test_models_list_the_adapters(server, adapters):
  models = {m.id: m for m in harness.client(server).models.list().data}
  assert set(models) == {MODEL, "ad0", "ad1"}
  status, _, card = request(server, "GET", "/v1/models/ad1")
  assert status == 200 and card["parent"] == MODEL and card["root"] == adapters["ad1"]


def test_the_model_field_selects_the_adapter_and_every_api_agrees(server):
  base, a0, a1 = _ids(server, MODEL), _ids(server, "ad0"), _ids(server, "ad1")
  assert len({tuple(base), tuple(a0), tuple(a1)}) == 3  # the adapters change the output
  assert _ids(server, "ad0") == a0
  with server.channel() as ch:
    got = [t for r in js_grpc.OrchestratorStub(ch).Decode(js.DecodeRequest(
        token_content=js.DecodeRequest.TokenContent(token_ids=PROMPT), max_tokens=8,
        has_bos=True, lora_adapter_id="ad1"), timeout=60, metadata=AUTH)
        for t in r.stream_content.samples[0].token_ids]
    assert got == a1
    outs = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT), max_tokens=8, ignore_eos=True,
        sampling=pb.Sampling(temperature=0), lora_adapter="ad0"), timeout=60, metadata=AUTH))
    assert [t for o in outs for t in o.token_ids] == a0
    with pytest.raises(grpc.RpcError) as e:
      list(js_grpc.OrchestratorStub(ch).Decode(js.DecodeRequest(
          token_content=js.DecodeRequest.TokenContent(token_ids=PROMPT), max_tokens=4,
          lora_adapter_id="nope"), timeout=60, metadata=AUTH))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details()


def test_an_unknown_model_is_a_404_naming_the_adapters(server):
  import openai
  with pytest.raises(openai.NotFoundError) as e:
    harness.client(server).completions.create(model="nope", prompt="hi", max_tokens=2)
  assert "'nope'" in str(e.value) and "ad0, ad1" in str(e.value)


def test_adapters_load_and_unload_at_run_time_for_admin_keys_only(server, adapters):
  body = {"lora_name": "late", "lora_path": adapters["late"]}
  status, _, out = request(server, "POST", "/v1/load_lora_adapter", body)
  assert status == 403 and out["error"]["type"] == "permission_error"
  status, _, out = request(server, "POST", "/v1/load_lora_adapter", body, key=ADMIN)
  assert status == 200 and "late" in out
  status, _, out = request(server, "POST", "/v1/load_lora_adapter", body, key=ADMIN)
  assert status == 400 and "already" in out["error"]["message"]
  status, _, out = request(server, "POST", "/v1/load_lora_adapter",
                           {"lora_name": "bad", "lora_path": "/nonexistent"}, key=ADMIN)
  assert status == 400 and out["error"]["param"] == "lora_path"
  late = _ids(server, "late")
  assert late != _ids(server, MODEL)
  status, _, _ = request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "late"},
                         key=ADMIN)
  assert status == 200
  status, _, out = request(server, "POST", "/v1/completions",
                           {"model": "late", "prompt": "hi", "max_tokens": 2})
  assert status == 404 and out["error"]["code"] == "model_not_found"
  status, _, out = request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "late"},
                           key=ADMIN)
  assert status == 404
