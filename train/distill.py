"""Distil a DFlash block-diffusion drafter from a frozen target (DESIGN section 4).

    python -m train.distill --target DIR --out DIR (--prompts FILE.jsonl [--val-prompts FILE.jsonl] | --corpus DIR)
        [--preset default|tiny|FILE] [--mask-token-id ID] [--gen-tokens T] [--layers L] [--block-size 16]
        [--steps N] [--batch-size B] [--anchors-per-seq A] [--resume] [--export-only] [--bench N]

Every setting is a field of `DistillSettings` (drafter / data / optim /
train sections): a preset file's sections, overridden by flags.

Pipeline (data: train/distill_data.py, objective and metrics:
train/distill_objective.py; settings, the run, the CLI and --bench: here)
--------
1. Data: your prompts (--prompts, train.data), or function-signature prompts
   from a corpus TRAIN split (--corpus: the embedded recipe), continued by
   the target's own batched AR generator (`Target.generate`). A fraction
   (`--greedy-fraction`, default 0.5) is greedy (the decode-time distribution
   of greedy decoding), the rest sampled at `--temperature` (0.9: diversity,
   and the distribution of sampled decoding). Validation continuations are
   greedy, from prompts of `--val-split` (default "validation": held out from
   training, and not the "heldout" split, whose prompts are the decode
   benchmark's, so best-checkpoint selection never looks at benchmark
   prompts). Sequences are cached under <out>/data/<split>-<key>/ as .npy
   (tokens, prompt_lens, lengths); the key hashes the target's weights and
   every generation setting, so a rerun (or --resume) skips generation, and
   an interrupted generation resumes from its finished chunks.
2. Tap features: by default computed ON THE FLY inside the jitted step, one
   frozen target forward per sequence (causal mask, `taps=target_layer_ids`,
   the lm head skipped): exactly what decoding sees, and no storage. More
   anchors per sequence amortise it (32 anchors: ~22% of a step for the
   default set's 6-layer target). For a real target it dominates the step
   (SmolLM2-135M: 50-70%), and every pass after the first repeats it:
   `tap_cache` (the train section) computes every sequence's features once
   into <out>/data/rows-<split>-<key>.npy (each row's real positions back to
   back, [sum of lengths, n_taps * D] float32, read as a memmap; the key hashes
   the weights, tap ids and tokens) and the step reads them. Same forward, same features (tested against the in-step path).
3. Objective: per sequence, A anchors are sampled without replacement; block
   j is [tok[a_j], MASK x H] at positions a_j .. a_j + H. All blocks of a
   sequence run in ONE `Drafter.forward_blocks`, where block j sees the
   context features at positions < a_j (strictly: the anchor's own features
   arrive one round later at decode time) and its own block, nothing else
   (`anchor_block_mask`, keyed on anchor positions; the blocks never score
   each other's keys). Loss: cross-entropy of
   slot k against tok[a_j + k], k = 1..H, weighted w_k = exp(-(k-1)/gamma),
   normalised by the weight sum. gamma = 7 for Kb = 16 (DFlash) and, for
   other block sizes, 7 * (Kb - 1) / 15, so the weight at the LAST drafted
   slot is always exp(-(H-1)/gamma) ~ e^-2 (the same relative emphasis over
   the block). The drafter has no embedding or head: block embeddings and
   logits use the target's frozen tables (they are not in the trained
   params at all).
4. Anchors (`--anchor-region continuation`, the default): positions
   prompt_len <= a <= length - Kb, i.e. the anchor is itself a target token
   (as the bonus token is at decode time) and all H labels are
   target-generated, so labels match what verification accepts. The prompt
   still serves as context, as at decode time. `all` also anchors inside the
   prompt, whose tokens are real text, not the target's (more data, but
   labels that verification would not produce). Sequences cut short by EOS
   so that no anchor fits fall back to anchors in [prompt_len, length - 2]
   with the labels past the end masked.
5. Training: `train.loop` (AdamW lr 6e-4, warmup 4%, cosine, clip 1.0,
   orbax resume, progress with tokens/s + ETA, metrics.csv, loss.png).
   `batch_at(step)` is a pure function of the step (sequence order and
   anchors are seeded by (seed, epoch) and (seed, step)), so --resume is
   bit-exact. "tokens" in tokens/s are supervised draft positions
   (batch x anchors x H).
6. Validation (every eval): weighted CE (selects the best checkpoint), and
   per-position top-1 agreement acc_k of the drafter with the target's
   greedy continuation, k = 1..H, with their mean, the expected chain
   acceptance length tau = 1 + sum_k prod_{i<=k} acc_i (what the decoder's
   stats call tau: accepted tokens per round, bonus included, assuming
   independent positions), and the empirical chain tau (1 + mean number of
   leading matches per block; that is what greedy chain decoding would get
   on these contexts). Written to val_agreement.csv and agreement.png.
7. Export: the best-validation (else final) params in the DFlash layout
   (`save_drafter`) at <out>/export, loadable by `taps_jax.decoder.load_drafter`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
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
from taps_jax.api import Target, load_target
from taps_jax.checkpoints.dflash import save_drafter
from taps_jax.config import DrafterConfig, ModelConfig, llama3_rope
from taps_jax.models.drafter import Drafter
from train import loop
from train.config import add_flags, build, option
from train.preset import add_preset_flag, read_preset
from train.data import (PROMPT_DIGESTS, Example, add_data_flags, encode_examples, read_examples, read_split,
                        resolve_mask_token, write_prompt_digests)
# Re-exported: train.distill is the stage's public face (data and objective live in their own modules).
from train.distill_data import (  # noqa: F401
    AnchorBatches, Sequences, anchor_range, fit_draft_vocab, generate_sequences, label_tokens, params_fingerprint,
    sample_anchors, sequences_from_pairs, tap_features, target_feature_cache, vocab_coverage)
from train.distill_objective import (  # noqa: F401
    anchor_block_mask, block_forward, block_tokens, default_gamma, labels_and_weights, make_evaluator,
    make_forward, make_loss_fn, plot_agreement, position_weights, soft_targets_at, summarize, target_features,
    target_taps)
from train.tokenizer import MASK_ID

ANCHOR_REGIONS = ("continuation", "all")


# --------------------------------------------------------------------------- settings

def spread_taps(num_target_layers: int, num_taps: int = 3) -> tuple[int, ...]:
    """Target layers to tap: evenly spread over [1, L-1] (shallow to the final layer).

    DFlash's default (`default_target_layer_ids`) spreads over [1, L-3]; for a
    36-layer target that spans 94% of the depth, but for the 6-layer default
    target it would stop at layer 3. Spreading over [1, L-1] keeps the
    shallow-to-deep spread for small targets: 6 layers, 3 taps -> (1, 3, 5).
    """
    L = num_target_layers
    if L == 1:
        return (0,)
    n = max(1, min(num_taps, L - 1))
    if n == 1:
        return (L // 2,)
    return tuple(dict.fromkeys(int(round(1 + i * (L - 2) / (n - 1))) for i in range(n)))


def make_drafter_config(
    target: ModelConfig,
    *,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: tuple[int, ...] | None = None,
    num_taps: int = 3,
    mask_token_id: int = MASK_ID,
    intermediate_size: int | None = None,
    dtype: str = "float32",
    draft_vocab_size: int | None = None,
) -> DrafterConfig:
    """A drafter shaped like one of the target's layers (same width, heads, rope), checked against it."""
    # A drafter's config.json holds Llama-3 scaling only: train with the rope it is saved with.
    rope = llama3_rope(target.rope_scaling, "the target's", "no drafter for it could be saved")
    config = DrafterConfig(
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_layers=num_layers,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(target_layer_ids or spread_taps(target.num_layers, num_taps)),
        num_target_layers=target.num_layers,
        vocab_size=target.vocab_size,
        rope_theta=target.rope_theta,
        rope_scaling=rope,
        rms_norm_eps=target.rms_norm_eps,
        dtype=dtype,
        draft_vocab_size=draft_vocab_size,
    )
    config.check_target(target)
    return config


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Objective and loop settings: the preset's "train" section (the optimizer is `DistillOptim`)."""

    steps: int = option(2000, "optimizer steps")
    batch_size: int = option(8, "sequences per step")
    anchors_per_seq: int = option(16, "draft blocks per sequence per step, all in one forward")
    gamma: float | None = option(None, "loss-weight decay (default: 7 * (Kb - 1) / 15)")
    anchor_region: str = option("continuation", "where blocks may start: in the target's continuation "
                                "(labels are target tokens) or anywhere", choices=ANCHOR_REGIONS)
    seed: int = option(0, "initialisation, data order and sampling seed")
    data_seed: int | None = option(None, "seed of the training batches' order and anchors alone (default: seed); "
                                         "a leg that trains again on its predecessor's answers sets its own, so "
                                         "it draws other rows without regenerating them")
    log_every: int = option(10, "log every N steps")
    eval_every: int = option(250, "validate every N steps (0: only at the end)")
    checkpoint_every_s: float = option(600.0, "seconds between checkpoints")
    keep: int = option(3, "checkpoints kept")
    tap_cache: bool = option(False, "compute the frozen target's tap features of every sequence the run draws "
                                    "once and keep them on disk (<out>/data/rows-*.npy, each row's positions x "
                                    "taps x D float32) instead of in every step")
    soft_top_k: int = option(0, "soft targets: the target's top-k next-token probabilities at every "
                                "supervised position join the loss (0: hard labels only); computed in the tap "
                                "forward (cached beside the taps with --tap-cache)")
    soft_weight: float = option(0.5, "with --soft-top-k: the soft targets' share of each position's loss")

    def __post_init__(self):
        for name in ("steps", "batch_size", "anchors_per_seq"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        d = self.data_seed
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise ValueError(f"data_seed must be a non-negative integer (or null: the seed), got {d!r}")
        if self.anchor_region not in ANCHOR_REGIONS:
            raise ValueError(f"anchor_region must be one of {ANCHOR_REGIONS}, got {self.anchor_region!r}")
        k = self.soft_top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"soft_top_k must be a non-negative integer (0: off), got {k!r}")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise ValueError(f"soft_weight must lie in [0, 1], got {self.soft_weight!r}")


