"""models.text.chat_template: SmolLM2's ChatML template by hand, the sandbox, message validation, the
tokenizer-level API (templates from HF directories; the byte tokenizer's default)."""

import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from models.text.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat_template, validate_messages
from models.text.tokenizer import ByteTokenizer, HFTokenizer, TokenizersTokenizer

# tokenizer.chat_template of SmolLM2-135M-Instruct.Q4_1.gguf, verbatim (test_gguf_tokenizer checks
# that the file still holds exactly this).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")
DEFAULT_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                  "Hugging Face<|im_end|>\n")
USER = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_one_user_message_by_hand():
  text = render_chat_template(SMOLLM2_TEMPLATE, USER, add_generation_prompt=True)
  assert text.startswith(DEFAULT_SYSTEM)
  assert text.endswith("<|im_start|>assistant\n")
  assert text == (DEFAULT_SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                  "<|im_start|>assistant\n")
  # Without the generation prompt the text ends after the user turn.
  assert render_chat_template(SMOLLM2_TEMPLATE, USER, add_generation_prompt=False) == (
      DEFAULT_SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")


def test_smollm2_own_system_prompt_and_turns():
  chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
  assert render_chat_template(SMOLLM2_TEMPLATE, chat) == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
      "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
      "<|im_start|>assistant\n")


def test_transformers_environment_features():
  # trim_blocks / lstrip_blocks: block tags leave no newline or indentation behind.
  template = ("{% for m in messages %}\n  {% if m.role %}{{ m.role }}:{{ m.content }};{% endif %}\n"
              "{% endfor %}")
  assert render_chat_template(template, USER * 2) == ("user:What is the capital of France?;" * 2)
  # tojson keeps non-ASCII and does not HTML-escape; its options are transformers'.
  assert render_chat_template("{{ messages[0] | tojson }}", [{"role": "u", "content": "<é>&"}]) \
      == '{"role": "u", "content": "<é>&"}'
  assert render_chat_template("{{ messages | tojson(indent=1) }}", [{"role": "u", "content": ""}]) \
      == '[\n {\n  "role": "u",\n  "content": ""\n }\n]'
  assert render_chat_template("{{ strftime_now('%Y') | length }}", USER) == "4"
  assert render_chat_template("{{ bos_token }}|{{ eos_token }}", USER, bos_token="<s>",
                              eos_token="</s>") == "<s>|</s>"
  assert render_chat_template("[{{ bos_token }}]", USER) == "[]"  # absent: undefined, renders ''
  assert render_chat_template("{{ add_generation_prompt }}", USER,
                              add_generation_prompt=False) == "False"
  # namespace, dict, loop controls and transformers' {% generation %} tag.
  template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}"
              "{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
              "{{ dict(a=1)['a'] }}{% generation %}<{{ messages[0].role }}>{% endgeneration %}")
  assert render_chat_template(template, USER * 5) == "21<user>"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ '{0.__class__}'.format(1) }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{% set ns = namespace(_private=1) %}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
])
def test_sandbox_blocks_escapes(template):
  with pytest.raises(ValueError, match="sandbox|unsafe|underscore"):
    render_chat_template(template, USER)


def test_errors_are_value_errors_with_the_reason():
  with pytest.raises(ValueError, match="raised an exception: Only user and assistant roles!$"):
    render_chat_template("{{ raise_exception('Only user and assistant roles!') }}", USER)
  with pytest.raises(ValueError, match="syntax error"):
    render_chat_template("{% if %}", USER)
  with pytest.raises(ValueError, match="syntax error"):
    render_chat_template("{% for m in messages %}", USER)
  with pytest.raises(ValueError, match="TypeError"):
    render_chat_template("{{ 1 + 'a' }}", USER)
  with pytest.raises(ValueError, match="chat template error"):
    render_chat_template("{{ messages[0].content.nope.deeper }}", USER)
  with pytest.raises(ValueError, match="must be a str"):
    render_chat_template(None, USER)  # type: ignore[arg-type]


