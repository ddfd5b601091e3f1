"""models.text.tokenizer: byte tokenizer, streaming decode, a Hugging Face tokenizer.json, errors."""

import json

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from models.config import get_preset
from models.text.tokenizer import (ByteTokenizer, HFTokenizer, StreamDecoder, Tokenizer,
                              load_tokenizer, stream_decode)

TEXTS = ["hello world", "naïve café, 日本語 and emoji 🙂👍🏽!", "", "tabs\tand\nnewlines"]
CORPUS = ["the quick brown fox jumps over the lazy dog",
          "hello world, hello tokenizer",
          "naïve café serves crème brûlée",
          "日本語のテキスト and 🙂 emoji"]


def test_byte_round_trip():
  tok = load_tokenizer("tiny")
  assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
  assert tok.vocab_size == get_preset("tiny").vocab_size
  for text in TEXTS:
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
  assert len(tok.encode("🙂")) == 4 and len(tok.encode("é")) == 2


def test_byte_decode_ignores_specials_and_bad_utf8():
  tok = ByteTokenizer()
  ids = [tok.bos_id, *tok.encode("ok"), tok.pad_id, tok.eos_id, 5000]
  assert tok.decode(ids) == "ok"
  assert tok.decode([0xFF, ord("a")]) == "\ufffda"
  assert tok.decode(tok.encode("🙂")[:2]) == "\ufffd"
  assert isinstance(load_tokenizer("small"), ByteTokenizer)  # 32000-id vocab, first 259 used


def test_stream_decode_waits_for_whole_characters():
  tok = ByteTokenizer()
  ids = tok.encode("a🙂é")
  dec = StreamDecoder(tok)
  outs = [dec.push(i) for i in ids]
  assert outs == ["a", "", "", "", "🙂", "", "é"]
  assert dec.flush() == ""
  # Specials produce nothing; a truncated character is flushed as U+FFFD.
  assert dec.push(tok.bos_id) == "" and dec.push(ids[1]) == "" and dec.push(tok.eos_id) == ""
  assert dec.flush() == "\ufffd"
  # Invalid bytes do not stall the stream forever.
  assert [dec.push(0xFF) for _ in range(4)] == ["", "", "", "\ufffd" * 4]
  assert dec.push(0xFF) == "" and dec.flush() == "\ufffd"
  for text in TEXTS:
    chunks = list(stream_decode(tok, tok.encode(text)))
    assert "".join(chunks) == text and "\ufffd" not in "".join(chunks)


def _train(tmp_path, post_processor=True):
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  if post_processor:
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tok.token_to_id("<s>"))])
  tmp_path.mkdir(parents=True, exist_ok=True)
  tok.save(str(tmp_path / "tokenizer.json"))
  return tok


def test_hf_tokenizer_round_trip(tmp_path):
  raw = _train(tmp_path)
  tok = load_tokenizer(tmp_path)
  assert isinstance(tok, HFTokenizer)
  assert tok.vocab_size == raw.get_vocab_size()
  # No configs: eos by well-known name, bos because the post-processor prepends <s>.
  assert tok.eos_id == raw.token_to_id("</s>") and tok.bos_id == raw.token_to_id("<s>")
  for text in TEXTS + CORPUS:
    ids = tok.encode(text)
    assert tok.bos_id not in ids  # encode never adds specials
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text
    assert "".join(stream_decode(tok, ids)) == text
  # Multi-byte characters split over byte-level tokens stream without U+FFFD.
  ids = tok.encode("🙂👍🏽")
  assert len(ids) > 2
  assert all("\ufffd" not in c for c in stream_decode(tok, ids))


def test_hf_ids_from_configs(tmp_path):
  raw = _train(tmp_path)
  pad = raw.token_to_id("<pad>")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": {"content": "<pad>"}, "bos_token": "<s>", "add_bos_token": False}))
  tok = HFTokenizer(tmp_path / "tokenizer.json")
  assert tok.eos_id == pad and tok.bos_id is None  # add_bos_token: false wins
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 0}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, pad]}))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
  tok = load_tokenizer(tmp_path / "tokenizer.json")
  assert tok.eos_ids == (1, pad) and tok.eos_id == 1 and tok.bos_id == 0


def test_hf_without_bos(tmp_path):
  _train(tmp_path, post_processor=False)
  assert load_tokenizer(tmp_path).bos_id is None


def test_errors(tmp_path):
  with pytest.raises(ValueError, match="neither a model preset"):
    load_tokenizer("no-such-preset")
  with pytest.raises(ValueError, match="no tokenizer.json"):
    load_tokenizer(tmp_path)
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="cannot load tokenizer"):
    load_tokenizer(tmp_path)
  tok = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
  tok.save(str(tmp_path / "tokenizer.json"))
  with pytest.raises(ValueError, match="no eos token"):
    load_tokenizer(tmp_path)
