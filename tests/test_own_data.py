"""Distil a drafter and fit a TAPS scorer for YOUR target on YOUR data, end to end.

The target is a random Qwen3 saved by transformers with its own tokenizer
(a WordLevel vocabulary whose "<|mask|>" special token is id 61, not 2);
prompts are JSONL files written here. train.distill -> train.traces ->
train.scorer run through their CLIs on disjoint prompt sets, then greedy
chain / ddtree / taps decoding must equal greedy AR with the trained models.
Also: the refusals (mask id inside the data / outside the vocabulary / no
mask token, overlapping trace prompts, unknown presets).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import build_hf_model
from taps_jax import load_scorer, load_target
from taps_jax.config import CONFIGS_DIR
from taps_jax.decoder import SpeculativeDecoder, load_drafter
from train import data as data_lib
from train import distill, scorer, target as target_mod, traces

REPO = Path(__file__).resolve().parent.parent
WORDS = [f"w{i}" for i in range(60)]  # ids 0..59
EOS_ID, MASK_ID, VOCAB = 60, 61, 64  # embedding rows 62, 63 lie past the tokenizer


def make_tokenizer(path: Path, mask: bool = True) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers import AddedToken

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = ["<|endoftext|>"] + (["<|mask|>"] if mask else ["<|reserved_0|>"])
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    assert tok.token_to_id("<|endoftext|>") == EOS_ID
    tok.save(str(path / "tokenizer.json"))


def write_prompts(path: Path, n: int, seed: int, response: bool = False) -> Path:
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(n):
            line = {"prompt": " ".join(rng.choice(WORDS[1:], rng.integers(3, 9)))}
            if response:
                line["response"] = " ".join(rng.choice(WORDS[1:], 16))
            f.write(json.dumps(line) + "\n")
    return path


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("own_target")
    model = build_hf_model("qwen3", False, seed=3, vocab_size=VOCAB, head_dim=8, eos_token_id=EOS_ID)
    model.save_pretrained(path)
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def trained(hf_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("own_run")
    prompts = write_prompts(root / "prompts.jsonl", 24, seed=0)
    trace_prompts = write_prompts(root / "trace_prompts.jsonl", 6, seed=1)
    assert distill.main(["--target", str(hf_target), "--out", str(root / "drafter"), "--preset", "tiny",
                         "--prompts", str(prompts), "--mask-token-id", str(MASK_ID), "--steps", "4",
                         "--gen-tokens", "16", "--val-fraction", "0.2"]) == 0
    drafter_dir = root / "drafter" / "export"
    assert (drafter_dir / data_lib.PROMPT_DIGESTS).is_file()
    assert traces.main(["--target", str(hf_target), "--drafter", str(drafter_dir), "--prompts", str(trace_prompts),
                        "--out", str(root / "traces"), "--pool-width", "4", "--pool-k", "4", "--budget", "4",
                        "--max-new-tokens", "8", "--batch-size", "4"]) == 0
    assert scorer.main(["--traces", str(root / "traces"), "--target", str(hf_target), "--out", str(root / "scorer"),
                        "--steps", "4", "--batch-size", "8", "--eval-every", "0"]) == 0
    return root, prompts, drafter_dir, root / "scorer" / "scorer"


def test_distilled_drafter_and_scorer_decode_losslessly(hf_target, trained):
    root, prompts, drafter_dir, scorer_dir = trained
    target = load_target(hf_target)
    drafter = load_drafter(drafter_dir)
    assert drafter.config.mask_token_id == MASK_ID
    run = json.loads((root / "drafter" / "run.json").read_text())
    assert run["data"]["prompts"] == str(prompts)
    texts = [json.loads(line)["prompt"] for line in open(root / "trace_prompts.jsonl")][:3]
    want = target.generate(texts, 12).tokens
    for policy in ("chain", "ddtree", "taps"):
        kw = {"scorer": load_scorer(scorer_dir)} if policy == "taps" else {}
        got = SpeculativeDecoder(target, drafter, policy, 4, **kw).generate(texts, 12)
        assert got.tokens == want, policy


def test_trace_prompts_that_were_distilled_on_are_refused(hf_target, trained, tmp_path, capsys):
    root, prompts, drafter_dir, _ = trained
    rc = traces.main(["--target", str(hf_target), "--drafter", str(drafter_dir), "--prompts", str(prompts),
                      "--out", str(tmp_path / "tr"), "--pool-width", "4", "--pool-k", "4", "--budget", "4"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "prompts" in err and "distilled on" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "tr" / "meta.json").exists()
    # An explicit --distill-prompts file is checked too (a drafter exported elsewhere has no digests).
    bare = tmp_path / "bare"
    shutil.copytree(drafter_dir, bare)
    (bare / data_lib.PROMPT_DIGESTS).unlink()
    argv = ["--target", str(hf_target), "--drafter", str(bare), "--prompts", str(prompts),
            "--out", str(tmp_path / "tr2"), "--pool-width", "4", "--pool-k", "4", "--budget", "4"]
    assert traces.main(argv + ["--distill-prompts", str(prompts)]) == 2
    assert "distilled on" in capsys.readouterr().err


def test_given_responses_skip_generation(hf_target, tmp_path):
    prompts = write_prompts(tmp_path / "pairs.jsonl", 12, seed=5, response=True)
    out = tmp_path / "d"
    assert distill.main(["--target", str(hf_target), "--out", str(out), "--preset", "tiny", "--prompts", str(prompts),
                         "--steps", "2", "--val-fraction", "0.2"]) == 0
    assert not (out / "data").exists()  # nothing generated
    assert load_drafter(out / "export").config.mask_token_id == MASK_ID  # the tokenizer's <|mask|>


def test_more_prompts_add_an_answer_set_of_their_own(hf_target, tmp_path, capsys):
    """--more-prompts: each file is answered as a set of its own, so a run that adds a file reuses the answers of
    the files it had (a later leg of a set's chain adds prompts this way) and trains on all of them."""
    prompts, more = write_prompts(tmp_path / "p.jsonl", 12, seed=10), write_prompts(tmp_path / "m.jsonl", 6, seed=11)
    val = write_prompts(tmp_path / "v.jsonl", 4, seed=12)
    base = ["--target", str(hf_target), "--preset", "tiny", "--prompts", str(prompts), "--val-prompts", str(val),
            "--mask-token-id", str(MASK_ID), "--steps", "2", "--gen-tokens", "8", "--eval-every", "0"]
    first = tmp_path / "first"
    assert distill.main(base + ["--out", str(first)]) == 0
    assert "train: 12 sequences" in capsys.readouterr().out
    second = tmp_path / "second"
    second.mkdir()
    (second / "data").symlink_to(first / "data")  # one data cache, as the legs of a chain share leg 1's
    assert distill.main(base + ["--out", str(second), "--more-prompts", str(more)]) == 0
    out = capsys.readouterr().out
    assert "train: 12 cached target continuations" in out and "train: 18 sequences" in out
    assert len(list((first / "data").glob("train-*/lengths.npy"))) == 2
    assert json.loads((second / "run.json").read_text())["data"]["more_prompts"] == [str(more)]
    # The added prompts were distilled on: traces refuses them.
    rc = traces.main(["--target", str(hf_target), "--drafter", str(second / "export"), "--prompts", str(more),
                      "--out", str(tmp_path / "tr"), "--pool-width", "4", "--pool-k", "4", "--budget", "4"])
    assert rc == 2 and "distilled on" in capsys.readouterr().err
    # A file of prompt + response pairs beside the target's answers is trained on as given text, generating nothing.
    pairs = write_prompts(tmp_path / "pairs.jsonl", 4, seed=13, response=True)
    third = tmp_path / "third"
    third.mkdir()
    (third / "data").symlink_to(first / "data")
    assert distill.main(base + ["--out", str(third), "--more-prompts", str(more), str(pairs)]) == 0
    out = capsys.readouterr().out
    assert "train: 6 cached target continuations" in out and "train: 22 sequences" in out
    assert len(list((first / "data").glob("train-*/lengths.npy"))) == 2  # no answer set for the pairs
    # Refused before the target loads: a line in two files, a file half pairs, no --prompts.
    again = tmp_path / "again.jsonl"
    again.write_text(more.read_text().splitlines()[0] + "\n" + val.read_text().splitlines()[0] + "\n")
    assert "also in" in _refusal(capsys, base + ["--out", str(tmp_path / "o"), "--more-prompts", str(again)])
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(pairs.read_text() + more.read_text().splitlines()[1] + "\n")
    assert "4 of 5 lines have a response; give a response on every line" in _refusal(
        capsys, base + ["--out", str(tmp_path / "o"), "--more-prompts", str(mixed)])
    assert "--more-prompts goes with --prompts" in _refusal(
        capsys, ["--target", str(hf_target), "--out", str(tmp_path / "o"), "--corpus", str(tmp_path),
                 "--more-prompts", str(more)])
    assert not (tmp_path / "o").exists()


def _refusal(capsys, argv) -> str:
    assert distill.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_mask_token_refusals(hf_target, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", 12, seed=2)
    frequent = int(np.argmax(np.bincount([i for line in open(prompts)
                                          for i in (WORDS.index(w) for w in json.loads(line)["prompt"].split())])))
    base = ["--target", str(hf_target), "--out", str(tmp_path / "o"), "--preset", "tiny", "--prompts", str(prompts)]
    err = _refusal(capsys, base + ["--mask-token-id", str(frequent)])
    assert f"--mask-token-id {frequent} occurs" in err and "training data" in err and "61 '<|mask|>'" in err
    err = _refusal(capsys, base + ["--mask-token-id", str(VOCAB)])
    assert f"outside the target's vocabulary [0, {VOCAB})" in err
    err = _refusal(capsys, base + ["--mask-token-id", str(EOS_ID)])
    assert "EOS" in err
    assert not (tmp_path / "o").exists()  # refused before anything was written

    # A tokenizer without a mask token: refused, listing the candidates and the flag.
    bare = tmp_path / "nomask"
    shutil.copytree(hf_target, bare)
    make_tokenizer(bare, mask=False)
    err = _refusal(capsys, ["--target", str(bare), "--out", str(tmp_path / "o2"), "--preset", "tiny",
                            "--prompts", str(prompts)])
    assert "no mask special token" in err and "--mask-token-id" in err
    assert "61 '<|reserved_0|>'" in err and "62..63" in err


def test_data_and_preset_refusals(hf_target, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", 8, seed=2)
    base = ["--target", str(hf_target), "--out", str(tmp_path / "o")]
    assert "--prompts FILE.jsonl" in _refusal(capsys, base)  # no data given
    err = _refusal(capsys, base + ["--prompts", str(prompts), "--preset", "nope"])
    shipped = sorted(f.stem.removeprefix("drafter_") for f in (CONFIGS_DIR / "train").glob("drafter_*.json"))
    assert {"default", "smollm2", "tiny"} <= set(shipped)  # and a preset per later leg of a set's drafter
    assert f"no drafter preset 'nope'; known: {', '.join(shipped)} (or give the path" in err
    err = _refusal(capsys, base + ["--prompts", str(prompts), "--val-prompts", str(prompts)])
    assert "also in --prompts" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w1 w2"}\n{"text": "w3"}\n')
    assert f"{bad}:2:" in _refusal(capsys, base + ["--prompts", str(bad)])
    with pytest.raises(ValueError, match="no target preset 'nope'; known: default, tiny"):
        target_mod.load_preset("nope")


def test_hash_split_is_stable():
    examples = [data_lib.Example(f"p{i}", None, data_lib.hashlib.sha1(str(i).encode()).hexdigest())
                for i in range(400)]
    train, val = data_lib.hash_split(examples, 0.1)
    assert 20 < len(val) < 60 and len(train) + len(val) == 400
    _, val2 = data_lib.hash_split(examples[::-1][:300], 0.1)  # reordered, fewer lines: same decision per line
    assert {e.key for e in val2} == {e.key for e in val if e in examples[100:]}


def test_target_pretrains_on_a_prompts_file(hf_target, tmp_path, capsys):
    docs = write_prompts(tmp_path / "docs.jsonl", 120, seed=7, response=True)
    out = tmp_path / "t"
    assert target_mod.main(["--out", str(out), "--preset", "tiny", "--tokenizer", str(hf_target / "tokenizer.json"),
                            "--prompts", str(docs), "--val-fraction", "0.25", "--steps", "2", "--seq-len", "32",
                            "--eval-every", "2"]) == 0
    model = load_target(out / "export")
    assert model.config.vocab_size == 62 and model.tokenizer.token_to_id("<|mask|>") == MASK_ID
    rc = target_mod.main(["--out", str(tmp_path / "t2"), "--preset", "tiny", "--tokenizer", str(hf_target),
                          "--prompts", str(docs), "--corpus", str(tmp_path)])
    assert rc == 2 and "not both" in capsys.readouterr().err
