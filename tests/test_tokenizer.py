"""TextTokenizer against transformers' AutoTokenizer on the same folder (the reference)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tierserve.api.tokenizer import ChatTemplateError, TextTokenizer, try_load

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks! «ünïcödé» 🚀\n\n  spaced  "},
    ],
]

# Exercises every helper transformers gives templates: raise_exception, tojson (without HTML
# escaping), namespace, loop controls, bos/eos tokens, {% generation %}, and trim/lstrip blocks.
CUSTOM_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m['role'] == 'bad' %}{{ raise_exception('bad role: ' + m['role']) }}{% endif %}
  {% if m['role'] == 'skip' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}{{ eos_token }}{% endgeneration %}
  {% else %}{{ m['role'] }} {{ m | tojson }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}A({{ ns.n }}):{% endif %}"""


@pytest.fixture(scope="module")
def hf_tokenizer(builtin_model: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(builtin_model)


@pytest.fixture(scope="module")
def tokenizer(builtin_model: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(builtin_model)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs


def test_custom_template_helpers_match_transformers(builtin_model: Path, tmp_path: Path):
    import transformers

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(builtin_model / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = CUSTOM_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = TextTokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "user", "content": "<b>html & \"quotes\"</b> é"},
        {"role": "skip", "content": "ignored"},
        {"role": "assistant", "content": "ok"},
    ]
    for gen in (True, False):
        expected = theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    with pytest.raises(ChatTemplateError, match="bad role"):
        ours.apply_chat_template([{"role": "bad", "content": "x"}])


def test_a_chat_template_saved_as_its_own_file_is_used(builtin_model: Path, tmp_path: Path):
    """Recent ``transformers`` save the template in ``chat_template.jinja``, not in
    ``tokenizer_config.json``: /v1/chat/completions answered "no chat template" for such models."""
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(builtin_model)
    theirs.chat_template = CUSTOM_TEMPLATE
    theirs.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    ours, reloaded = TextTokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    for gen in (True, False):
        expected = reloaded.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_template_cannot_escape_sandbox(tokenizer: TextTokenizer):
    evil = TextTokenizer(tokenizer.tokenizer, {"chat_template": "{{ ''.__class__.__mro__ }}"}, frozenset())
    with pytest.raises(ChatTemplateError):
        evil.apply_chat_template([])


TEXTS = ["hello world", "The capital of France is", "  leading spaces\tand\ttabs\n", "1234567 digits", "é 🚀 漢字"]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_eos(tokenizer: TextTokenizer, hf_tokenizer):
    assert tokenizer.eos_token_ids == {hf_tokenizer.eos_token_id}
    chat = tokenizer.apply_chat_template(CONVERSATIONS[0])
    ids = tokenizer.encode(chat, add_special_tokens=False)
    expected = hf_tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, tokenize=True)
    assert ids == expected["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == chat
    assert "<|im_start|>" not in tokenizer.decode(ids)


def test_add_bos_token_from_config(tokenizer: TextTokenizer):
    with_bos = TextTokenizer(tokenizer.tokenizer, {**tokenizer.config, "add_bos_token": True}, frozenset())
    assert with_bos.encode("hi") == [tokenizer.bos_token_id, *tokenizer.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == tokenizer.encode("hi")


def test_folder_without_tokenizer(tiny_llama: Path):
    assert try_load(tiny_llama) is None


def test_router_side_modules_are_torch_free():
    # The router imports these two and must not pay for (or depend on) torch.
    code = ("import sys, tierserve.api.tokenizer, tierserve.api.openai; "
            "sys.exit(sorted({'torch', 'transformers'} & set(sys.modules)) or None)")
    subprocess.run([sys.executable, "-c", code], check=True)
