"""Data side of training: corpus split, prompts, tokenizer, packed batches.

Fast: the tokenizer is trained on ~300 KB of the train split with a 512 vocab.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from train import corpus, packing
from train import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    return tokenizer_lib.train_tokenizer(out, vocab_size=512, max_bytes=300_000, show_progress=False)


@pytest.fixture(scope="module")
def tok(tok_path):
    return tokenizer_lib.load_tokenizer(tok_path)


# ---------------------------------------------------------------- corpus


def test_split_is_deterministic_disjoint_and_covers_all_files():
    files = corpus.list_stdlib_files()
    assert len(files) > 1000
    assert all(f.rel.endswith(".py") and "site-packages" not in f.rel for f in files)
    assert any(f.rel.startswith("test/") for f in files)  # the test suite is included

    by_split = {s: {f.rel for f in corpus.files_of(s)} for s in corpus.SPLITS}
    assert set().union(*by_split.values()) == {f.rel for f in files}
    assert sum(len(v) for v in by_split.values()) == len(files)  # disjoint
    for split in ("validation", "heldout"):
        assert 0.005 < len(by_split[split]) / len(files) < 0.05
    assert [corpus.split_of(f.rel) for f in files] == [corpus.split_of(f.rel) for f in files]


def test_split_of_is_pinned():
    # A change to the hash or bucket thresholds would silently move files between splits.
    assert corpus.split_of("os.py") == "train"
    assert corpus.split_of("decimal.py") == "validation"
    assert corpus.split_of("__future__.py") == "heldout"


def test_prompts_come_from_heldout_defs_and_are_real_source(tmp_path):
    prompts = corpus.build_prompts("heldout", n=60, seed=0)
    assert len(prompts) == 60
    assert prompts == corpus.build_prompts("heldout", n=60, seed=0)
    assert prompts != corpus.build_prompts("heldout", n=60, seed=1)
    assert len({p["prompt"] for p in prompts}) == 60

    root = corpus.stdlib_root()
    for p in prompts:
        text = p["prompt"]
        assert corpus.split_of(p["file"]) == "heldout"
        assert text.startswith("def ") and text.endswith("\n")
        assert text.count("\n") >= 2  # signature + first body line
        # Re-indented, the prompt is the file's lines starting at the `def`.
        raw = (root / p["file"]).read_bytes().decode("utf-8")
        source = re.split(r"\r\n|\r|\n", raw)  # ast's line numbering, unlike str.splitlines
        for k, line in enumerate(re.split(r"\r\n|\r|\n", text)[:-1]):
            expected = source[p["lineno"] - 1 + k]
            assert (p["indent"] + line if line else "") == (expected if expected.strip() else "")

    path = corpus.write_prompts_jsonl(tmp_path / "p.jsonl", prompts)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows == [{"prompt": p["prompt"]} for p in prompts]


def test_rewrite_prompts_hold_the_whole_function_then_its_signature_again():
    config = corpus.PromptConfig(kind="rewrite")
    prompts = corpus.build_prompts("heldout", n=20, seed=0, config=config)
    files = {p["file"] for p in prompts}
    signatures = {(p["file"], p["lineno"]): p["prompt"] for f, text in corpus.iter_documents("heldout")
                  if f.rel in files for p in corpus._function_prompts(f, text, corpus.PromptConfig())}
    for p in prompts:
        signature = signatures[(p["file"], p["lineno"])]  # the same def's signature prompt ends it
        assert p["prompt"].endswith("\n\n" + signature)
        whole = p["prompt"][: -len(signature) - 2]
        assert whole.startswith(signature) and 8 <= whole.count("\n") <= 30
    with pytest.raises(ValueError, match="not one of signature, rewrite"):
        corpus.PromptConfig(kind="edit")


# ---------------------------------------------------------------- tokenizer


def test_special_token_ids(tok):
    assert [tok.token_to_id(t) for t in tokenizer_lib.SPECIAL_TOKENS] == [0, 1, 2]
    assert (tokenizer_lib.EOS_ID, tokenizer_lib.PAD_ID, tokenizer_lib.MASK_ID) == (0, 1, 2)
    assert tok.get_vocab_size() == 512


def test_round_trip_real_stdlib_source(tok):
    texts = list(corpus.iter_texts("validation"))[:12]
    texts.append((corpus.stdlib_root() / "os.py").read_text(encoding="utf-8"))
    for text in texts:
        assert tokenizer_lib.decode(tok, tokenizer_lib.encode(tok, text)) == text


def test_round_trip_edge_cases_and_no_specials_from_text(tok):
    text = "\n\n    x = '<|endoftext|>'  \r\n\tif é: pass  # 🐍\n        \n<|mask|>"
    ids = tokenizer_lib.encode(tok, text)
    assert tokenizer_lib.decode(tok, ids) == text
    assert not set(ids) & {0, 1, 2}  # document text never becomes control tokens


# ---------------------------------------------------------------- packing


def test_token_cache_round_trips_documents(tok_path, tok, tmp_path):
    tokens = packing.load_tokens("validation", tok_path, tmp_path)
    assert tokens.dtype == np.uint16
    cached = packing.cache_path("validation", tok_path, tmp_path)
    assert cached.exists()
    np.testing.assert_array_equal(packing.load_tokens("validation", tok_path, tmp_path), tokens)

    docs = list(corpus.iter_texts("validation"))
    assert int((tokens == tokenizer_lib.EOS_ID).sum()) == len(docs)
    assert tokens[-1] == tokenizer_lib.EOS_ID
    ends = np.flatnonzero(tokens == tokenizer_lib.EOS_ID)
    first = tokenizer_lib.decode(tok, tokens[: ends[0]].tolist())
    assert first == docs[0]

    # Another tokenizer (any byte differs) must not reuse this cache.
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    other.write_bytes(tok_path.read_bytes() + b"\n")
    assert packing.cache_path("validation", other, tmp_path) != cached


def test_batch_at_is_deterministic_and_resumable():
    tokens = np.arange(5000, dtype=np.int64)  # token value == position: windows are easy to read
    a = packing.PackedBatches(tokens, batch_size=4, seq_len=32, seed=7)
    b = packing.PackedBatches(tokens, batch_size=4, seq_len=32, seed=7)
    for step in (0, 1, 5, 38, 39, 200):  # 38/39 straddle the epoch boundary (155 windows)
        np.testing.assert_array_equal(a.batch_at(step), b.batch_at(step))
    assert not np.array_equal(a.batch_at(0), packing.PackedBatches(tokens, 4, 32, seed=8).batch_at(0))

    uninterrupted = [next(a) for _ in range(10)]
    resumed = packing.PackedBatches(tokens, batch_size=4, seq_len=32, seed=7, start_step=6)
    for step in range(6, 10):
        np.testing.assert_array_equal(next(resumed), uninterrupted[step])


def test_batches_are_contiguous_windows_and_targets_shift_by_one():
    tokens = np.arange(5000, dtype=np.int64)
    it = packing.PackedBatches(tokens, batch_size=5, seq_len=32, seed=0)
    batch = next(it)
    assert batch.shape == (5, 33) and batch.dtype == np.int32
    inputs, targets = batch[:, :-1], batch[:, 1:]
    np.testing.assert_array_equal(targets, inputs + 1)

    # One epoch visits every window once: distinct starts on one phase grid.
    steps = it.num_windows // it.batch_size
    starts = np.concatenate([it.window_starts(s) for s in range(steps)])
    assert len(set(starts.tolist())) == len(starts)
    assert len(set((starts % 32).tolist())) == 1
    assert starts.max() + 33 <= len(tokens)


def test_eval_batches_are_fixed_full_windows():
    tokens = np.arange(10_000, dtype=np.int64)
    batches = packing.eval_batches(tokens, batch_size=4, seq_len=64, max_batches=3)
    assert len(batches) == 3
    again = packing.eval_batches(tokens, batch_size=4, seq_len=64, max_batches=3)
    for x, y in zip(batches, again):
        np.testing.assert_array_equal(x, y)
    stacked = np.concatenate(batches)
    assert stacked.shape == (12, 65)
    np.testing.assert_array_equal(stacked[:, 1:], stacked[:, :-1] + 1)
    assert stacked[0, 0] == 0 and np.all(stacked[:, 0] % 64 == 0)
    assert stacked[-1, 0] > 5000  # spread over the split, not just its start

    with pytest.raises(ValueError):
        packing.eval_batches(tokens[:100], batch_size=4, seq_len=64)