def _data_seed(config: DistillConfig) -> int:
    return config.seed if config.data_seed is None else config.data_seed


def distill_optim(steps: int, lr: float = 6e-4, warmup_ratio: float = 0.04, **kwargs) -> loop.OptimConfig:
    """The reported recipe: AdamW lr 6e-4, warmup 4% of the steps, cosine decay, clip 1.0."""
    kwargs = {"weight_decay": 0.01, "min_lr_ratio": 0.05, "clip_norm": 1.0, **kwargs}
    return loop.OptimConfig(lr=lr, warmup_steps=max(1, round(warmup_ratio * steps)), total_steps=steps, **kwargs)


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """The drafter's shape: the preset's "drafter" section (width, heads and rope follow the target)."""

    num_layers: int = option(1, "drafter layers", flag="--layers")
    block_size: int = option(16, "Kb (H = Kb - 1 drafted positions)")
    num_taps: int = option(3, "how many target layers to tap when --taps is not given")
    target_layer_ids: tuple[int, ...] | None = option(
        None, "target layer ids to tap, e.g. 1,3,5 (default: --num-taps spread over [1, L-1])", flag="--taps")
    mask_token_id: int | None = option(
        None, "the drafter's mask token: an id of the target's vocabulary that never occurs in the data "
              "(default: the tokenizer's mask special token, e.g. <|mask|>; refused if it has none)")
    intermediate_size: int | None = option(None, "drafter MLP width (default: the target's)")
    draft_vocab: int | None = option(
        None, "K: the drafter's logits cover only the K target ids its training answers use most (fitted on "
              "them, saved with the drafter); the head then costs K/V of the full one (default: the whole "
              "vocabulary)")
    init_from_target: bool = option(False, "start the drafter's layers and final norm as copies of the target's "
                                           "last layers and final norm (default: random)")
    init_drafter: str | None = option(
        None, "start from an exported drafter's weights (a DFlash-layout dir, e.g. a set's shipped drafter): the "
              "next leg of a training that spans sessions, with a fresh optimizer and its own warmup; the drafter "
              "settings must be the ones it was trained with (or more layers: it grows, computing the same at "
              "the start), and its draft vocabulary is kept", metavar="DIR")

    def __post_init__(self):
        if self.init_drafter is not None and self.init_from_target:
            raise ValueError("--init-drafter and --init-from-target both say where the drafter starts; give one")


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """How the training sequences are made: the preset's "data" section."""

    num_sequences: int = option(4096, "--corpus: train-split prompts to continue")
    gen_tokens: int = option(256, "tokens generated per prompt (given responses are cut to this length)")
    greedy_fraction: float = option(0.5, "share of greedy continuations (the rest sampled)")
    temperature: float = option(0.9, "temperature of the sampled continuations")
    gen_batch_size: int = option(64, "prompts per generation batch")
    val_sequences: int = option(128, "--corpus: validation prompts to continue")
    val_split: str = option("validation", "--corpus: split of the validation prompts",
                            choices=("validation", "heldout"))
    max_prompt_tokens: int | None = option(64, "keep the last N tokens of longer prompts")
    val_fraction: float = option(0.05, "--prompts without --val-prompts: held-out share of the lines "
                                       "(a stable hash of each line)")


