"""train.answers_bench: answer generation with refilled rows beside static batches, in one process."""

from __future__ import annotations

import numpy as np

from train import answers_bench
from train.distill_data import Sequences


def test_static_utilisation_is_answer_tokens_over_rows_times_steps():
    # Answers of 4, 2 | 3 (greedy half: one batch of 2) and 1, 1 | 5 (sampled half), batch 2.
    answers = np.array([4, 2, 3, 1, 1, 5])
    seqs = Sequences(np.zeros((6, 16), np.int32), np.full(6, 3, np.int32), 3 + answers.astype(np.int32))
    # Greedy [0, 3): batches (4, 2) and (3): 2*4 + 2*3; sampled [3, 6): (1, 1) and (5): 2*1 + 2*5.
    assert answers_bench.static_utilisation(seqs, 2, 3) == answers.sum() / (8 + 6 + 2 + 10)


def test_both_modes_give_the_same_greedy_answers(lite_set_dir, capsys):
    argv = ["--model", str(lite_set_dir), "--prompts", str(lite_set_dir / "prompts_heldout.jsonl"),
            "--num-prompts", "6", "--gen-tokens", "12", "--batch-size", "4", "--refill-rows", "2", "--repeats", "1"]
    assert answers_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "6 prompts (3 greedy" in out and "greedy answers agree across modes" in out
    assert "static:" in out and "refilled:" in out and "x1.00 of static" in out
