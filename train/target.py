"""Pretrain the embedded default target (a small Qwen3) on the packed corpus.

    python -m train.target --out runs/default/target_train --preset default [--steps N]
        [--batch-size B] [--seq-len T] [--lr LR] [--resume] [--export-only] [--bench N]
        [--mesh DATA,MODEL] [--distributed ...]

--mesh: train data-parallel over "data" (the batch must divide it) and
tensor-parallel over "model" (heads, MLP, vocab); default one device,
'auto' = all devices on the data axis. Checkpoints resume on any mesh shape.

A preset is `train/presets/target_<name>.json` (shipped in the package; or a path to such a file) holding
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
from taps_jax import sharding
from taps_jax.api import Target
from taps_jax.checkpoints.tokenizer import Tokenizer
from taps_jax.config import ModelConfig
from taps_jax.models.transformer import Transformer
from train import loop
from train.preset import read_preset
from train import tokenizer as tokenizer_lib
from train.packing import PackedBatches, eval_batches, load_tokens

TRAIN_DEFAULTS = dict(
    batch_size=16, seq_len=512, steps=1000, seed=0, eval_every=250, eval_batches=16,
    log_every=10, checkpoint_every_s=600.0, keep=3,
)


def load_preset(name_or_path: str) -> dict:
    """train/presets/target_<name>.json (or a path to such a file)."""
    path, raw = read_preset("target", name_or_path)
    unknown = set(raw) - {"model", "optim", "train", "comment"}
    if unknown:
        raise ValueError(f"{path}: unknown sections {sorted(unknown)}; use model, optim, train")
    return raw


def lm_loss_fn(graphdef):
    """(params, batch [B, T+1] int32) -> (mean next-token cross-entropy, {})."""

    def loss_fn(params, batch_BT1):
        inputs_BT, targets_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
        logits_BTV = nnx.merge(graphdef, params).logits(inputs_BT)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()
        return loss, {}

    return loss_fn


def build(preset: dict, vocab_size: int, overrides: dict):
    """(ModelConfig, OptimConfig, train settings) from a preset plus CLI overrides."""
    model_cfg = ModelConfig(**{"family": "qwen3", **preset.get("model", {}), "vocab_size": vocab_size})
    train = {**TRAIN_DEFAULTS, **preset.get("train", {})}
    train.update({k: v for k, v in overrides.items() if v is not None and k in train})
    optim = {**preset.get("optim", {}), "total_steps": train["steps"]}
    if overrides.get("lr") is not None:
        optim["lr"] = overrides["lr"]
    if overrides.get("warmup_steps") is not None:
        optim["warmup_steps"] = overrides["warmup_steps"]
    optim_cfg = loop.OptimConfig(**optim)
    optim_cfg = dataclasses.replace(optim_cfg, warmup_steps=min(optim_cfg.warmup_steps, max(1, train["steps"] // 10)))
    return model_cfg, optim_cfg, train


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
    p = argparse.ArgumentParser(description="Pretrain the default target model.")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", default="default")
    p.add_argument("--tokenizer", type=Path, default=Path("runs/default/tokenizer"))
    p.add_argument("--tokens", type=Path, default=Path("runs/default/tokens"), help="token cache dir")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--checkpoint-every-s", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --out")
    p.add_argument("--export-only", action="store_true",
                   help="skip training: export the best (else latest) checkpoint under --out to --out/export")
    p.add_argument("--bench", type=int, default=0, metavar="N", help="time N steps after compiling, then exit")
    sharding.add_mesh_args(p)
    args = p.parse_args(argv)
    try:
        check_output_path(args.out, directory=True)  # before any work
        return _main(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(args) -> int:
    mesh = sharding.setup_mesh(args)
    tokenizer_file = args.tokenizer / tokenizer_lib.TOKENIZER_FILE if args.tokenizer.is_dir() else args.tokenizer
    vocab = tokenizer_lib.load_tokenizer(tokenizer_file).get_vocab_size()
    preset = load_preset(args.preset)
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                 "lr": args.lr, "warmup_steps": args.warmup_steps, "eval_every": args.eval_every,
                 "checkpoint_every_s": args.checkpoint_every_s, "seed": args.seed}
    model_cfg, optim_cfg, tr = build(preset, vocab, overrides)
    B, T = tr["batch_size"], tr["seq_len"]
    sharding.check_config(model_cfg, mesh, "target")
    if B % sharding.data_size(mesh):
        raise ValueError(f"--batch-size {B} is not divisible by the mesh's data axis ({sharding.data_size(mesh)})")

    model = Transformer(model_cfg, nnx.Rngs(tr["seed"]))
    graphdef, params = nnx.split(model)
    n_params = count_params(params)
    n_embed = model_cfg.vocab_size * model_cfg.hidden_size
    print(f"model: {model_cfg}\nparams: {n_params:,} ({n_params - n_embed:,} non-embedding)  "
          f"batch {B}x{T} = {B * T:,} tokens/step  steps {tr['steps']}  optim {optim_cfg}", flush=True)

    loss_fn = lm_loss_fn(graphdef)
    optimizer = loop.make_optimizer(optim_cfg)
    train_step = loop.make_train_step(loss_fn, optimizer, mesh)
    state = loop.shard_state(loop.TrainState.create(params, optimizer), mesh)
    params = state.params
    train_tokens = load_tokens("train", tokenizer_file, args.tokens)
    batches = PackedBatches(train_tokens, B, T, seed=tr["seed"])

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
        return 0

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
        return 0

    val_tokens = load_tokens("validation", tokenizer_file, args.tokens)
    val = eval_batches(val_tokens, B, T, max_batches=tr["eval_batches"])
    # Host arrays on a mesh (split over "data" by make_eval_fn), device arrays on one device.
    evaluate = loop.make_eval_fn(loss_fn, [np.asarray(b) if mesh else jnp.asarray(b) for b in val], mesh)
    args.out.mkdir(parents=True, exist_ok=True)
    run_info = {"model": dataclasses.asdict(model_cfg), "optim": dataclasses.asdict(optim_cfg), "train": tr,
                "params": n_params, "train_tokens": int(len(train_tokens)),
                "val_tokens_evaluated": int(len(val) * B * T), "preset": args.preset}
    (args.out / "run.json").write_text(json.dumps(run_info, indent=2, default=str))
    print(f"train tokens {len(train_tokens):,}; {tr['steps'] * B * T / len(train_tokens):.2f} epochs; "
          f"validation on {len(val)} batches", flush=True)

    cfg = loop.LoopConfig(
        total_steps=tr["steps"], tokens_per_step=B * T, log_every=tr["log_every"], eval_every=tr["eval_every"],
        checkpoint_every_s=tr["checkpoint_every_s"], keep=tr["keep"],
    )
    try:
        result = loop.run(cfg, state, train_step, batches.batch_at, args.out, evaluate=evaluate, resume=args.resume,
                          meta={"preset": args.preset}, optim=optim_cfg, desc="target", mesh=mesh)
    except KeyboardInterrupt:
        return 130
    final = result.best_params if result.best_params is not None else result.state.params
    which = f"best validation (step {result.best_step}, loss {result.best_val:.4f})" if result.best_params is not None else "final"
    out = export(args.out / "export", nnx.merge(graphdef, final), tokenizer_file)
    print(f"exported the {which} params to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
