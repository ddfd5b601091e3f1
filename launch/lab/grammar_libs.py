"""llguidance vs xgrammar on one tokenizer: init, compile, mask fill and advance times.

Contract: standalone (imports neither serving nor models) so it runs in a scratch venv holding
xgrammar, whose import needs torch (stub it: BUILD_NOTES "Grammar engine"). Input: a pickle of
{"tokens": [bytes per id], "eos": [ids], "json": tokenizers JSON} written by ``--dump`` from
the project venv. Output: one line per (library, schema) on stdout, and a JSON summary.

  .venv/bin/python -m launch.lab.grammar_libs --dump /tmp/smollm2.pkl
  .venv/bin/python -m launch.lab.grammar_libs --lib llguidance --vocab /tmp/smollm2.pkl
  PYTHONPATH=/tmp/xgstub /tmp/xgvenv/bin/python launch/lab/grammar_libs.py --lib xgrammar \
      --vocab /tmp/smollm2.pkl
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from typing import Any, Callable

import numpy as np

SCHEMAS: dict[str, Any] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                "price": {"type": "number"}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "gift": {"type": "boolean"}},
        "required": ["id", "status", "items"], "additionalProperties": False},
    "wide": {"type": "object", "properties": {
        f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(30)},
        "required": [f"field_{i}" for i in range(0, 30, 2)], "additionalProperties": False},
}
# A valid instance per schema: its tokens are the "realistic" walk (states inside strings etc.)
INSTANCES = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "order": {"id": "ABC-1234", "status": "paid", "items": [
        {"sku": "widget-blue", "qty": 2, "price": 9.5}, {"sku": "gadget", "qty": 1}],
        "gift": False},
    "wide": {f"field_{i}": ["text value", i * 7, i % 4 == 0][i % 3] for i in range(30)},
}


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  t = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t


class _Lib:
  """One library behind four calls: compile(schema), matcher(compiled), fill(m, row), accept."""

  def __init__(self, name: str, vocab: dict[str, Any]):
    self.name = name
    self.V = len(vocab["tokens"])
    self.eos = vocab["eos"]
    self.mask_W = np.zeros((1, (self.V + 31) // 32), np.int32)
    if name == "llguidance":
      import llguidance as llg
      import llguidance.numpy as lln
      self.llg, self.lln = llg, lln
      self.tok, self.init_s = _timed(lambda: llg.LLTokenizer(
          vocab["json"], n_vocab=self.V, eos_token=self.eos))
    else:
      import xgrammar as xgr
      self.xgr = xgr

      def build() -> Any:
        info = xgr.TokenizerInfo(vocab["tokens"], xgr.VocabType.RAW, vocab_size=self.V,
                                 stop_token_ids=self.eos)
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
      self.comp, self.init_s = _timed(build)

  def compile(self, schema: Any) -> Any:
    if self.name == "llguidance":
      grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
      err = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
      assert not err, err
      return grammar
    return self.comp.compile_json_schema(json.dumps(schema), any_whitespace=False)

  def matcher(self, compiled: Any) -> Any:
    if self.name == "llguidance":
      return self.llg.LLMatcher(self.tok, compiled, log_level=0)
    return self.xgr.GrammarMatcher(compiled)

  def fill(self, m: Any) -> None:
    if self.name == "llguidance":
      self.lln.fill_next_token_bitmask(m, self.mask_W, 0)
    else:
      m.fill_next_token_bitmask(self.mask_W, 0)

  def accept(self, m: Any, t: int) -> bool:
    return bool(m.consume_token(t) if self.name == "llguidance" else m.accept_token(t))


def _allowed(mask_W: np.ndarray, V: int) -> np.ndarray:
  bits = (mask_W[0].view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
  return np.flatnonzero(bits.reshape(-1)[:V])


def run(lib: _Lib, encode: Callable[[str], list[int]] | None, seed: int) -> list[dict[str, Any]]:
  rows = []
  for name, schema in SCHEMAS.items():
    compiled, compile_s = _timed(lambda: lib.compile(schema))
    m, matcher_s = _timed(lambda: lib.matcher(compiled))
    fills, accepts, first_fill = [], [], None
    rng = np.random.default_rng(seed)
    walk = encode(json.dumps(INSTANCES[name])) if encode else None
    for step in range(200):
      _, s = _timed(lambda: lib.fill(m))
      if first_fill is None:
        first_fill = s
      else:
        fills.append(s)
      allowed = _allowed(lib.mask_W, lib.V)
      if walk is not None:
        if step == len(walk):
          assert set(lib.eos) & set(allowed.tolist()), "eos not allowed at the end"
          break
        t = walk[step]
        assert t in set(allowed.tolist()), (name, step, t)
      else:
        t = int(rng.choice(allowed))
        if t in lib.eos:
          break
      ok, s = _timed(lambda: lib.accept(m, t))
      assert ok
      accepts.append(s)
    rows.append(dict(lib=lib.name, schema=name, walk="instance" if walk else "random",
                     compile_ms=1e3 * compile_s, matcher_ms=1e3 * matcher_s,
                     first_fill_ms=1e3 * (first_fill or 0.0), steps=len(accepts),
                     fill_ms_median=1e3 * statistics.median(fills),
                     fill_ms_p90=1e3 * float(np.percentile(fills, 90)),
                     fill_ms_max=1e3 * max(fills),
                     accept_ms_median=1e3 * statistics.median(accepts)))
  return rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dump", help="write the SmolLM2 tokenizer's vocab pickle here and exit")
  ap.add_argument("--lib", choices=("llguidance", "xgrammar"))
  ap.add_argument("--vocab")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  if args.dump:
    from models.io.gguf_import import installed_smollm2_path
    from models.text.gguf_tokenizer import load_gguf_tokenizer
    tok = load_gguf_tokenizer(installed_smollm2_path())
    with open(args.dump, "wb") as f:
      pickle.dump(dict(tokens=[tok.token_bytes(i) for i in range(tok.vocab_size)],
                       eos=list(tok.eos_ids), json=tok.backend.to_str()), f)
    return
  with open(args.vocab, "rb") as f:
    vocab = pickle.load(f)
  import tokenizers
  hf = tokenizers.Tokenizer.from_str(vocab["json"])
  lib = _Lib(args.lib, vocab)
  print(f"{lib.name}: init {1e3 * lib.init_s:.0f} ms (V={lib.V})")
  rows = []
  for encode in (lambda s: hf.encode(s, add_special_tokens=False).ids, None):
    for row in run(lib, encode, args.seed):
      rows.append(row)
      print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in row.items()))
  print(json.dumps(dict(lib=lib.name, init_ms=1e3 * lib.init_s, rows=rows)))


if __name__ == "__main__":
  main()
