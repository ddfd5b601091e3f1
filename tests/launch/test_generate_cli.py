"""launch.generate end to end (subprocess): greedy tokens match a reference decode, seeds are
deterministic, streaming prints text, --chat renders the model's chat template, and bad flags exit
2 with one line and no traceback. ``build_prompt`` is also tested in-process."""

from tests import paths
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from models.config import get_preset
from models import transformer as T
from models.weights import init_params
from tests.cli_env import CLI_XLA_FLAGS

ROOT = str(paths.REPO)


def _run(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  return subprocess.run([sys.executable, "-m", "launch.generate", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _json(*args):
  r = _run(*args, "--json")
  assert r.returncode == 0, r.stderr
  return json.loads(r.stdout.strip().splitlines()[-1])


_forward = jax.jit(T.forward, static_argnames="cfg")  # one program per padded width, all calls


def _reference_greedy(prompt, n, valid_vocab=None):
  """Greedy ids from the uncached causal forward, over ids < valid_vocab (the tokenizer's ids).
  The sequence is zero-padded to one length (one compiled program): causal attention keeps the
  padding out of the logits at position len - 1."""
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0))
  width = T.bucket(len(prompt) + n)
  toks = list(prompt)
  for _ in range(n):
    logits = _forward(params, jnp.asarray([toks + [0] * (width - len(toks))]), cfg=cfg)
    toks.append(int(jnp.argmax(logits[0, len(toks) - 1, :valid_vocab])))
  return toks[len(prompt):]


def test_greedy_matches_reference_and_reports_timings():
  out = _json("--model", "tiny", "--prompt_ids", "5,6,7,8", "--max_tokens", "12",
              "--ignore_eos", "--steps_per_call", "4")
  assert out["token_ids"] == _reference_greedy([5, 6, 7, 8], 12)
  assert out["ttft_ms"] > 0 and out["tpot_ms"] > 0
  assert isinstance(out["text"], str)


@pytest.mark.slow  # suite time: per-seed determinism is also checked in-process (test_engine, test_generator)
def test_sampling_is_deterministic_per_seed():
  args = ("--model", "tiny", "--prompt", "hello", "--max_tokens", "16", "--temperature", "1.0",
          "--top_k", "50", "--top_p", "0.95", "--ignore_eos")
  a, b = _json(*args, "--seed", "1"), _json(*args, "--seed", "1")
  c = _json(*args, "--seed", "2")
  assert a["token_ids"] == b["token_ids"]
  assert a["token_ids"] != c["token_ids"]


def test_int8_and_bfloat16_run():
  out = _json("--model", "tiny", "--prompt", "hi", "--max_tokens", "4", "--quantize", "int8",
              "--dtype", "bfloat16", "--ignore_eos")
  assert len(out["token_ids"]) == 4


def test_streaming_text_mode():
  r = _run("--model", "tiny", "--prompt", "hi", "--max_tokens", "8", "--ignore_eos")
  assert r.returncode == 0, r.stderr
  assert r.stdout.endswith("\n")


@pytest.mark.parametrize("args,needle", [
    (("--model", "nonesuch", "--prompt", "x"), "neither a preset"),
    (("--model", "/no/such/dir", "--prompt", "x"), "neither a preset"),
    (("--model", "tiny", "--prompt", "x" * 300), "exceeds the model context"),
    (("--model", "tiny", "--prompt_ids", "1,a"), "comma-separated"),
    (("--model", "tiny", "--prompt_ids", "1,99999"), "[0, 259)"),
    (("--model", "tiny"), "exactly one of"),
    (("--model", "tiny", "--prompt", "x", "--chat", "y"), "exactly one of"),
    (("--model", "tiny", "--prompt_ids", "1", "--chat", "y"), "exactly one of"),
    (("--model", "tiny", "--prompt", "x", "--top_p", "0"), "top_p"),
    (("--model", "tiny", "--prompt", "x", "--no_such_flag"), "no_such_flag"),
    (("--model", "tiny", "--prompt", "x", "--max_tokens", "0"), "max_tokens"),
    (("--model", "tiny", "--prompt", "x", "--seed", "4294967296"), "seed"),
])
def test_bad_flags_exit_2_with_one_line(args, needle):
  r = _run(*args, timeout=120)
  assert r.returncode == 2, (r.returncode, r.stderr)
  assert "Traceback" not in r.stderr
  lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
  assert len(lines) == 1 and needle in lines[0], r.stderr


def test_checkpoint_directory_gives_same_tokens_as_preset(tmp_path):
  from models.io.checkpoint import save_params
  cfg = get_preset("tiny")
  save_params(str(tmp_path / "ckpt"), init_params(cfg, jax.random.key(0)), cfg)
  args = ("--prompt_ids", "5,6,7,8", "--max_tokens", "6", "--ignore_eos")
  from_ckpt = _json("--model", str(tmp_path / "ckpt"), *args)
  assert from_ckpt["token_ids"] == _reference_greedy([5, 6, 7, 8], 6)


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def _chat_tokenizer(directory):
  """A small (< 259 ids, fits the tiny preset) BPE tokenizer.json with a ChatML-like template."""
  import tokenizers
  from tokenizers import models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.BpeTrainer(vocab_size=120, show_progress=False,
                                special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"])
  tok.train_from_iterator(["hello there user assistant", "what is the capital of france"],
                          trainer)
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "add_bos_token": False}))


