"""Chat plumbing on a small model of ours with a chat template: Target.chat, the end-of-turn stop,
"messages" prompt lines, --chat in job mode, and the template surviving save/load."""

from __future__ import annotations

import json
import shutil

import pytest

import taps_jax
from decode import cli
from taps_jax.decoder import DEFAULT_MODEL_DIR
from taps_jax.prompt_file import read_prompt_file

TEMPLATE = ("{% for m in messages %}### {{ m.role }}:\n{{ m.content }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:\n{% endif %}")
CONV = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """The embedded target with a tokenizer_config.json holding a chat template (and no EOS of its own)."""
    path = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(DEFAULT_MODEL_DIR / "target", path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    return path


@pytest.fixture(scope="module")
def target(chat_dir):
    return taps_jax.load_target(chat_dir)


def test_template_end_of_turn_is_a_stop_id(target):
    eot = target.tokenizer.token_to_id("<|endoftext|>")
    assert eot in target.eos_ids
    assert target.chat_prompts(CONV) == ["### user:\ndef add(a, b):<|endoftext|>\n### assistant:\n"]


def test_chat_is_generate_on_the_rendered_prompt(target):
    got = target.chat([CONV, CONV + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]], 8)
    want = target.generate(target.chat_prompts([CONV, CONV + [{"role": "assistant", "content": "ok"},
                                                              {"role": "user", "content": "more"}]]), 8)
    assert got.tokens == want.tokens
    assert target.generate(CONV, 8).tokens == want.tokens[:1]  # a conversation is a prompt of generate too


def test_no_template_says_so():
    plain = taps_jax.load_target(DEFAULT_MODEL_DIR / "target")
    with pytest.raises(ValueError, match="no chat template"):
        plain.chat(CONV)


def test_save_keeps_the_template(target, tmp_path):
    target.save(tmp_path / "copy")
    again = taps_jax.load_target(tmp_path / "copy")
    assert again.chat_prompts(CONV) == target.chat_prompts(CONV) and again.eos_ids == target.eos_ids


def test_messages_lines_and_their_errors(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"id": "a", "messages": CONV}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    assert [r.prompt for r in read_prompt_file(f)] == [CONV, "x"]
    assert [r.prompt for r in read_prompt_file(f, chat=True)] == [CONV, [{"role": "user", "content": "x"}]]
    for bad, match in (({"messages": []}, "in.jsonl:1: a conversation must be a non-empty list"),
                       ({"messages": [{"role": "user"}]}, "in.jsonl:1: message 0 must be an object"),
                       ({"messages": CONV, "prompt": "x"}, "not both")):
        f.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=match):
            read_prompt_file(f)


def test_job_mode_chat(chat_dir, target, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 0, "prompt": CONV[0]["content"]}) + "\n"
                   + json.dumps({"id": 1, "messages": CONV}) + "\n")
    out = tmp_path / "out.jsonl"
    base = ["--target", str(chat_dir), "--policy", "ar", "--max-new-tokens", "8", "--prompts", str(src),
            "--out", str(out)]
    assert cli.main(base + ["--chat"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = target.chat(CONV, 8).texts[0]
    assert [r["text"] for r in rows] == [want, want]  # a --chat prompt line is the same single user turn
    with pytest.raises(ValueError, match="chat"):  # the job's settings recorded --chat: a resume without it differs
        cli.main(base)