@pytest.mark.parametrize("messages,needle", [
    ("hi", "non-empty list"),
    ([], "non-empty list"),
    (["hi"], "must be a dict"),
    ([{"role": "user"}], "missing: \\['content'\\]"),
    ([{"role": "user", "content": "x", "tool": 1}], "unexpected: \\['tool'\\]"),
    ([{"role": "user", "content": "x", "name": 1}], "'name' must be a str"),
    ([{"role": "", "content": "x"}], "'role' must be a non-empty str"),
    ([{"role": 1, "content": "x"}], "'role' must be a non-empty str"),
    ([{"role": "user", "content": None}], "'content' must be a str"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "'content' must be a str"),
])
def test_message_validation(messages, needle):
  with pytest.raises(ValueError, match=needle):
    validate_messages(messages)
  with pytest.raises(ValueError, match=needle):
    render_chat_template(SMOLLM2_TEMPLATE, messages)


def test_template_sees_copies():
  messages = [{"role": "user", "content": "x"}]
  out = validate_messages(messages)
  assert out == messages and out[0] is not messages[0]


def _word_tokenizer() -> tokenizers.Tokenizer:
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3, "<|im_start|>": 4, "<|im_end|>": 5}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
  return tok


def test_tokenizer_chat_api():
  byte = ByteTokenizer()  # the random presets: the documented default template
  assert byte.chat_template == DEFAULT_CHAT_TEMPLATE
  assert byte.apply_chat_template([{"role": "system", "content": "be brief"}] + USER) == (
      "system: be brief\nuser: What is the capital of France?\nassistant: ")
  assert byte.apply_chat_template(USER, add_generation_prompt=False) == (
      "user: What is the capital of France?\n")
  assert byte.encode_chat(USER) == list(b"user: What is the capital of France?\nassistant: ")
  template = ("{{ bos_token }}{% for m in messages %}<|im_start|> {{ m.content }} <|im_end|>"
              "{% endfor %}")
  tok = TokenizersTokenizer(_word_tokenizer(), bos_id=1, eos_ids=[2, 5], chat_template=template)
  assert (tok.bos_token, tok.eos_token, tok.eos_ids) == ("<s>", "</s>", (2, 5))
  chat = [{"role": "user", "content": "hi"}]
  assert tok.apply_chat_template(chat) == "<s><|im_start|> hi <|im_end|>"
  # encode_chat encodes the rendered text as is: bos only where the template writes it.
  assert tok.encode_chat(chat) == [1, 4, 3, 5]
  plain = TokenizersTokenizer(_word_tokenizer(), bos_id=None, eos_ids=[2])
  assert plain.chat_template is None and plain.bos_token is None
  with pytest.raises(ValueError, match="no chat template"):
    plain.encode_chat(chat)
  with pytest.raises(ValueError, match="no eos id"):
    TokenizersTokenizer(_word_tokenizer(), bos_id=None, eos_ids=[])


def test_hf_directory_chat_templates(tmp_path):
  _word_tokenizer().save(str(tmp_path / "tokenizer.json"))
  assert HFTokenizer(tmp_path / "tokenizer.json").chat_template is None
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": "A{{ eos_token }}", "eos_token": "<|im_end|>", "bos_token": "<s>",
       "add_bos_token": False}))
  tok = HFTokenizer(tmp_path / "tokenizer.json")
  assert tok.chat_template == "A{{ eos_token }}" and tok.bos_id is None
  assert (tok.bos_token, tok.eos_token, tok.eos_id) == ("<s>", "<|im_end|>", 5)
  assert tok.apply_chat_template(USER) == "A<|im_end|>"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
      {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
  assert HFTokenizer(tmp_path / "tokenizer.json").chat_template == "D"
  (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
  tok = HFTokenizer(tmp_path / "tokenizer.json")  # the .jinja file wins, as in transformers 5
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "Jhi"