def test_chat_renders_the_template(tmp_path):
  from models.io.checkpoint import save_params
  from models.text.tokenizer import load_tokenizer
  cfg = get_preset("tiny")
  ckpt = tmp_path / "ckpt"
  save_params(str(ckpt), init_params(cfg, jax.random.key(0)), cfg)
  _chat_tokenizer(ckpt)
  tok = load_tokenizer(ckpt)
  want = tok.encode_chat([{"role": "user", "content": "hello there"}])
  assert want[0] == tok.encode("<|im_start|>")[0] and len(want) < 20
  out = _json("--model", str(ckpt), "--chat", "hello there", "--max_tokens", "5", "--ignore_eos")
  assert out["prompt_tokens"] == len(want)
  assert out["token_ids"] == _reference_greedy(want, 5, tok.vocab_size)


def test_build_prompt():
  from launch.cli import CliError
  from launch.generate import build_prompt
  from models.text.tokenizer import ByteTokenizer, TokenizersTokenizer
  import tokenizers
  from tokenizers import models
  byte = ByteTokenizer()
  assert build_prompt(byte, prompt="hi") == [byte.bos_id, *b"hi"]
  assert build_prompt(byte, prompt_ids=[5, 6]) == [5, 6]
  assert build_prompt(byte, chat="hi") == list(b"user: hi\nassistant: ")  # the default template
  with pytest.raises(CliError, match="exactly one of"):
    build_prompt(byte, prompt="a", chat="b")
  with pytest.raises(CliError, match="exactly one of"):
    build_prompt(byte)
  raw = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "hi": 2, "user": 3},
                                              unk_token="<unk>"))
  raw.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  raw.add_special_tokens(["<s>"])
  tok = TokenizersTokenizer(raw, bos_id=1, eos_ids=[0],
                            chat_template="{{ messages[0].role }} {{ messages[0].content }}")
  # --chat encodes the rendered text as is: the bos a --prompt gets is not prepended.
  assert build_prompt(tok, chat="hi") == [3, 2]
  assert build_prompt(tok, prompt="hi") == [1, 2]
  broken = TokenizersTokenizer(raw, bos_id=None, eos_ids=[0],
                               chat_template="{{ raise_exception('no chats here') }}")
  with pytest.raises(CliError, match="--chat: chat template raised an exception: no chats here"):
    build_prompt(broken, chat="hi")


@pytest.mark.slow  # suite time: int8 quality is gated in tests/launch/lab/test_quality.py
def test_make_run_chats_in_english_int8():
  """What `make run` does: SmolLM2-135M-Instruct, int8 (the default weight-only mode), a chat
  prompt streamed as text, TTFT and tokens/s on the last line."""
  r = _run("--model", "smollm2-135m", "--quantize", "int8", "--max_tokens", "16",
           "--chat", "What is the capital of France?")
  assert r.returncode == 0, r.stderr
  text, stats = r.stdout.rstrip("\n").rsplit("\n", 1)
  assert "Paris" in text, text
  assert "TTFT" in stats and "tok/s" in stats and "weight_only" in stats, stats