@dataclasses.dataclass(frozen=True)
class DistillOptim:
    """The optimizer: the preset's "optim" section (AdamW, warmup, cosine decay, clipping)."""

    lr: float = option(6e-4, "peak learning rate")
    warmup_ratio: float = option(0.04, "warmup as a share of the steps")
    weight_decay: float = option(0.01, "AdamW weight decay")
    min_lr_ratio: float = option(0.05, "final learning rate / peak")
    clip_norm: float = option(1.0, "global gradient-norm clip")
    b1: float = option(0.9, "Adam beta1")
    b2: float = option(0.95, "Adam beta2")

    def optim(self, steps: int) -> loop.OptimConfig:
        return distill_optim(steps, **dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """Everything a distillation run is configured with: a preset file's sections, overridden by flags."""

    drafter: DrafterSpec = DrafterSpec()
    data: DataSpec = DataSpec()
    optim: DistillOptim = DistillOptim()
    train: DistillConfig = DistillConfig()


def distillation_prompt_texts(preset: str) -> set[str]:
    """The prompt texts that `--preset PRESET` distils on: prompt sets meant to
    measure the drafter (e.g. TAPS traces) must not contain them, since the
    drafter has seen the target's continuations of exactly these."""
    from train.corpus import build_prompts

    s = load_preset(preset)
    return {p["prompt"] for p in build_prompts("train", n=s.data.num_sequences, seed=s.train.seed)}


# --------------------------------------------------------------------------- training


@dataclasses.dataclass
class DistillSetup:
    drafter_graphdef: object
    buffers: nnx.State  # what is saved but not trained (the draft vocabulary): merge(graphdef, params, buffers)
    optimizer: optax.GradientTransformation
    train_step: object
    state: loop.TrainState
    batches: AnchorBatches
    forward: object
    loss_fn: object


def setup(target: Target, drafter: Drafter, train_seqs: Sequences, config: DistillConfig,
          optim: loop.OptimConfig, mesh=None, taps=None, soft=None) -> DistillSetup:
    """Everything `distill` needs, exposed for benchmarks and tests.

    taps: the train sequences' precomputed tap features (`tap_features`), or None (computed in each step);
    soft: their precomputed soft targets with taps (`target_feature_cache`).
    mesh: the drafter's params and optimizer state are sharded by the rules
    and each batch is split over "data" (batch_size must divide it).
    """
    dc = drafter.config
    dc.check_target(target.config)
    sharding.check_config(dc, mesh, "drafter")
    if config.batch_size % sharding.data_size(mesh):
        raise ValueError(f"batch size {config.batch_size} is not divisible by the mesh's data axis "
                         f"({sharding.data_size(mesh)})")
    graphdef, params, buffers = nnx.split(drafter, nnx.Param, ...)
    forward = make_forward(graphdef, target.graphdef, position_weights(dc.block_size, config.gamma), buffers,
                           config.soft_top_k)
    loss_fn = make_loss_fn(forward, config.soft_weight)
    optimizer = loop.make_optimizer(optim)
    batches = AnchorBatches(train_seqs, config.batch_size, config.anchors_per_seq, dc.block_size,
                            config.anchor_region, _data_seed(config), taps=taps, soft=soft)
    return DistillSetup(graphdef, buffers, optimizer, loop.make_train_step(loss_fn, optimizer, mesh),
                      loop.shard_state(loop.TrainState.create(params, optimizer), mesh), batches, forward, loss_fn)


def distill(
    target: Target,
    drafter: Drafter,
    train_seqs: Sequences,
    val_seqs: Sequences | None,
    out_dir: str | Path,
    config: DistillConfig = DistillConfig(),
    optim: loop.OptimConfig | None = None,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    meta: dict | None = None,
    mesh=None,
) -> loop.LoopResult:
    """Train `drafter` against the frozen `target` with `train.loop`; see the module docstring.

    stop_after: end the run after this many steps (checkpointed) while the LR
    schedule still spans config.steps (time-boxed runs, resume tests).
    Returns the loop's result; `result.best_params` are the best-validation params.
    mesh: train on a ("data", "model") mesh (see `setup`); the frozen target
    is sharded by the same rules.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    optim = optim or distill_optim(config.steps)
    taps = val_taps = soft = None
    if config.tap_cache:
        ids = drafter.config.target_layer_ids
        # Only the rows this run's schedule draws: a leg of 1,500 steps x 4 draws half of 11,618 answers.
        drawn = AnchorBatches(train_seqs, config.batch_size, config.anchors_per_seq, drafter.config.block_size,
                              config.anchor_region, _data_seed(config)).rows_drawn(config.steps)
        feats = target_feature_cache(target, train_seqs, ids, out_dir / "data", "train", config.soft_top_k,
                                     rows=drawn)
        taps, soft = feats.pop("taps"), feats
        if val_seqs is not None and len(val_seqs):
            val_taps = tap_features(target, val_seqs, ids, out_dir / "data", "validation")
    run = setup(target, drafter, train_seqs, config, optim, mesh, taps=taps, soft=soft)
    H = drafter.config.block_size - 1
    if mesh is not None:
        sharding.check_config(target.config, mesh, "target")
    tparams = sharding.shard_params(target.params, mesh)
    start = 0
    if resume:
        ck = loop.Checkpointer(out_dir)
        start = ck.latest_step() or 0
        ck.close()
    evaluate = None
    if val_seqs is not None and len(val_seqs):
        val_batches = AnchorBatches(val_seqs, config.batch_size, config.anchors_per_seq, drafter.config.block_size,
                                    "continuation", config.seed, taps=val_taps).fixed_batches()
        evaluate = make_evaluator(run.forward, val_batches, tparams, out_dir, H, start)

    total = config.steps if stop_after is None else min(stop_after, config.steps)
    cfg = loop.LoopConfig(
        total_steps=total, tokens_per_step=config.batch_size * config.anchors_per_seq * H,
        log_every=config.log_every, eval_every=config.eval_every,
        checkpoint_every_s=config.checkpoint_every_s, keep=config.keep,
    )
    return loop.run(cfg, run.state, run.train_step, run.batches.batch_at, out_dir, evaluate=evaluate, frozen={"target": tparams},
                    resume=resume,
                    meta=meta or {}, optim=optim, desc="distill", mesh=mesh)


def export(out: Path, drafter_graphdef, params, buffers: nnx.State | None = None) -> Path:
    """The drafter in the DFlash layout (config.json + model.safetensors); buffers: its untrained state (the
    draft vocabulary), when it has any."""
    save_drafter(nnx.merge(drafter_graphdef, params, *([] if buffers is None else [buffers])), out)
    return out


# --------------------------------------------------------------------------- CLI


def load_preset(name_or_path: str, args=None) -> DistillSettings:
    """configs/train/drafter_<name>.json (or a path) over the defaults, then the flags given in `args`."""
    path, raw = read_preset("drafter", name_or_path)
    return build(DistillSettings, raw, args, str(path))


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m train.distill",
        description="Distil a DFlash drafter from a target's own continuations of your prompts. Data: --prompts "
                    "FILE.jsonl (your prompts, optionally with responses) or --corpus DIR (function-signature "
                    "prompts from the .py files under DIR, split by file). The exported drafter lands in OUT/export.")
    p.add_argument("--target", type=Path, required=True,
                   help="target checkpoint dir (Hugging Face layout: config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--out", type=Path, required=True,
                   help="training dir (checkpoints, data cache, metrics); the drafter is exported to OUT/export")
    add_preset_flag(p, "drafter", "is a seconds-long smoke test")
    add_data_flags(p, prompts='JSONL, one {"prompt": "..."} or {"ids": [...]} per line (the target continues each), '
                              'or {"prompt": ..., "response": ...} / {"ids": ..., "response_ids": ...} '
                              '(continuations given: no generation). Every line is used',
                   corpus="instead of --prompts: a tree of .py files; prompts are function signatures of its train "
                          "split, validation prompts of its --val-split (split by file path hash)")
    add_flags(p, DistillSettings)  # every preset setting, with its help and default, from the dataclasses
    p.add_argument("--more-prompts", type=Path, nargs="+", default=[], metavar="FILE",
                   help="more training data beside --prompts, in its format (every line used): a file of prompts "
                        "is continued by the target as an answer set of its own, cached under its own key, so adding "
                        "a file to a run reuses the answers of the files it had; a file whose lines all have "
                        "responses is trained on as given (teacher-forced text, no generation)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --out")
    p.add_argument("--export-only", action="store_true", help="export the best (else latest) checkpoint and exit")
    p.add_argument("--bench", type=int, default=0, metavar="N",
                   help="time N train steps (and the target-tap forward alone) on random sequences, then exit")
    sharding.add_mesh_args(p)
    compile_cache.add_flag(p)
    return p.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class DistillRun:
    """One distillation run: the target, your data, where to write, and the settings (`DistillSettings`)."""

    target: Path
    out: Path
    settings: DistillSettings = DistillSettings()
    prompts: Path | None = None  # your prompts JSONL ...
    val_prompts: Path | None = None
    more_prompts: tuple[Path, ...] = ()  # more training prompts, each answered as a set of its own
    corpus: Path | None = None  # ... or a tree of .py files
    preset: str = "default"  # the preset's name, recorded in the checkpoints
    resume: bool = False
    export_only: bool = False
    bench: int = 0  # time N steps and exit


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        compile_cache.setup(args)
        check_output_path(args.out, directory=True)  # before any work
        config = DistillRun(target=args.target, out=args.out, settings=load_preset(args.preset, args),
                            prompts=args.prompts, val_prompts=args.val_prompts,
                            more_prompts=tuple(args.more_prompts), corpus=args.corpus, preset=args.preset,
                            resume=args.resume, export_only=args.export_only, bench=args.bench)
        run(config, sharding.setup_mesh(args))
        return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def read_data(args, data: dict, seed: int) -> tuple[list[Example], list[Example], list[list[Example]]]:
    """(train, validation, [each --more-prompts file's]) examples from --prompts/--val-prompts/--more-prompts or
    --corpus; checked before any model loads."""
    if (args.prompts is None) == (args.corpus is None):
        which = "both" if args.prompts is not None else "neither"
        raise ValueError(f"give your data with --prompts FILE.jsonl (prompts, optionally with responses) or --corpus "
                         f"DIR (a tree of .py files); got {which}")
    if args.val_prompts is not None and args.prompts is None:
        raise ValueError("--val-prompts goes with --prompts (--corpus takes its validation prompts from its own split)")
    if args.more_prompts and args.prompts is None:
        raise ValueError("--more-prompts goes with --prompts (the files beside it)")
    if args.prompts is not None:
        train, val = read_split(args.prompts, args.val_prompts, data.val_fraction)
        more, seen = [], {e.key: args.prompts for e in train} | {e.key: args.val_prompts or args.prompts for e in val}
        for path in args.more_prompts:
            examples = read_examples(path)
            again = next((e for e in examples if e.key in seen), None)
            if again is not None:
                raise ValueError(f"--more-prompts {path}: a line of it is also in {seen[again.key]} (and maybe more); "
                                 f"each prompt may be in one file only, so remove it from one")
            seen.update({e.key: path for e in examples})
            more.append(examples)
        return train, val, more
    if not args.corpus.is_dir():
        raise ValueError(f"--corpus {args.corpus} is not a directory; give a tree of .py files")
    from train.corpus import build_prompts

    def take(split, n, seed):
        return [Example(p["prompt"]) for p in build_prompts(split, n=n, seed=seed, root=args.corpus)]

    return take("train", data.num_sequences, seed), take(data.val_split, data.val_sequences, seed + 1), []


def init_from_target(drafter: Drafter, target) -> None:
    """The drafter's L layers start as the target's last L layers (attention, MLP, both norms; q/k norms where
    the target has them) and its final norm as the target's: its output then starts in the space the target's
    head reads. fc and hidden_norm stay random. target: the target `Transformer`."""
    L, T = drafter.config.num_layers, target.config.num_layers
    if L > T:
        raise ValueError(f"init_from_target: the drafter has {L} layers, the target only {T}")
    if drafter.config.intermediate_size != target.config.intermediate_size:
        raise ValueError(f"init_from_target needs the target's MLP width ({target.config.intermediate_size}); "
                         f"the drafter's is {drafter.config.intermediate_size}")
    names = ["input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
             *(f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj"))]
    if target.config.qk_norm:
        names += ["self_attn.q_norm", "self_attn.k_norm"]

    def module(root, dotted):
        for part in dotted.split("."):
            root = getattr(root, part)
        return root

    for mine, theirs in zip(drafter.layers, list(target.layers)[T - L:]):
        for name in names:
            src, dst = module(theirs, name), module(mine, name)
            for leaf in ("kernel", "weight"):
                if hasattr(dst, leaf):
                    getattr(dst, leaf).set_value(getattr(src, leaf).get_value().astype(getattr(dst, leaf).dtype))
    drafter.norm.weight.set_value(target.norm.weight.get_value().astype(drafter.norm.weight.dtype))


def init_from_drafter(drafter: Drafter, path: Path) -> np.ndarray | None:
    """The drafter starts as the exported drafter at `path` (weights and draft vocabulary), which must have the
    same config (dtype aside), or the same but fewer layers: then it grows (`grow_drafter`). Refused before any
    work otherwise. Returns its draft vocabulary ids (None: the whole vocabulary)."""
    from taps_jax.checkpoints.dflash import load_drafter_module, read_drafter_config

    theirs, mine = read_drafter_config(path, drafter.config.dtype), drafter.config
    grows = theirs.num_layers < mine.num_layers
    differ = [f"{f.name} {getattr(theirs, f.name)!r} (this run: {getattr(mine, f.name)!r})"
              for f in dataclasses.fields(mine)
              if getattr(theirs, f.name) != getattr(mine, f.name) and not (grows and f.name == "num_layers")]
    if differ:
        raise ValueError(f"--init-drafter {path}: that drafter was trained with other settings: {'; '.join(differ)}; "
                         f"train with the settings it was trained with (preset or flags; more layers may be "
                         f"asked for: the drafter grows), or start without it")
    source, _ = load_drafter_module(path, mine.dtype)
    if grows:
        grow_drafter(drafter, source)
        print(f"drafter: grown from {theirs.num_layers} to {mine.num_layers} layers; each new layer starts as a copy "
              f"of the last one with its output projections at zero, so it computes what {path} does", flush=True)
    else:
        nnx.update(drafter, nnx.state(source))
    return None if mine.draft_vocab_size is None else np.asarray(jax.device_get(source.draft_vocab[...]), np.int32)


def grow_drafter(drafter: Drafter, source: Drafter) -> None:
    """`drafter` (L layers) starts as `source` (n < L layers) with L - n layers appended, computing the same.

    Every part but the layer stack is the source's; layers i >= n are copies of
    the source's last layer whose residual writes (attention o_proj, MLP
    down_proj) are zero, so each starts as the identity on the residual stream
    and the grown drafter's draft equals the source's. Their reads (q, k, v,
    gate, up, norms) start where a trained layer is, not at random: the zero
    writes get a gradient at once, and the reads from the next step on.
    """
    n = len(source.layers)
    copy = lambda module: jax.tree.map(jnp.copy, nnx.state(module))  # own buffers: training donates them
    nnx.update(drafter.fc, copy(source.fc))
    nnx.update(drafter.hidden_norm, copy(source.hidden_norm))
    nnx.update(drafter.norm, copy(source.norm))
    if drafter.config.draft_vocab_size is not None:
        drafter.set_draft_vocab(jax.device_get(source.draft_vocab[...]))
    for i, layer in enumerate(drafter.layers):
        nnx.update(layer, copy(source.layers[min(i, n - 1)]))
        if i >= n:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.kernel.set_value(jnp.zeros_like(proj.kernel[...]))


DRAFT_VOCAB = "draft_vocab.json"  # in the training dir: the fitted ids, reused on resume and export


def draft_vocab(out: Path, train_seqs: Sequences, val_seqs: Sequences | None, dcfg: DrafterConfig,
                region: str, given: np.ndarray | None = None) -> np.ndarray:
    """The run's draft vocabulary: read back from OUT (a resumed run keeps its ids), else `given` (the ids of
    the drafter it starts from) or fitted on the training labels; printed with its coverage and saved there."""
    K = dcfg.draft_vocab_size
    if (out / DRAFT_VOCAB).is_file():
        return read_draft_vocab(out, K)
    ids = fit_draft_vocab(train_seqs, K, dcfg.vocab_size, region) if given is None else given
    train_cov, distinct = vocab_coverage(train_seqs, ids, region)
    val_cov = vocab_coverage(val_seqs, ids, region)[0] if val_seqs is not None and len(val_seqs) else None
    n = len(label_tokens(train_seqs, region))
    shown = f", validation {val_cov:.2%}" if val_cov is not None else ""
    which = "the starting drafter's" if given is not None else "the most used"
    print(f"draft vocabulary: {which} {K:,} ids; the {n:,} training label tokens use {distinct:,} distinct ids; "
          f"coverage: train {train_cov:.2%}{shown}", flush=True)
    tmp = out / (DRAFT_VOCAB + ".tmp")
    tmp.write_text(json.dumps({"size": K, "coverage": {"train": train_cov, "validation": val_cov},
                               "distinct_label_ids": distinct, "ids": ids.tolist()}))
    tmp.replace(out / DRAFT_VOCAB)
    return ids


def read_draft_vocab(out: Path, size: int) -> np.ndarray:
    path = out / DRAFT_VOCAB
    if not path.is_file():
        raise ValueError(f"{path} is missing: the draft vocabulary is fitted when training starts; train first")
    raw = json.loads(path.read_text())
    if raw.get("size") != size:
        raise ValueError(f"{path} holds a draft vocabulary of {raw.get('size')} ids, the settings ask for {size}; "
                         f"pass the --draft-vocab this run was trained with, or use a new --out")
    return np.asarray(raw["ids"], np.int32)


def _export(out: Path, graphdef, params, buffers: nnx.State) -> Path:
    path = export(out / "export", graphdef, params, buffers)
    digests = out / PROMPT_DIGESTS
    if digests.is_file():  # train.traces refuses these prompts
        shutil.copy(digests, path / PROMPT_DIGESTS)
    return path


def run(config: DistillRun, mesh=None) -> Path | None:
    """Distil (or export, or bench) as `config` says; returns the exported drafter dir (None after --bench)."""
    args = config  # the run config carries the same names as the CLI flags
    check_output_path(args.out, directory=True)  # before any work
    s = config.settings
    d, data, config = s.drafter, s.data, s.train
    optim = s.optim.optim(config.steps)
    train_ex = val_ex = None
    more_ex = []
    if not (args.bench or args.export_only):
        train_ex, val_ex, more_ex = read_data(args, data, config.seed)  # bad data is refused before the target loads
    target = load_target(args.target, mesh=mesh)  # on the mesh: data generation runs data-parallel too
    V = target.config.vocab_size
    pairs = val_pairs = []
    more_pairs = []  # one list of pairs per --more-prompts file
    mask = d.mask_token_id
    if args.export_only and (args.out / "run.json").is_file():
        mask = json.loads((args.out / "run.json").read_text())["drafter"]["mask_token_id"]  # as trained
    if train_ex is not None:
        pairs = encode_examples(train_ex, target.tokenizer, V, str(args.prompts or args.corpus))
        val_pairs = encode_examples(val_ex, target.tokenizer, V, str(args.val_prompts or args.prompts or args.corpus))
        more_pairs = [encode_examples(ex, target.tokenizer, V, str(path))
                      for ex, path in zip(more_ex, args.more_prompts)]
    given = [t for pair in pairs + val_pairs + sum(more_pairs, []) for t in pair if t is not None]
    mask = resolve_mask_token(target.tokenizer, V, mask, given, reserved=target.eos_ids)
    dcfg = make_drafter_config(
        target.config, num_layers=d.num_layers, block_size=d.block_size, target_layer_ids=d.target_layer_ids,
        num_taps=d.num_taps, mask_token_id=mask, intermediate_size=d.intermediate_size,
        draft_vocab_size=d.draft_vocab,
    )
    drafter = Drafter(dcfg, nnx.Rngs(config.seed))
    init_ids = None
    if d.init_drafter is not None and not args.export_only:
        init_ids = init_from_drafter(drafter, Path(d.init_drafter))
        print(f"drafter: starting from the weights of {d.init_drafter}", flush=True)
    if d.init_from_target:
        init_from_target(drafter, target.model)
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(drafter, nnx.Param))))
    H = dcfg.block_size - 1
    print(f"drafter: {dcfg.num_layers} layers x {dcfg.hidden_size}, taps {list(dcfg.target_layer_ids)} of "
          f"{dcfg.num_target_layers}, block {dcfg.block_size}, mask id {dcfg.mask_token_id}, {n_params:,} params, "
          f"draft vocabulary {dcfg.draft_vocab_size or 'the whole'} of {V:,}; "
          f"gamma {config.gamma or default_gamma(dcfg.block_size):.3f}; batch {config.batch_size} seqs x "
          f"{config.anchors_per_seq} anchors x {H} = {config.batch_size * config.anchors_per_seq * H:,} "
          f"draft tokens/step; {optim}", flush=True)

    if args.bench:
        bench(target, drafter, config, optim, data.gen_tokens, args.bench, mesh=mesh)
        return None

    if args.export_only:
        if dcfg.draft_vocab_size is not None:
            drafter.set_draft_vocab(read_draft_vocab(args.out, dcfg.draft_vocab_size))
        graphdef, params, buffers = nnx.split(drafter, nnx.Param, ...)
        ckpt = loop.Checkpointer(args.out)
        best = ckpt.restore_best(params)
        if best is not None:
            final, info = best[0], f"best validation (step {best[1]['step']})"
        elif ckpt.latest_step() is not None:
            state = loop.TrainState.create(params, loop.make_optimizer(optim))
            restored, saved = ckpt.restore(state)
            final, info = restored.params, f"latest (step {saved['step']})"
        else:
            raise ValueError(f"no checkpoint under {args.out}; train first")
        ckpt.close()
        out = _export(args.out, graphdef, final, buffers)
        print(f"exported the {info} params to {out}", flush=True)
        return out

    args.out.mkdir(parents=True, exist_ok=True)
    write_prompt_digests(args.out, [p for p, _ in pairs + val_pairs + sum(more_pairs, [])])
    # Rows are as wide as the longest prompt + gen_tokens, so a few long prompts would pad every row: keep
    # their last max_prompt_tokens (the default set's prompts: 25 tokens on average, 69 at the 99th percentile).
    cut = data.max_prompt_tokens
    gen = dict(batch_size=data.gen_batch_size, temperature=data.temperature, cache_dir=args.out / "data")

    def answered(group: list, **options) -> Sequences:
        """A file's rows: its given responses (teacher-forced text), or the target's answers to its prompts,
        generated once and cached under the file's own key (a file added later adds its answers only)."""
        if group[0][1] is not None:
            return sequences_from_pairs(group, data.gen_tokens, cut)
        seqs = generate_sequences(target, [p[-cut:] if cut else p for p, _ in group], data.gen_tokens, **options,
                                  **gen)
        cont = np.arange(seqs.seq_len)[None] >= seqs.prompt_lens[:, None]
        hits = int(np.sum((seqs.tokens == mask) & cont & (np.arange(seqs.seq_len)[None] < seqs.lengths[:, None])))
        if hits:
            print(f"warning: the target generated the mask token {mask} {hits} times in its continuations; it "
                  f"is then both a label and the mask (pass --mask-token-id with a token the target never emits)",
                  file=sys.stderr, flush=True)
        return seqs

    train_seqs = Sequences.concat([answered(group, greedy_fraction=data.greedy_fraction, seed=config.seed,
                                            name="train") for group in (pairs, *more_pairs)])
    val_name = data.val_split if args.corpus else "validation"
    val_seqs = answered(val_pairs, greedy_fraction=1.0, seed=config.seed + 1, name=val_name) if val_pairs else None
    cont = train_seqs.lengths - train_seqs.prompt_lens
    print(f"train: {len(train_seqs)} sequences of width {train_seqs.seq_len}, continuation mean {cont.mean():.0f} "
          f"tokens ({(cont < data.gen_tokens).mean():.0%} stopped at EOS); validation: "
          f"{len(val_seqs) if val_seqs is not None else 0} sequences; "
          f"{config.steps * config.batch_size / len(train_seqs):.1f} passes over the sequences", flush=True)
    (args.out / "run.json").write_text(json.dumps({
        "target": str(args.target), "drafter": dataclasses.asdict(dcfg), "settings": dataclasses.asdict(s),
        "data": {"prompts": str(args.prompts) if args.prompts else None,
                 "more_prompts": [str(path) for path in args.more_prompts],
                 "val_prompts": str(args.val_prompts) if args.val_prompts else None,
                 "corpus": str(args.corpus) if args.corpus else None},
        "optim": dataclasses.asdict(optim), "params": n_params,
    }, indent=2, default=str))

    if dcfg.draft_vocab_size is not None:
        drafter.set_draft_vocab(draft_vocab(args.out, train_seqs, val_seqs, dcfg, config.anchor_region, init_ids))
    graphdef, _, buffers = nnx.split(drafter, nnx.Param, ...)
    result = distill(target, drafter, train_seqs, val_seqs, args.out, config, optim, resume=args.resume, mesh=mesh,
                     meta={"preset": args.preset})
    final = result.best_params if result.best_params is not None else result.state.params
    out = _export(args.out, graphdef, final, buffers)
    which = f"best validation (step {result.best_step})" if result.best_params is not None else "final"
    print(f"exported the {which} drafter to {out}", flush=True)
    return out


def bench(target: Target, drafter: Drafter, config: DistillConfig, optim: loop.OptimConfig,
          gen_tokens: int, n: int, prompt_len: int = 64, mesh=None) -> int:
    """Time n train steps on random sequences of prompt_len + gen_tokens tokens; also the tap forward alone.
    With tap_cache the steps read the features computed beforehand, as training then does."""
    rng = np.random.default_rng(0)
    B = config.batch_size
    S = -(-(prompt_len + gen_tokens) // 16) * 16
    N = max(4 * B, 8)
    seqs = Sequences(rng.integers(3, target.config.vocab_size, (N, S)).astype(np.int32),
                     np.full(N, prompt_len, np.int32), np.full(N, S, np.int32))
    taps_fn = jax.jit(lambda p, tok: target_taps(nnx.merge(target.graphdef, p), tok, drafter.config.target_layer_ids))
    taps = None
    if config.tap_cache:
        taps = np.concatenate([jax.device_get(taps_fn(target.params, jnp.asarray(seqs.tokens[i:i + B])))
                               for i in range(0, N, B)])
    run = setup(target, drafter, seqs, config, optim, mesh, taps=taps)
    state = run.state
    tparams = sharding.shard_params(target.params, mesh)
    batch = lambda i: {**run.batches.batch_at(i), "target": tparams}
    t = time.perf_counter()
    state, m = run.train_step(state, batch(0))
    jax.block_until_ready(m)
    print(f"compile + first step: {time.perf_counter() - t:.1f}s", flush=True)
    t, c = time.perf_counter(), time.process_time()
    for i in range(1, n + 1):
        state, m = run.train_step(state, batch(i))
    jax.block_until_ready(m)
    dt, cpu = (time.perf_counter() - t) / n, (time.process_time() - c) / n

    tok = jnp.asarray(seqs.tokens[:B])
    jax.block_until_ready(taps_fn(target.params, tok))
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        out = taps_fn(target.params, tok)
    jax.block_until_ready(out)
    dt_taps, cpu_taps = (time.perf_counter() - t) / n, (time.process_time() - c) / n

    H = drafter.config.block_size - 1
    c = drafter.config
    draft = B * config.anchors_per_seq * H
    where = "computed once beforehand (tap_cache)" if taps is not None else f"{cpu_taps / cpu:.0%} of the step's CPU time"
    print(f"BENCH drafter {c.num_layers}x{c.hidden_size} on target {target.config.num_layers}x"
          f"{target.config.hidden_size}: B{B} S{S} A{config.anchors_per_seq} Kb{c.block_size}: "
          f"{dt:.3f} s/step ({cpu:.3f} CPU-s)  {draft / dt:,.0f} draft tok/s  {draft / cpu:,.0f} draft tok/CPU-s  "
          f"{B * S / dt:,.0f} seq tok/s  {B / dt:.2f} seq/s; target-tap forward alone {dt_taps:.3f} s "
          f"({cpu_taps:.3f} CPU-s, {where})  loss {float(m['loss']):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
