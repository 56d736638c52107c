"""Pretrain the embedded default target (a small Qwen3) on the packed corpus.

    python -m train.target --out runs/default/target_train --preset default [--steps N]
        [--batch-size B] [--seq-len T] [--lr LR] [--resume] [--export-only] [--bench N]
        [--mesh DATA,MODEL] [--distributed ...]

--mesh: train data-parallel over "data" (the batch must divide it) and
tensor-parallel over "model" (heads, MLP, vocab); default one device,
'auto' = all devices on the data axis. Checkpoints resume on any mesh shape.

A preset is `configs/train/target_<name>.json` (shipped in the package; or a path to such a file) holding
`model` (ModelConfig fields; vocab_size comes from the tokenizer), `optim`
(OptimConfig fields) and `train` (batch_size, seq_len, steps, eval_every, ...).
Command-line flags override the preset.

Writes under --out: checkpoints/ (orbax, last N, resumable), best/ (best
validation params), metrics.csv, loss.png, run.json, and at the end export/:
the best-validation params in the Hugging Face layout (config.json,
model.safetensors, tokenizer.json, generation_config.json with eos = 0),
loadable by `taps_jax.load_target` and transformers' AutoModelForCausalLM.

--export-only re-exports the best (else latest) checkpoint of an existing
--out without training (e.g. after stopping a run early).

--bench N compiles the step, times N steps, prints tokens/s and exits
(nothing is written).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from decode.common import check_output_path
from taps_jax import compile_cache, sharding
from taps_jax.api import Target
from taps_jax.checkpoints.tokenizer import Tokenizer
from taps_jax.config import ModelConfig
from taps_jax.models.transformer import Transformer
from train import corpus, loop
from train import data as data_lib
from train.config import add_flags, build, option
from train.preset import add_preset_flag, read_preset
from train import tokenizer as tokenizer_lib
from train.packing import PackedBatches, eval_batches, load_tokens


@dataclasses.dataclass(frozen=True)
class TargetTrain:
    """The preset's "train" section."""

    batch_size: int = option(16, "windows per step")
    seq_len: int = option(512, "tokens per window")
    steps: int = option(1000, "optimizer steps")
    seed: int = option(0, "initialisation and data-order seed")
    eval_every: int = option(250, "validate every N steps")
    eval_batches: int = option(16, "validation batches (evenly spaced over the split)")
    log_every: int = option(10, "log every N steps")
    checkpoint_every_s: float = option(600.0, "seconds between checkpoints")
    keep: int = option(3, "checkpoints kept")


@dataclasses.dataclass(frozen=True)
class TargetSettings:
    """A target preset: `model` (ModelConfig fields but vocab_size, which the tokenizer gives), `optim`, `train`."""

    model: dict = dataclasses.field(default_factory=dict)
    optim: loop.OptimConfig = loop.OptimConfig()
    train: TargetTrain = TargetTrain()


def load_preset(name_or_path: str, args=None) -> TargetSettings:
    """configs/train/target_<name>.json (or a path to such a file) over the defaults, then the flags in `args`."""
    path, raw = read_preset("target", name_or_path)
    return build(TargetSettings, raw, args, str(path))


def lm_loss_fn(graphdef):
    """(params, batch [B, T+1] int32) -> (mean next-token cross-entropy, {})."""

    def loss_fn(params, batch_BT1):
        inputs_BT, targets_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
        logits_BTV = nnx.merge(graphdef, params).logits(inputs_BT)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()
        return loss, {}

    return loss_fn


