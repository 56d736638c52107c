"""Issue 8, item 1: one table of bad inputs to the speculative API, the loaders and taps-decode.

Every row must fail with a ValueError whose message names the bad value and
says how to fix it, BEFORE any jitted program runs (conftest's `no_tracing` fixture
replaces the engine entry points with a tripwire).

Target-level rejections (Target.generate / Target.logits, load_target's
missing dir, wrong architecture, tensor names and shapes, truncated or
missing weights, dtype) are in test_bad_input.py and are not repeated here;
bad argparse flags (exit status 2) are in test_cli.py.
"""

from __future__ import annotations

import json
import re
import shutil
import types

import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as tok_models
from tokenizers import pre_tokenizers

from decode import cli
from spec_helpers import tiny_pair
from taps_helpers import random_scorer
from taps_jax.api import Target
from taps_jax.checkpoints.scorer import ScorerModel, load_scorer
from taps_jax.checkpoints.tokenizer import Tokenizer
from taps_jax.decoder import DrafterModel, SpeculativeDecoder, load_drafter, load_model_set
from taps_jax.models.drafter import Drafter
from taps_jax.tree.scorer import ScorerConfig

VOCAB = 8  # tiny_pair(8): 2-layer target, drafter with block_size 8 (horizon 7)
WORDS = ["[UNK]", "a", "b", "c", "d", "e", "f", "g"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tiny models in memory and as a model directory (target/ with a tokenizer, drafter/, scorer/)."""
    target, drafter = tiny_pair(VOCAB)
    scorer = random_scorer(target, drafter)
    hf_tok = HFTokenizer(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    hf_tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    root = tmp_path_factory.mktemp("sweep_set")
    Target(target.model, Tokenizer(hf_tok), ()).save(root / "target")
    drafter.save(root / "drafter")
    scorer.save(root / "scorer")
    return types.SimpleNamespace(target=target, drafter=drafter, scorer=scorer, set_dir=root,
                                 dec=SpeculativeDecoder(target, drafter, "ddtree", 16), tmp=None)


# ---------------------------------------------------------------- helpers used by the rows

def other_drafter(env, **changes) -> DrafterModel:
    """A drafter whose config differs from the compatible one in `changes`."""
    return DrafterModel(Drafter(env.drafter.config.replace(**changes), nnx.Rngs(0)))


def other_scorer(env, **changes) -> ScorerModel:
    """A scorer whose config differs from the compatible one in `changes`."""
    base = dict(vocab_size=VOCAB, embed_dim=32, drafter_hidden_size=32, horizon=7,
                token_dim=8, hidden_dim=8, depth_dim=4, mlp_dim=16)
    return ScorerModel.init(ScorerConfig(**{**base, **changes}))


def broken_set(env, part: str | None = None, config: dict | None = None, edit=None):
    """A copy of the model set with `part`/config.json updated by `config` and/or `edit(part_dir)`.

    Returns the part's directory (the set's root when part is None).
    """
    root = env.tmp / "set"
    if not root.exists():
        shutil.copytree(env.set_dir, root)
    where = root / part if part else root
    if config:
        raw = json.loads((where / "config.json").read_text())
        for key, value in config.items():  # "a.b" edits a nested object
            *outer, leaf = key.split(".")
            node = raw
            for k in outer:
                node = node[k]
            node[leaf] = value
        (where / "config.json").write_text(json.dumps(raw))
    if edit:
        edit(where)
    return where


def truncate(fraction=None, keep_bytes=None):
    def edit(d):
        f = d / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[: keep_bytes if keep_bytes is not None else int(len(data) * fraction)])
    return edit


def append_garbage(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"\0" * 16)


def missing_shard(d):
    index = {"metadata": {}, "weight_map": {"fc.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def write_config(text):
    def edit(d):
        (d / "config.json").write_text(text)
    return edit


def drafter_load(env, **kw):
    return load_drafter(broken_set(env, "drafter", **kw))


def scorer_load(env, **kw):
    return load_scorer(broken_set(env, "scorer", **kw))


def set_load(env, part="target", **kw):
    broken_set(env, part, **kw)
    return load_model_set(env.tmp / "set")


def gen(env, prompts=((1, 2, 3),), **kw):
    return env.dec.generate([list(p) for p in prompts] if not isinstance(prompts, str) else prompts,
                            **{"max_new_tokens": 4, **kw})


def decode_cli(env, *flags, model=None):
    return cli.main(["--model", str(model or env.set_dir), "--prompt", "a b c", "--max-new-tokens", "4",
                     "--budget", "4", *flags])


SD = SpeculativeDecoder

# (case, call(env), message regex: the bad value AND the fix it names)
CASES = [
    # --- SpeculativeDecoder: policy, models, tree sizes
    ("unknown policy", lambda e: SD(e.target, e.drafter, "beam"),
     r"unknown policy 'beam'; choose one of ar, chain, ddtree, taps"),
    ("target is a path", lambda e: SD("runs/target", e.drafter),
     r"target must be a Target \(from load_target\(path\)\), got str"),
    ("drafter is a path", lambda e: SD(e.target, "runs/drafter"),
     r"drafter must be a DrafterModel \(from load_drafter\(path\)\) or None, got str"),
    ("tree policy without drafter", lambda e: SD(e.target, None, "chain"),
     r"policy 'chain' needs a drafter; load one with load_drafter\(path\) or use policy 'ar'"),
    ("budget 0", lambda e: SD(e.target, e.drafter, "ddtree", 0),
     r"budget must be a positive integer .*, got 0"),
    ("budget float", lambda e: SD(e.target, e.drafter, "ddtree", 2.5),
     r"budget must be a positive integer .*, got 2.5"),
    ("budget bool", lambda e: SD(e.target, e.drafter, "chain", True),
     r"budget must be a positive integer .*, got True"),
    ("lattice_k 0", lambda e: SD(e.target, e.drafter, "ddtree", 16, lattice_k=0),
     r"lattice_k must be between 1 and the vocabulary size 8, got 0; set lattice_k in that range"),
    ("lattice_k above vocab", lambda e: SD(e.target, e.drafter, "ddtree", 16, lattice_k=9),
     r"lattice_k must be between 1 and the vocabulary size 8, got 9; set lattice_k in that range"),
    ("lattice_k float", lambda e: SD(e.target, e.drafter, "ddtree", 16, lattice_k=2.5),
     r"lattice_k must be an integer, got float 2.5; pass a whole number"),
    ("beam_width 0", lambda e: SD(e.target, e.drafter, "ddtree", 16, beam_width=0),
     r"beam_width must be >= 1, got 0; for an exact DDTree use beam_width >= budget \(16\)"),
    ("beam_width str", lambda e: SD(e.target, e.drafter, "ddtree", 16, beam_width="4"),
     r"beam_width must be an integer, got str '4'; pass a whole number"),
    ("budget larger than the pool", lambda e: SD(e.target, e.drafter, "ddtree", 16, beam_width=1),
     r"budget 16 exceeds the candidate pool of 7 nodes \(horizon 7 x beam_width 1\).*lower the budget or raise beam_width"),
    # --- incompatible target / drafter / scorer
    ("drafter width", lambda e: SD(e.target, other_drafter(e, hidden_size=64)),
     r"drafter hidden_size=64 differs from the target's hidden_size=32.*use a drafter trained for this target"),
    ("drafter vocab", lambda e: SD(e.target, other_drafter(e, vocab_size=16)),
     r"drafter vocab_size=16 differs from the target's vocab_size=8; use a drafter trained for this target"),
    ("drafter taps a missing layer", lambda e: SD(e.target, other_drafter(e, target_layer_ids=(0, 5))),
     r"target_layer_ids \[5\] do not exist in the target, which has 2 layers.*use a drafter trained"),
    ("drafter for a deeper target", lambda e: SD(e.target, other_drafter(e, num_target_layers=3)),
     r"num_target_layers=3, but this target has 2 layers; use a drafter trained for this target"),
    ("drafter mask token outside vocab", lambda e: SD(e.target, other_drafter(e, mask_token_id=8)),
     r"mask_token_id=8 is outside the target's embedding table \(vocab_size=8\); fix dflash_config"),
    ("taps without scorer", lambda e: SD(e.target, e.drafter, "taps", 8),
     r"policy 'taps' needs a trained scorer: .*or use policy 'ddtree'"),
    ("scorer of the wrong type", lambda e: SD(e.target, e.drafter, "taps", 8, scorer=e.drafter),
     r"scorer must be a ScorerModel \(from load_scorer\(path\)\), got DrafterModel"),
    ("scorer vocab", lambda e: SD(e.target, e.drafter, "taps", 8, scorer=other_scorer(e, vocab_size=9)),
     r"scorer vocab_size=9 differs from the target's vocab_size=8; .*train one for this pair"),
    ("scorer embedding width", lambda e: SD(e.target, e.drafter, "taps", 8, scorer=other_scorer(e, embed_dim=16)),
     r"scorer embed_dim=16 differs from the target's embedding width hidden_size=32; .*train one"),
    ("scorer drafter width", lambda e: SD(e.target, e.drafter, "taps", 8,
                                          scorer=other_scorer(e, drafter_hidden_size=16)),
     r"scorer drafter_hidden_size=16 differs from the drafter's hidden_size=32; .*train one"),
    ("scorer block size", lambda e: SD(e.target, e.drafter, "taps", 8, scorer=other_scorer(e, horizon=3)),
     r"scorer horizon=3 differs from the drafter's horizon block_size - 1=7; .*train one for this pair"),
    # --- SpeculativeDecoder.generate: prompts
    ("no prompts", lambda e: gen(e, []), r"no prompts given; pass at least one prompt"),
    ("empty prompt", lambda e: gen(e, [[1, 2], []]), r"prompt 1 is empty; every prompt needs at least one token"),
    ("prompt longer than capacity", lambda e: gen(e, [[1] * 40], capacity=32),
     r"prompt 0 has 40 tokens but the cache holds 32 \(capacity\); shorten the prompt or raise capacity"),
    ("mixed lengths beyond the bucket", lambda e: gen(e, [[1] * 3, [2] * 20], capacity=16),
     r"prompt 1 has 20 tokens but the cache holds 16 \(capacity\); shorten the prompt or raise capacity"),
    ("float token ids", lambda e: gen(e, [[1.5, 2.0]]),
     r"prompt 0: token ids must be a 1-D sequence of integers, got float64"),
    ("string token id", lambda e: gen(e, [[1, 2], [1, "a"]]),
     r"prompt 1: token ids must be a 1-D sequence of integers, got <U"),
    ("nested prompt", lambda e: gen(e, [[[1, 2]]]),
     r"prompt 0: token ids must be a 1-D sequence of integers, got int64 with shape \(1, 2\)"),
    ("token id past vocab", lambda e: gen(e, [[1, 2, 8]]),
     r"prompt 0: token id 8 is outside the vocabulary \[0, 8\)"),
    ("negative token id", lambda e: gen(e, [[3], [-1]]),
     r"prompt 1: token id -1 is outside the vocabulary \[0, 8\)"),
    ("text without tokenizer", lambda e: gen(e, "hello"),
     r"text prompts need a tokenizer; this model has none, pass token ids instead"),
    # --- SpeculativeDecoder.generate: sampling and sizes
    ("NaN temperature", lambda e: gen(e, temperature=float("nan")),
     r"temperature must be a finite number >= 0 \(0 = greedy\), got nan"),
    ("inf temperature", lambda e: gen(e, temperature=float("inf")),
     r"temperature must be a finite number >= 0 \(0 = greedy\), got inf"),
    ("negative temperature", lambda e: gen(e, temperature=-0.5),
     r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.5"),
    ("string temperature", lambda e: gen(e, temperature="0.7"),
     r"temperature must be a finite number >= 0 \(0 = greedy\), got '0.7'"),
    ("top_p 0", lambda e: gen(e, temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"),
    ("top_p above 1", lambda e: gen(e, temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\] \(1 = off\), got 1.5"),
    ("NaN top_p", lambda e: gen(e, temperature=1.0, top_p=float("nan")),
     r"top_p must be in \(0, 1\] \(1 = off\), got nan"),
    ("negative top_k", lambda e: gen(e, temperature=1.0, top_k=-1), r"top_k must be an integer >= 0 \(0 = off\), got -1"),
    ("float top_k", lambda e: gen(e, temperature=1.0, top_k=2.5), r"top_k must be an integer >= 0 \(0 = off\), got 2.5"),
    ("max_new_tokens 0", lambda e: gen(e, max_new_tokens=0), r"max_new_tokens must be a positive integer, got 0"),
    ("float max_new_tokens", lambda e: gen(e, max_new_tokens=2.0), r"max_new_tokens must be a positive integer, got 2.0"),
    ("capacity 0", lambda e: gen(e, capacity=0),
     r"capacity must be a positive integer \(KV-cache slots per sequence\) or None, got 0"),
    ("float capacity", lambda e: gen(e, capacity=8.5),
     r"capacity must be a positive integer \(KV-cache slots per sequence\) or None, got 8.5"),
    ("float seed", lambda e: gen(e, seed=1.5), r"seed must be an integer, got 1.5"),
    ("stop_at_eos string", lambda e: gen(e, stop_at_eos="no"), r"stop_at_eos must be True or False, got 'no'"),
    # --- load_drafter: checkpoint files
    ("drafter dir missing", lambda e: load_drafter(e.tmp / "nowhere"),
     r"checkpoint directory '.*nowhere' does not exist or is not a directory"),
    ("target dir given as drafter", lambda e: load_drafter(e.set_dir / "target"),
     r"not a DFlash drafter checkpoint \(architectures \['Qwen3ForCausalLM'\]\).*loaded with load_target instead"),
    ("drafter weights missing", lambda e: drafter_load(e, edit=lambda d: (d / "model.safetensors").unlink()),
     r"drafter: no weights found; expected model.safetensors or model.safetensors.index.json"),
    ("drafter weights truncated", lambda e: drafter_load(e, edit=truncate(0.5)),
     r"model.safetensors: cannot read safetensors file: truncated \(header describes \d+ bytes, the file has \d+\); "
     r"re-download or re-export it"),
    ("drafter weights cut inside the header", lambda e: drafter_load(e, edit=truncate(keep_bytes=20)),
     r"model.safetensors: cannot read safetensors file: truncated inside its header \(20 bytes\); re-download"),
    ("drafter weights with trailing bytes", lambda e: drafter_load(e, edit=append_garbage),
     r"cannot read safetensors file: longer than its header says \(header describes \d+ bytes.*\); re-download"),
    ("drafter shard missing", lambda e: drafter_load(e, edit=missing_shard),
     r"shards listed in model.safetensors.index.json are missing: \['model-00002-of-00002.safetensors'\]; "
     r"re-download or re-export"),
    # --- load_drafter: config.json
    ("drafter config not JSON", lambda e: drafter_load(e, edit=write_config("{oops")),
     r"config.json: cannot read JSON"),
    ("drafter config a list", lambda e: drafter_load(e, edit=write_config("[1, 2]")),
     r"config.json: must hold a JSON object of config fields, got a list; re-export"),
    ("drafter hidden_size string", lambda e: drafter_load(e, config={"hidden_size": "32"}),
     r"config field 'hidden_size' must be an integer, got str '32'; fix it in the config"),
    ("drafter num_hidden_layers float", lambda e: drafter_load(e, config={"num_hidden_layers": 2.5}),
     r"config field 'num_hidden_layers' must be an integer, got float 2.5; fix it in the config"),
    ("drafter block_size string", lambda e: drafter_load(e, config={"block_size": "8"}),
     r"config field 'block_size' must be an integer, got str '8'; fix it in the config"),
    ("drafter block_size 1", lambda e: drafter_load(e, config={"block_size": 1}),
     r"drafter block_size must be an integer >= 2 \(one anchor plus at least one drafted position\), got 1"),
    ("drafter block_size missing", lambda e: drafter_load(e, config={"block_size": None}),
     r"config field 'block_size' is missing; add it to the config"),
    ("drafter rms_norm_eps string", lambda e: drafter_load(e, config={"rms_norm_eps": "1e-6"}),
     r"config field 'rms_norm_eps' must be a number, got str '1e-6'; fix it in the config"),
    ("drafter rope_theta string", lambda e: drafter_load(e, config={"rope_theta": "ten"}),
     r"config field 'rope_theta' must be a number, got str 'ten'; fix it in the config"),
    ("drafter mask_token_id string", lambda e: drafter_load(e, config={"dflash_config.mask_token_id": "2"}),
     r"dflash_config.mask_token_id must be an integer token id .*, got '2'"),
    ("drafter target_layer_ids string", lambda e: drafter_load(e, config={"dflash_config.target_layer_ids": "0,1"}),
     r"dflash_config.target_layer_ids must be a list of integers, got '0,1'"),
    # --- load_scorer
    ("scorer dir missing", lambda e: load_scorer(e.tmp / "nowhere"), r"'.*nowhere' does not exist"),
    ("scorer weights truncated", lambda e: scorer_load(e, edit=truncate(0.9)),
     r"cannot read safetensors file: truncated \(header describes \d+ bytes, the file has \d+\); re-download"),
    ("scorer token_dim string", lambda e: scorer_load(e, config={"scorer_config.token_dim": "8"}),
     r"scorer token_dim must be a positive integer, got str '8'"),
    ("scorer horizon float", lambda e: scorer_load(e, config={"scorer_config.horizon": 7.0}),
     r"scorer horizon must be a positive integer, got float 7.0"),
    ("scorer unknown field", lambda e: scorer_load(e, config={"scorer_config.widht": 8}),
     r"unknown scorer_config fields \['widht'\]; remove them \(known: "),
    ("drafter dir given as scorer", lambda e: load_scorer(e.set_dir / "drafter"),
     r"not a TAPS scorer checkpoint \(architectures \['DFlashDraftModel'\]\); expected \['TapsScorer'\]"),
    # --- load_model_set: layout, target config.json types, parts that do not fit
    ("model set missing", lambda e: load_model_set(e.tmp / "nowhere"), r"model directory '.*nowhere' does not exist"),
    ("model set without target", lambda e: load_model_set(broken_set(e, edit=lambda d: shutil.rmtree(d / "target"))),
     r"no target/ subdirectory; a model set holds target/ and drafter/"),
    ("target hidden_size string", lambda e: set_load(e, config={"hidden_size": "32"}),
     r"target/config.json: config field 'hidden_size' must be an integer, got str '32'; fix it"),
    ("target num_hidden_layers float", lambda e: set_load(e, config={"num_hidden_layers": 2.5}),
     r"config field 'num_hidden_layers' must be an integer, got float 2.5; fix it"),
    ("target head_dim float", lambda e: set_load(e, config={"head_dim": 8.5}),
     r"config field 'head_dim' must be an integer, got float 8.5; fix it"),
    ("target vocab_size 0", lambda e: set_load(e, config={"vocab_size": 0}),
     r"target/config.json: model vocab_size must be a positive integer, got 0; fix the model config"),
    ("target tie_word_embeddings string", lambda e: set_load(e, config={"tie_word_embeddings": "false"}),
     r"config field 'tie_word_embeddings' must be true or false, got str 'false'; fix it"),
    ("target rope_scaling factor string", lambda e: set_load(e, config={"rope_scaling": {
        "rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
     r"\(rope scaling\): config field 'factor' must be a number, got str '8'; fix it"),
    ("target eos id float", lambda e: set_load(e, config={"eos_token_id": 2.5}),
     r"config.json: eos_token_id must be a token id or a list of them \(integers >= 0\), got float 2.5; fix it"),
    ("target eos id string in generation_config", lambda e: set_load(
        e, edit=lambda d: (d / "generation_config.json").write_text('{"eos_token_id": ["2"]}')),
     r"generation_config.json: eos_token_id must be a token id or a list of them .*, got str '2'; fix it"),
    ("model set with a drafter for another target", lambda e: set_load(e, "drafter", config={"num_target_layers": 3}),
     r"the model set's parts do not fit together: drafter was trained for a target with num_target_layers=3"
     r".*use a drafter trained for this target"),
    ("model set with a scorer for another pair", lambda e: set_load(e, "scorer", config={"scorer_config.vocab_size": 9}),
     r"the model set's parts do not fit together: scorer vocab_size=9 differs from the target's vocab_size=8"
     r".*train one for this pair"),
    ("model set with a truncated drafter", lambda e: set_load(e, "drafter", edit=truncate(0.5)),
     r"drafter/model.safetensors: cannot read safetensors file: truncated"),
    # --- taps-decode (in process; the console script turns the ValueError into one line + exit 2)
    ("cli NaN temperature", lambda e: decode_cli(e, "--temperature", "nan"),
     r"temperature must be a finite number >= 0 \(0 = greedy\), got nan"),
    ("cli top_p above 1", lambda e: decode_cli(e, "--temperature", "1", "--top-p", "1.5"),
     r"top_p must be in \(0, 1\] \(1 = off\), got 1.5"),
    ("cli negative top_k", lambda e: decode_cli(e, "--temperature", "1", "--top-k", "-1"),
     r"top_k must be an integer >= 0 \(0 = off\), got -1"),
    ("cli empty prompt", lambda e: cli.main(["--model", str(e.set_dir), "--prompt", ""]),
     r"--prompt is empty; give some text to continue"),
    ("cli taps scorer for another pair", lambda e: decode_cli(
        e, "--policy", "taps", "--scorer", str(broken_set(e, "scorer", config={"scorer_config.vocab_size": 9}))),
     r"scorer vocab_size=9 differs from the target's vocab_size=8"),
    ("cli truncated drafter", lambda e: decode_cli(e, "--drafter", str(broken_set(e, "drafter", edit=truncate(0.5)))),
     r"cannot read safetensors file: truncated"),
]

# A message says how to fix the input: one of these phrasings (besides "must be ...", which is checked per row).
FIX = re.compile(r"must be|must hold|choose|use |pass |fix|re-download|re-export|shorten|raise|lower|train|"
                 r"set |expected|load|add it|give|check|remove|drop|encode")


@pytest.mark.parametrize("case, call, message", CASES, ids=[c[0] for c in CASES])
def test_rejected_before_tracing(env, tmp_path, no_tracing, case, call, message):
    env.tmp = tmp_path
    with pytest.raises(ValueError) as err:
        call(env)
    text = str(err.value)
    assert re.search(message, text), f"{case}: message {text!r} does not match {message!r}"
    assert FIX.search(text), f"{case}: message {text!r} does not say how to fix the input"
    assert "\n" not in text, f"{case}: message spans several lines"
