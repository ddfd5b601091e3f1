"""models.smooth (SmoothQuant for W8A8) and its use by models.precision: the calibration forward
is the model's forward, smoothing keeps the float function and moves the outliers (a model with
planted outlier channels loses less to W8A8 once smoothed), and W8A8 keeps the unembedding
weight-only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import precision, smooth, weights
from models.config import get_preset
from models.quant import QuantArray
from models.transformer import forward

CFGS = {"tiny": get_preset("tiny"),
        "tied_gqa": get_preset("tiny").replace(vocab_size=320, tie_embeddings=True,
                                               num_heads=4, num_kv_heads=2),
        "parallel_plus_one": get_preset("tiny").replace(parallel_block=True, norm_plus_one=True,
                                                        activation="geglu")}


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _toks(cfg, b=2, t=40, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, cfg.vocab_size)


@pytest.mark.parametrize("name", sorted(CFGS))
def test_calibration_forward_is_the_models_forward(name):
  cfg = CFGS[name]
  params = weights.init_params(cfg, jax.random.key(0))
  toks = _toks(cfg)
  got, stats = smooth._calibration_forward(params, cfg, toks, jnp.ones(toks.shape, bool))
  assert _rel(got, forward(params, toks, cfg=cfg)) < 1e-5
  assert stats["o_in"].shape == (cfg.num_layers, cfg.num_heads, cfg.head_dim)
  assert stats["down_in"].shape == (cfg.num_layers, cfg.mlp_dim)


@pytest.mark.parametrize("name", sorted(CFGS))
def test_smoothing_keeps_the_float_function(name):
  cfg = CFGS[name]
  params = weights.init_params(cfg, jax.random.key(0))
  toks = _toks(cfg)
  smoothed = smooth.smooth_for_w8a8(params, cfg, np.asarray(toks[0]).tolist())
  # The weights moved (the test can fail) and the logits did not.
  assert _rel(smoothed["layers"][0]["q"], params["layers"][0]["q"]) > 0.05
  assert _rel(smoothed["layers"][1]["down"], params["layers"][1]["down"]) > 0.05
  assert _rel(forward(smoothed, toks, cfg=cfg), forward(params, toks, cfg=cfg)) < 1e-5


def test_stacked_layers_smooth_alike():
  cfg = CFGS["tiny"]
  params = weights.init_params(cfg, jax.random.key(0))
  toks = np.asarray(_toks(cfg)[0]).tolist()
  flat = smooth.smooth_for_w8a8(params, cfg, toks)
  stacked = smooth.smooth_for_w8a8(weights.stack_layers(params), cfg, toks)
  np.testing.assert_allclose(np.asarray(stacked["layers"]["up"][1]),
                             np.asarray(flat["layers"][1]["up"]), rtol=1e-6)


def _kl(ref, got) -> float:
  p, q = jax.nn.log_softmax(ref, -1), jax.nn.log_softmax(got, -1)
  return float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), -1)))


def test_smoothing_cuts_w8a8_loss_on_outlier_channels():
  """Trained transformers carry a few activation channels tens of times larger than the rest;
  planted here in each norm (and so in every layer's q / k / v and gate / up inputs), per-token
  int8 activations lose the other channels, and smoothing gives most of it back."""
  cfg = get_preset("tiny").replace(vocab_size=512, embed_dim=128, mlp_dim=384)
  params = weights.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  for layer in params["layers"]:
    for norm in ("attn_norm", "mlp_norm"):
      boost = np.ones(cfg.embed_dim, np.float32)
      boost[rng.choice(cfg.embed_dim, 3, replace=False)] = 40.0
      layer[norm] = layer[norm] * boost
  calib, test = _toks(cfg, 1, 64, seed=2), _toks(cfg, 4, 48, seed=3)
  ref = forward(params, test, cfg=cfg)
  plain = precision.apply(params, cfg, "int8", "w8a8")
  smoothed = precision.apply(params, cfg, "int8", "w8a8",
                             calibration=np.asarray(calib[0]).tolist())
  kl_plain = _kl(ref, forward(plain, test, cfg=cfg))
  kl_smoothed = _kl(ref, forward(smoothed, test, cfg=cfg))
  assert kl_smoothed < 0.5 * kl_plain, (kl_smoothed, kl_plain)


def test_w8a8_keeps_the_unembedding_weight_only():
  cfg = CFGS["tied_gqa"]
  params = weights.init_params(cfg, jax.random.key(0))
  q = precision.apply(params, cfg, "int8", "w8a8", calibration=list(range(2, 40)))
  assert precision.int8_mode_of(q) == "w8a8"
  assert isinstance(q["embed"], QuantArray) and not q["embed"].act_quant
  assert all(w.act_quant for w in jax.tree.leaves(q["layers"],
                                                  is_leaf=lambda x: isinstance(x, QuantArray))
             if isinstance(w, QuantArray))
  assert not any(w.act_quant for w in jax.tree.leaves(
      precision.set_int8_mode(q, "weight_only"), is_leaf=lambda x: isinstance(x, QuantArray))
      if isinstance(w, QuantArray))


def test_calibration_text_ships_with_the_package():
  text = precision.calibration_text()
  assert len(text) > 1000 and "def moving_average" in text


def test_smoothed_leaves_keep_their_placement():
  cfg = CFGS["tiny"]
  params = weights.init_params(cfg, jax.random.key(0))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
  params["layers"][0]["gate"] = jax.device_put(params["layers"][0]["gate"], spec)
  smoothed = smooth.smooth_for_w8a8(params, cfg, list(range(2, 40)))
  assert smoothed["layers"][0]["gate"].sharding == spec
  assert smoothed["layers"][0]["up"].dtype == params["layers"][0]["up"].dtype


def test_load_model_smooths_w8a8_on_the_calibration_text():
  from models.io.loader import load_model
  cfg, plain, _ = load_model("tiny", quantize="int8")  # weight-only: quantized as loaded
  _, w8a8, _ = load_model("tiny", quantize="int8", int8_mode="w8a8")
  assert precision.int8_mode_of(plain) == "weight_only"
  assert precision.int8_mode_of(w8a8) == "w8a8" and not w8a8["unembed"].act_quant
  # Smoothed before quantizing: the layers' int8 values and scales moved, the table did not.
  assert not np.array_equal(np.asarray(w8a8["layers"][0]["q"].scale),
                            np.asarray(plain["layers"][0]["q"].scale))
  np.testing.assert_array_equal(np.asarray(w8a8["unembed"].quant),
                                np.asarray(plain["unembed"].quant))