def configs(settings: TargetSettings, vocab_size: int) -> tuple[ModelConfig, loop.OptimConfig, TargetTrain]:
    """(ModelConfig, OptimConfig spanning the run's steps, run settings) of a preset."""
    model_cfg = ModelConfig(**{"family": "qwen3", **settings.model, "vocab_size": vocab_size})
    tr = settings.train
    optim = dataclasses.replace(settings.optim, total_steps=tr.steps,
                                warmup_steps=min(settings.optim.warmup_steps, max(1, tr.steps // 10)))
    return model_cfg, optim, tr


def count_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def export(out: Path, model: Transformer, tokenizer_path: Path) -> Path:
    """Write the HF layout (+ tokenizer.json, generation_config.json) to out."""
    tok = Tokenizer.from_file(tokenizer_path, (tokenizer_lib.EOS_ID,))
    Target(model, tok, (tokenizer_lib.EOS_ID,)).save(out)
    # Target.save puts eos_token_id in config.json; generation_config.json is
    # what HF generate() and `stop_ids` prefer.
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": tokenizer_lib.EOS_ID, "pad_token_id": tokenizer_lib.PAD_ID,
        "bos_token_id": tokenizer_lib.EOS_ID,
    }, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m train.target",
        description="Pretrain a Qwen3 target from scratch (the embedded default's stage). Data: --corpus DIR "
                    "(default: this interpreter's standard library, as the embedded recipe uses) or --prompts "
                    "FILE.jsonl (each line's prompt + response is one document). The model lands in OUT/export.")
    p.add_argument("--out", type=Path, required=True,
                   help="training dir (checkpoints, metrics); the model is exported to OUT/export (HF layout)")
    add_preset_flag(p, "target", "trains in seconds")
    p.add_argument("--tokenizer", type=Path, default=Path("runs/default/tokenizer"),
                   help="tokenizer.json or its directory (its vocabulary sizes the model)")
    p.add_argument("--tokens", type=Path, default=Path("runs/default/tokens"),
                   help="token cache dir of --corpus (a cache per split, tokenizer and file list)")
    data_lib.add_data_flags(
        p, prompts='pretrain on a JSONL file instead of a corpus: {"prompt": ...} lines, optionally with "response" '
                   '("ids" / "response_ids" lines: token ids); each line is one document followed by EOS',
        corpus="pretrain on the .py files under DIR (split by file path hash; default: this interpreter's "
               "standard library)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out share of --prompts lines")
    add_flags(p, TargetSettings)  # every preset setting, with its help and default, from the dataclasses
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --out")
    p.add_argument("--export-only", action="store_true",
                   help="skip training: export the best (else latest) checkpoint under --out to --out/export")
    p.add_argument("--bench", type=int, default=0, metavar="N", help="time N steps after compiling, then exit")
    sharding.add_mesh_args(p)
    compile_cache.add_flag(p)
    args = p.parse_args(argv)
    try:
        compile_cache.setup(args)
        check_output_path(args.out, directory=True)  # before any work
        config = TargetRun(out=args.out, settings=load_preset(args.preset, args), tokenizer=args.tokenizer,
                           tokens=args.tokens, corpus=args.corpus, prompts=args.prompts, val_prompts=args.val_prompts,
                           val_fraction=args.val_fraction, preset=args.preset, resume=args.resume,
                           export_only=args.export_only, bench=args.bench)
        run(config, sharding.setup_mesh(args))
        return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


@dataclasses.dataclass(frozen=True)
class TargetRun:
    """One pretraining run: where to write, the settings (`TargetSettings`), the tokenizer and the data."""

    out: Path
    settings: TargetSettings = TargetSettings()
    tokenizer: Path = Path("runs/default/tokenizer")
    tokens: Path = Path("runs/default/tokens")  # token cache of the corpus
    corpus: Path | None = None  # None: $TAPS_CORPUS_ROOT or this interpreter's stdlib
    prompts: Path | None = None  # documents instead of a corpus
    val_prompts: Path | None = None
    val_fraction: float = 0.05
    preset: str = "default"  # the preset's name, recorded in the checkpoints
    resume: bool = False
    export_only: bool = False
    bench: int = 0  # time N steps and exit


def document_stream(examples, tokenizer, vocab: int, eos_id: int, source: str) -> np.ndarray:
    """Every example's prompt + response tokens followed by EOS, as one stream. int32 [n_tokens]"""
    parts = []
    for ids, response in data_lib.encode_examples(examples, tokenizer, vocab, source):
        parts += [ids, response or [], [eos_id]]
    return np.concatenate([np.asarray(p, np.int32) for p in parts])


def read_documents(args, tokenizer_file: Path, vocab: int):
    """(train, validation) token streams from --prompts, or None for the corpus; refusals first."""
    if args.prompts is None:
        if args.val_prompts is not None:
            raise ValueError("--val-prompts goes with --prompts")
        if args.corpus is not None and not args.corpus.is_dir():
            raise ValueError(f"--corpus {args.corpus} is not a directory; give a tree of .py files")
        return None
    if args.corpus is not None:
        raise ValueError("give --prompts or --corpus, not both")
    train, val = data_lib.read_split(args.prompts, args.val_prompts, args.val_fraction)
    if not val:
        raise ValueError(f"{args.prompts}: no line fell in the validation split; raise --val-fraction or give "
                         f"--val-prompts")
    tok = Tokenizer.from_file(tokenizer_file)
    return (document_stream(train, tok, vocab, tokenizer_lib.EOS_ID, str(args.prompts)),
            document_stream(val, tok, vocab, tokenizer_lib.EOS_ID, str(args.val_prompts or args.prompts)))


def run(config: TargetRun, mesh=None) -> Path | None:
    """Pretrain (or export, or bench) as `config` says; returns the exported model dir (None after bench)."""
    args = config  # the run config carries the same names as the CLI flags
    check_output_path(args.out, directory=True)  # before any work
    tokenizer_file = args.tokenizer / tokenizer_lib.TOKENIZER_FILE if args.tokenizer.is_dir() else args.tokenizer
    vocab = tokenizer_lib.load_tokenizer(tokenizer_file).get_vocab_size()
    documents = read_documents(args, tokenizer_file, vocab)
    model_cfg, optim_cfg, tr = configs(config.settings, vocab)
    B, T = tr.batch_size, tr.seq_len
    sharding.check_config(model_cfg, mesh, "target")
    if B % sharding.data_size(mesh):
        raise ValueError(f"--batch-size {B} is not divisible by the mesh's data axis ({sharding.data_size(mesh)})")

    model = Transformer(model_cfg, nnx.Rngs(tr.seed))
    graphdef, params = nnx.split(model)
    n_params = count_params(params)
    n_embed = model_cfg.vocab_size * model_cfg.hidden_size
    print(f"model: {model_cfg}\nparams: {n_params:,} ({n_params - n_embed:,} non-embedding)  "
          f"batch {B}x{T} = {B * T:,} tokens/step  steps {tr.steps}  optim {optim_cfg}", flush=True)

    loss_fn = lm_loss_fn(graphdef)
    optimizer = loop.make_optimizer(optim_cfg)
    train_step = loop.make_train_step(loss_fn, optimizer, mesh)
    state = loop.shard_state(loop.TrainState.create(params, optimizer), mesh)
    params = state.params
    if documents is not None:
        train_tokens, val_tokens = documents
    else:
        with corpus.root_override(args.corpus):
            train_tokens = load_tokens("train", tokenizer_file, args.tokens)
            val_tokens = load_tokens("validation", tokenizer_file, args.tokens)
    batches = PackedBatches(train_tokens, B, T, seed=tr.seed)

    if args.export_only:
        ckpt = loop.Checkpointer(args.out)
        best = ckpt.restore_best(params)
        if best is not None:
            final, info = best[0], f"best validation (step {best[1]['step']}, loss {best[1]['val_loss']:.4f})"
        elif ckpt.latest_step() is not None:
            restored, saved = ckpt.restore(state)
            final, info = restored.params, f"latest (step {saved['step']})"
        else:
            raise ValueError(f"no checkpoint under {args.out}; train first")
        ckpt.close()
        out = export(args.out / "export", nnx.merge(graphdef, final), tokenizer_file)
        print(f"exported the {info} params to {out}", flush=True)
        return out

    if args.bench:
        t = time.perf_counter()
        state, m = train_step(state, batches.batch_at(0))
        jax.block_until_ready(m)
        print(f"compile + first step: {time.perf_counter() - t:.1f}s", flush=True)
        t, c = time.perf_counter(), time.process_time()
        for s in range(1, args.bench + 1):
            state, m = train_step(state, batches.batch_at(s))
        jax.block_until_ready(m)
        dt, cpu = time.perf_counter() - t, time.process_time() - c
        print(f"BENCH {model_cfg.num_layers}x{model_cfg.hidden_size} ffn {model_cfg.intermediate_size} "
              f"heads {model_cfg.num_heads}/{model_cfg.num_kv_heads} B{B} T{T}: params {n_params:,}  "
              f"{dt / args.bench:.3f} s/step  {args.bench * B * T / dt:,.0f} tok/s  "
              f"{args.bench * B * T / cpu:,.0f} tok per CPU-s  loss {float(m['loss']):.3f}")
        return None

    val = eval_batches(val_tokens, B, T, max_batches=tr.eval_batches)
    # Host arrays on a mesh (split over "data" by make_eval_fn), device arrays on one device.
    evaluate = loop.make_eval_fn(loss_fn, [np.asarray(b) if mesh else jnp.asarray(b) for b in val], mesh)
    args.out.mkdir(parents=True, exist_ok=True)
    run_info = {"model": dataclasses.asdict(model_cfg), "optim": dataclasses.asdict(optim_cfg),
                "train": dataclasses.asdict(tr),
                "params": n_params, "train_tokens": int(len(train_tokens)),
                "val_tokens_evaluated": int(len(val) * B * T), "preset": args.preset}
    (args.out / "run.json").write_text(json.dumps(run_info, indent=2, default=str))
    print(f"train tokens {len(train_tokens):,}; {tr.steps * B * T / len(train_tokens):.2f} epochs; "
          f"validation on {len(val)} batches", flush=True)

    cfg = loop.LoopConfig(
        total_steps=tr.steps, tokens_per_step=B * T, log_every=tr.log_every, eval_every=tr.eval_every,
        checkpoint_every_s=tr.checkpoint_every_s, keep=tr.keep,
    )
    result = loop.run(cfg, state, train_step, batches.batch_at, args.out, evaluate=evaluate, resume=args.resume,
                      meta={"preset": args.preset}, optim=optim_cfg, desc="target", mesh=mesh)
    final = result.best_params if result.best_params is not None else result.state.params
    which = f"best validation (step {result.best_step}, loss {result.best_val:.4f})" if result.best_params is not None else "final"
    out = export(args.out / "export", nnx.merge(graphdef, final), tokenizer_file)
    print(f"exported the {which} params to {out}", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
