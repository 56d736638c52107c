"""Distil a DFlash block-diffusion drafter from a frozen target (DESIGN section 4).

    python -m train.distill --target runs/default/target_train/export --out runs/default/drafter_train
        [--preset default] [--num-sequences N] [--gen-tokens T] [--layers L] [--block-size 16]
        [--steps N] [--batch-size B] [--anchors-per-seq A] [--resume] [--export-only] [--bench N]

Pipeline
--------
1. Data: function-signature prompts from the corpus TRAIN split, continued by
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
2. Tap features: computed ON THE FLY inside the jitted step, one frozen
   target forward per sequence (causal mask, `taps=target_layer_ids`, the lm
   head skipped). Measured (`--bench`, 6-layer target of width 256 or 384,
   batch 8 x 320 tokens, 16 anchors): that forward is ~40% of a 1-layer
   drafter's step (CPU time) and ~30% of a 2-layer one's. A precomputed
   cache would remove it from every pass after the first, ~30% of a 4-pass
   run, but must store [N, S, n_taps * D] floats (default set: 4096 x 320 x
   768 x 2 B = 2 GB in float16, twice that in float32) per (target, taps,
   data) and keep a second input path identical to the decode-time
   features. On the fly keeps the features exactly what decoding sees and
   needs no storage; more anchors per sequence amortise the forward instead
   (32 anchors: ~22% of the step).
3. Objective: per sequence, A anchors are sampled without replacement; block
   j is [tok[a_j], MASK x H] at positions a_j .. a_j + H. All blocks of a
   sequence run in ONE `Drafter.forward_masked`, where block j sees the
   context features at positions < a_j (strictly: the anchor's own features
   arrive one round later at decode time) and its own block, nothing else
   (`anchor_block_mask`, keyed on anchor positions). Loss: cross-entropy of
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
import csv
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from decode.common import check_output_path
from taps_jax import sharding
from taps_jax.api import Target, load_target
from taps_jax.checkpoints.dflash import save_drafter
from taps_jax.config import DrafterConfig, ModelConfig
from taps_jax.engine.batching import bucket
from taps_jax.models.drafter import Drafter
from taps_jax.models.transformer import Transformer
from train import loop
from train.config import add_flags, build, option
from train.preset import known_presets, read_preset
from train.data import (PROMPT_DIGESTS, Example, encode_examples, read_split, resolve_mask_token,
                        write_prompt_digests)
from train.tokenizer import MASK_ID, PAD_ID

ANCHOR_REGIONS = ("continuation", "all")


# --------------------------------------------------------------------------- settings


def default_gamma(block_size: int) -> float:
    """Loss-weight decay: 7 for Kb = 16 (DFlash), scaled as 7 * (Kb - 1) / 15 otherwise."""
    return 7.0 * (block_size - 1) / 15.0


def position_weights(block_size: int, gamma: float | None = None) -> np.ndarray:
    """w_k = exp(-(k-1)/gamma) for drafted slots k = 1..H. [H] float32"""
    gamma = default_gamma(block_size) if gamma is None else gamma
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0 (the decay length of the loss weights), got {gamma!r}")
    return np.exp(-np.arange(block_size - 1) / gamma).astype(np.float32)


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
) -> DrafterConfig:
    """A drafter shaped like one of the target's layers (same width, heads, rope), checked against it."""
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
        rope_scaling=target.rope_scaling,
        rms_norm_eps=target.rms_norm_eps,
        dtype=dtype,
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
    log_every: int = option(10, "log every N steps")
    eval_every: int = option(250, "validate every N steps (0: only at the end)")
    checkpoint_every_s: float = option(600.0, "seconds between checkpoints")
    keep: int = option(3, "checkpoints kept")

    def __post_init__(self):
        for name in ("steps", "batch_size", "anchors_per_seq"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.anchor_region not in ANCHOR_REGIONS:
            raise ValueError(f"anchor_region must be one of {ANCHOR_REGIONS}, got {self.anchor_region!r}")


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


# --------------------------------------------------------------------------- data: target generations


@dataclasses.dataclass
class Sequences:
    """Prompt + target continuation per row, right-padded with PAD."""

    tokens: np.ndarray  # [N, S] int32
    prompt_lens: np.ndarray  # [N] int32
    lengths: np.ndarray  # [N] int32: prompt + continuation (EOS included when generated)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        for name in ("tokens", "prompt_lens", "lengths"):
            tmp = path / f"{name}.tmp{os.getpid()}.npy"
            np.save(tmp, getattr(self, name))
            os.replace(tmp, path / f"{name}.npy")

    @classmethod
    def load(cls, path: Path) -> "Sequences":
        return cls(*(np.load(path / f"{name}.npy") for name in ("tokens", "prompt_lens", "lengths")))


def params_fingerprint(params) -> str:
    """sha1 of every parameter's bytes (cache key for generations of these weights)."""
    h = hashlib.sha1()
    for leaf in jax.tree.leaves(params):
        a = np.asarray(leaf)
        h.update(str((a.shape, a.dtype)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def generate_sequences(
    target: Target,
    prompts: list[list[int]],
    gen_tokens: int,
    *,
    batch_size: int = 64,
    greedy_fraction: float = 0.5,
    temperature: float = 0.9,
    seed: int = 0,
    cache_dir: Path | None = None,
    name: str = "train",
    seq_multiple: int = 16,
) -> Sequences:
    """Continue every prompt with the target (batched AR), cached on disk.

    The first round(greedy_fraction * N) prompts are continued greedily, the
    rest sampled at `temperature` (prompts come in random order, so both
    halves are random subsets). Batch i of a mode uses seed + i. Every batch
    is padded to `batch_size` and to one cache capacity, so generation
    compiles once per prompt-length bucket and mode. Rows are padded to a
    multiple of `seq_multiple` tokens.
    """
    if not prompts:
        raise ValueError("no prompts to continue")
    if not 0.0 <= greedy_fraction <= 1.0:
        raise ValueError(f"greedy_fraction must lie in [0, 1], got {greedy_fraction!r}")
    if greedy_fraction < 1.0 and not temperature > 0:
        raise ValueError(f"sampled continuations need temperature > 0, got {temperature!r}")
    n = len(prompts)
    n_greedy = round(greedy_fraction * n)
    longest = max(map(len, prompts))
    width = -(-(longest + gen_tokens) // seq_multiple) * seq_multiple
    capacity = bucket(longest + gen_tokens)
    key = hashlib.sha1(json.dumps({
        "target": params_fingerprint(target.params), "eos": list(target.eos_ids),
        "prompts": hashlib.sha1(json.dumps(prompts).encode()).hexdigest(), "gen_tokens": gen_tokens,
        "batch_size": batch_size, "n_greedy": n_greedy, "temperature": temperature, "seed": seed,
        "width": width,
    }, sort_keys=True).encode()).hexdigest()[:12]
    final = cache_dir / f"{name}-{key}" if cache_dir is not None else None
    if final is not None and (final / "lengths.npy").is_file():
        seqs = Sequences.load(final)
        tqdm.write(f"{name}: {len(seqs)} cached target continuations from {final}")
        return seqs
    parts = final / "parts" if final is not None else None
    if parts is not None:
        parts.mkdir(parents=True, exist_ok=True)

    # Batches never mix modes: [0, n_greedy) greedy, [n_greedy, n) sampled.
    batches = [(lo, min(lo + batch_size, n_greedy), True) for lo in range(0, n_greedy, batch_size)]
    batches += [(lo, min(lo + batch_size, n), False) for lo in range(n_greedy, n, batch_size)]
    rows = np.full((n, 2 + width), PAD_ID, np.int32)  # [prompt_len, length, tokens...]
    bar = tqdm(total=n, desc=f"generate {name}", unit="seq", dynamic_ncols=True, smoothing=0.1,
               mininterval=1.0 if sys.stderr.isatty() else 30.0)
    t0, made = time.perf_counter(), 0
    for i, (lo, hi, greedy) in enumerate(batches):
        part = parts / f"{lo:07d}.npy" if parts is not None else None
        if part is not None and part.is_file():
            rows[lo:hi] = np.load(part)
        else:
            chunk = prompts[lo:hi]
            chunk = chunk + [chunk[0]] * (batch_size - len(chunk))  # one batch shape: one compile
            result = target.generate(
                chunk, gen_tokens, temperature=0.0 if greedy else temperature, seed=seed + i,
                capacity=capacity,
            )
            for r, (p, c) in enumerate(zip(chunk[: hi - lo], result.tokens)):
                seq = list(p) + list(c)
                rows[lo + r, 0], rows[lo + r, 1] = len(p), len(seq)
                rows[lo + r, 2 : 2 + len(seq)] = seq
                made += len(c)
            if part is not None:
                np.save(part.with_suffix(".tmp.npy"), rows[lo:hi])
                os.replace(part.with_suffix(".tmp.npy"), part)
        bar.update(hi - lo)
        bar.set_postfix(tok_s=f"{made / max(time.perf_counter() - t0, 1e-9):,.0f}", refresh=False)
    bar.close()
    seqs = Sequences(rows[:, 2:].copy(), rows[:, 0].copy(), rows[:, 1].copy())
    if final is not None:
        seqs.save(final)
        (final / "meta.json").write_text(json.dumps({
            "sequences": n, "greedy": n_greedy, "temperature": temperature if n_greedy < n else None,
            "gen_tokens": gen_tokens,
            "seed": seed, "mean_continuation": float(np.mean(seqs.lengths - seqs.prompt_lens)),
        }, indent=2))
        shutil.rmtree(parts, ignore_errors=True)
    return seqs


# --------------------------------------------------------------------------- anchors and batches


def distillation_prompt_texts(preset: str) -> set[str]:
    """The prompt texts that `--preset PRESET` distils on: prompt sets meant to
    measure the drafter (e.g. TAPS traces) must not contain them, since the
    drafter has seen the target's continuations of exactly these."""
    from train.corpus import build_prompts

    s = load_preset(preset)
    return {p["prompt"] for p in build_prompts("train", n=s.data.num_sequences, seed=s.train.seed)}


def anchor_range(prompt_len: int, length: int, block_size: int, region: str) -> tuple[int, int]:
    """Inclusive [lo, hi] of anchor positions for one sequence (hi < lo: none)."""
    lo = prompt_len if region == "continuation" else 0
    hi = length - block_size  # all H labels inside the sequence
    if hi < lo:  # a continuation cut short by EOS: keep what labels there are (the rest masked)
        hi = length - 2
    return lo, hi


def sample_anchors(rng: np.random.Generator, lo: int, hi: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` distinct anchors in [lo, hi] (sorted) and a validity mask; too few -> padded invalid."""
    anchors, valid = np.zeros(count, np.int32), np.zeros(count, bool)
    if hi >= lo:
        span = hi - lo + 1
        got = np.sort(lo + rng.choice(span, size=min(count, span), replace=False))
        anchors[: len(got)], valid[: len(got)] = got, True
        anchors[len(got):] = lo
    return anchors, valid


class AnchorBatches:
    """Deterministic, resumable batches of sequences + anchors.

    batch_at(step) -> {"tokens": [B, S] int32, "anchors": [B, A] int32,
    "anchor_valid": [B, A] bool, "lengths": [B] int32}. Sequence order is an
    epoch-wise permutation seeded by (seed, epoch); anchors are seeded by
    (seed, step, row). No state, so a resumed run sees the same batches.
    """

    def __init__(self, seqs: Sequences, batch_size: int, anchors_per_seq: int, block_size: int,
                 region: str = "continuation", seed: int = 0):
        if len(seqs) == 0:
            raise ValueError("no training sequences")
        self.seqs, self.B, self.A, self.Kb = seqs, batch_size, anchors_per_seq, block_size
        self.region, self.seed = region, seed
        self._perm: dict[int, np.ndarray] = {}
        ranges = [anchor_range(int(p), int(n), block_size, region) for p, n in zip(seqs.prompt_lens, seqs.lengths)]
        self.ranges = np.asarray(ranges, np.int64).reshape(-1, 2)
        if not (self.ranges[:, 1] >= self.ranges[:, 0]).any():
            raise ValueError("no sequence is long enough for one anchor; generate longer continuations")

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm:
            if len(self._perm) >= 2:
                self._perm.pop(min(self._perm))
            self._perm[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.seqs))
        return self._perm[epoch]

    def rows_at(self, step: int) -> np.ndarray:
        samples = step * self.B + np.arange(self.B)
        return np.array([self._order(int(s) // len(self.seqs))[int(s) % len(self.seqs)] for s in samples])

    def batch_at(self, step: int) -> dict:
        return self.batch_of(self.rows_at(step), np.random.default_rng([self.seed, 1 << 20, step]))

    def batch_of(self, rows: np.ndarray, rng: np.random.Generator) -> dict:
        anchors, valid = zip(*(sample_anchors(rng, *self.ranges[r], self.A) for r in rows))
        return {
            "tokens": self.seqs.tokens[rows].astype(np.int32),
            "anchors": np.stack(anchors),
            "anchor_valid": np.stack(valid),
            "lengths": self.seqs.lengths[rows].astype(np.int32),
        }

    def fixed_batches(self, seed: int = 12345) -> list[dict]:
        """Every sequence once, in order, with fixed anchors (validation); the last batch is padded invalid."""
        rng = np.random.default_rng([seed])
        out = []
        for lo in range(0, len(self.seqs), self.B):
            rows = np.arange(lo, min(lo + self.B, len(self.seqs)))
            pad = self.B - len(rows)
            batch = self.batch_of(np.concatenate([rows, np.full(pad, rows[0])]), rng)
            batch["anchor_valid"][len(rows):] = False
            out.append(batch)
        return out


# --------------------------------------------------------------------------- the training forward


def anchor_block_mask(anchors_BA, context_len: int, block_size: int):
    """Visibility [B, A*Kb, C + A*Kb] over [context; blocks] keys for the training forward.

    Row (j, k) (slot k of block j) sees context positions c < anchors[j]
    (strictly: keyed on the anchor POSITION, not on the block index) and the
    Kb slots of block j; no other block.
    """
    B, A = anchors_BA.shape
    T = A * block_size
    anchor_BT = jnp.repeat(anchors_BA, block_size, axis=1)
    context_BTC = jnp.arange(context_len)[None, None, :] < anchor_BT[:, :, None]
    block_T = jnp.arange(T) // block_size
    own_TT = block_T[:, None] == block_T[None, :]
    return jnp.concatenate([context_BTC, jnp.broadcast_to(own_TT, (B, T, T))], axis=-1)


def block_tokens(tokens_BS, anchors_BA, block_size: int, mask_token_id: int):
    """[tok[anchor], MASK x H] per anchor. [B, A, Kb] int32"""
    anchor_tok_BA = jnp.take_along_axis(tokens_BS, anchors_BA, axis=1)
    B, A = anchors_BA.shape
    masks = jnp.full((B, A, block_size - 1), mask_token_id, tokens_BS.dtype)
    return jnp.concatenate([anchor_tok_BA[..., None], masks], axis=-1)


def block_forward(drafter: Drafter, target: Transformer, blocks_BAK, anchors_BA, taps_BSF):
    """Drafter logits [B, A, H, V] (float32) of all blocks of each sequence in ONE forward.

    Block j (tokens blocks_BAK[:, j], embedded with the target's table) sits at
    positions anchors[j] .. anchors[j] + H and attends per `anchor_block_mask`
    to the fused context taps_BSF (positions 0..S-1). Slot k predicts the token
    at anchors[j] + k; slot 0 (the anchor) is not a prediction.
    """
    B, A, Kb = blocks_BAK.shape
    S = taps_BSF.shape[1]
    positions_BAK = anchors_BA[..., None] + jnp.arange(Kb, dtype=jnp.int32)
    ctx_positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    embeds_BTD = target.embed(blocks_BAK.reshape(B, A * Kb))
    hidden_BTD = drafter.forward_masked(
        embeds_BTD, positions_BAK.reshape(B, A * Kb), taps_BSF, ctx_positions_BS,
        anchor_block_mask(anchors_BA, S, Kb),
    )
    hidden_BAHD = hidden_BTD.reshape(B, A, Kb, -1)[:, :, 1:]
    return target.unembed(hidden_BAHD).astype(jnp.float32)


def target_taps(target: Transformer, tokens_BS, layer_ids: tuple[int, ...]):
    """Frozen tap features [B, S, n_taps * D] of whole sequences (causal; the lm head is skipped)."""
    B, S = tokens_BS.shape
    positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    causal_BSS = jnp.broadcast_to(jnp.tril(jnp.ones((S, S), bool)), (B, S, S))
    _, taps_BSF, _ = target(tokens_BS, positions_BS, causal_BSS, taps=layer_ids,
                            logits_index_BI=jnp.zeros((B, 1), jnp.int32))
    return jax.lax.stop_gradient(taps_BSF)


def labels_and_weights(tokens_BS, anchors_BA, anchor_valid_BA, lengths_B, weights_H):
    """Labels tok[anchor + k] [B, A, H] and loss weights w_k (0 where invalid or past the end)."""
    S = tokens_BS.shape[1]
    H = weights_H.shape[0]
    pos_BAH = anchors_BA[..., None] + jnp.arange(1, H + 1, dtype=jnp.int32)
    labels_BAH = jnp.take_along_axis(tokens_BS[:, None, :], jnp.minimum(pos_BAH, S - 1), axis=2)
    valid_BAH = anchor_valid_BA[..., None] & (pos_BAH < lengths_B[:, None, None])
    return labels_BAH, jnp.where(valid_BAH, weights_H, 0.0), valid_BAH


def make_forward(drafter_graphdef, target_graphdef, weights_H: np.ndarray):
    """(drafter params, batch) -> (logits [B,A,H,V], labels [B,A,H], weights [B,A,H], valid [B,A,H]).

    batch holds the frozen target params under "target" (`loop.run(frozen=...)`: an argument, not a
    closure constant, so they are not baked into the compiled program).
    """
    weights_H = jnp.asarray(weights_H)

    def forward(params, batch):
        drafter = nnx.merge(drafter_graphdef, params)
        target = nnx.merge(target_graphdef, batch["target"])
        c = drafter.config
        tokens_BS, anchors_BA = batch["tokens"], batch["anchors"]
        taps_BSF = target_taps(target, tokens_BS, c.target_layer_ids)
        blocks_BAK = block_tokens(tokens_BS, anchors_BA, c.block_size, c.mask_token_id)
        logits_BAHV = block_forward(drafter, target, blocks_BAK, anchors_BA, taps_BSF)
        labels_BAH, w_BAH, valid_BAH = labels_and_weights(
            tokens_BS, anchors_BA, batch["anchor_valid"], batch["lengths"], weights_H)
        return logits_BAHV, labels_BAH, w_BAH, valid_BAH

    return forward


def make_loss_fn(forward):
    """(params, batch) -> (sum_k w_k CE_k / sum_k w_k over the batch, {})."""

    def loss_fn(params, batch):
        logits_BAHV, labels_BAH, w_BAH, _ = forward(params, batch)
        ce_BAH = optax.softmax_cross_entropy_with_integer_labels(logits_BAHV, labels_BAH)
        return jnp.sum(ce_BAH * w_BAH) / jnp.maximum(jnp.sum(w_BAH), 1e-9), {}

    return loss_fn


# --------------------------------------------------------------------------- validation


def make_evaluator(forward, batches: list[dict], target_params, out_dir: Path | None, H: int,
                   start_step: int = 0):
    """evaluate(params, step) -> `summarize`'s dict: weighted val CE ("loss"), per-position agreement, tau.

    Rows go to out_dir/val_agreement.csv (those of steps <= start_step kept on resume) and agreement.png.
    """

    @jax.jit
    def stats(params, batch):
        logits_BAHV, labels_BAH, w_BAH, valid_BAH = forward(params, batch)
        ce_BAH = optax.softmax_cross_entropy_with_integer_labels(logits_BAHV, labels_BAH)
        hit_BAH = (jnp.argmax(logits_BAHV, -1) == labels_BAH) & valid_BAH
        full_BA = jnp.all(valid_BAH, axis=-1)  # blocks with all H labels: the empirical chain
        leading_BA = jnp.sum(jnp.cumprod(hit_BAH, axis=-1), axis=-1)
        return {
            "ce": jnp.sum(ce_BAH * w_BAH), "w": jnp.sum(w_BAH),
            "hit_H": jnp.sum(hit_BAH, axis=(0, 1)), "n_H": jnp.sum(valid_BAH, axis=(0, 1)),
            "leading": jnp.sum(jnp.where(full_BA, leading_BA, 0)), "blocks": jnp.sum(full_BA),
        }

    csv_path = out_dir / "val_agreement.csv" if out_dir is not None else None
    fields = ["step", "loss", "acc_mean", "tau_cumprod", "tau_chain"] + [f"acc_{k}" for k in range(1, H + 1)]
    rows: list[dict] = []
    if csv_path is not None:
        if csv_path.exists() and start_step > 0:
            with csv_path.open() as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= start_step]
        with csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, fields)
            w.writeheader()
            w.writerows(rows)

    def evaluate(params, step: int) -> dict:
        got = jax.device_get([stats(params, {**b, "target": target_params}) for b in batches])
        total = {k: sum(g[k] for g in got) for k in got[0]}
        m = summarize(total)
        if csv_path is not None:
            row = {"step": step, "loss": f"{m['loss']:.5f}", "acc_mean": f"{m['acc_mean']:.4f}",
                   "tau_cumprod": f"{m['tau_cumprod']:.4f}", "tau_chain": f"{m['tau_chain']:.4f}",
                   **{f"acc_{k + 1}": f"{a:.4f}" for k, a in enumerate(m["acc"])}}
            if rows and int(rows[-1]["step"]) >= row["step"]:
                # Steps redone after a resume fell back past a damaged checkpoint: replace their rows.
                rows[:] = [r for r in rows if int(r["step"]) < row["step"]]
                with csv_path.open("w", newline="") as f:
                    w = csv.DictWriter(f, fields)
                    w.writeheader()
                    w.writerows(rows)
            rows.append(row)
            with csv_path.open("a", newline="") as f:
                csv.DictWriter(f, fields).writerow(row)
            plot_agreement(rows, out_dir / "agreement.png", H)
        tqdm.write(f"val agreement k=1..{H}: " + " ".join(f"{a:.2f}" for a in m["acc"])
                   + f"  mean {m['acc_mean']:.3f}  tau {m['tau_cumprod']:.2f} (cumprod) "
                   f"{m['tau_chain']:.2f} (chain)")
        return m

    return evaluate


def summarize(total: dict) -> dict:
    acc = np.asarray(total["hit_H"], np.float64) / np.maximum(np.asarray(total["n_H"], np.float64), 1)
    return {
        "loss": float(total["ce"] / max(float(total["w"]), 1e-9)),
        "acc": acc.tolist(),
        "acc_mean": float(acc.mean()),
        "tau_cumprod": float(1.0 + np.cumprod(acc).sum()),
        "tau_chain": float(1.0 + total["leading"] / max(int(total["blocks"]), 1)),
    }


def plot_agreement(rows: list[dict], path: Path, H: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    last = rows[-1]
    a1.plot(range(1, H + 1), [float(last[f"acc_{k}"]) for k in range(1, H + 1)], "o-")
    a1.set(xlabel="drafted position k", ylabel="top-1 agreement with target", ylim=(0, 1),
           title=f"step {last['step']}")
    steps = [int(r["step"]) for r in rows]
    a2.plot(steps, [float(r["tau_cumprod"]) for r in rows], "o-", label="1 + sum cumprod(acc)")
    a2.plot(steps, [float(r["tau_chain"]) for r in rows], "s-", label="empirical chain")
    a2.set(xlabel="step", ylabel="expected accepted length (tau)")
    a2.legend()
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- training


@dataclasses.dataclass
class DistillRun:
    drafter_graphdef: object
    optimizer: optax.GradientTransformation
    train_step: object
    state: loop.TrainState
    batches: AnchorBatches
    forward: object
    loss_fn: object


def setup(target: Target, drafter: Drafter, train_seqs: Sequences, config: DistillConfig,
          optim: loop.OptimConfig, mesh=None) -> DistillRun:
    """Everything `distill` needs, exposed for benchmarks and tests.

    mesh: the drafter's params and optimizer state are sharded by the rules
    and each batch is split over "data" (batch_size must divide it).
    """
    dc = drafter.config
    dc.check_target(target.config)
    sharding.check_config(dc, mesh, "drafter")
    if config.batch_size % sharding.data_size(mesh):
        raise ValueError(f"batch size {config.batch_size} is not divisible by the mesh's data axis "
                         f"({sharding.data_size(mesh)})")
    graphdef, params = nnx.split(drafter)
    forward = make_forward(graphdef, target.graphdef, position_weights(dc.block_size, config.gamma))
    loss_fn = make_loss_fn(forward)
    optimizer = loop.make_optimizer(optim)
    batches = AnchorBatches(train_seqs, config.batch_size, config.anchors_per_seq, dc.block_size,
                            config.anchor_region, config.seed)
    return DistillRun(graphdef, optimizer, loop.make_train_step(loss_fn, optimizer, mesh),
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
    run = setup(target, drafter, train_seqs, config, optim, mesh)
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
                                    "continuation", config.seed).fixed_batches()
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


def export(out: Path, drafter_graphdef, params) -> Path:
    """The drafter in the DFlash layout (config.json + model.safetensors)."""
    save_drafter(nnx.merge(drafter_graphdef, params), out)
    return out


# --------------------------------------------------------------------------- CLI


def load_preset(name_or_path: str, args=None) -> DistillSettings:
    """train/presets/drafter_<name>.json (or a path) over the defaults, then the flags given in `args`."""
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
    p.add_argument("--preset", default="default",
                   help=f"drafter preset: one of {', '.join(known_presets('drafter'))} (train/presets/drafter_NAME.json, "
                        f"shipped with the package; 'tiny' is a seconds-long smoke test) or a JSON file path; a preset "
                        f"overrides the built-in values below, a flag overrides the preset")
    data = p.add_argument_group("your data (give --prompts or --corpus)")
    data.add_argument("--prompts", type=Path,
                      help='JSONL, one {"prompt": "..."} or {"ids": [...]} per line (the target continues each), or '
                           '{"prompt": ..., "response": ...} / {"ids": ..., "response_ids": ...} (continuations '
                           'given: no generation). Every line is used; --num-sequences does not apply')
    data.add_argument("--val-prompts", type=Path,
                      help="validation prompts in the same format (default: the --val-fraction of --prompts "
                           "lines picked by a stable hash of each line)")
    data.add_argument("--corpus", type=Path,
                      help="instead of --prompts: a tree of .py files; prompts are function signatures of its "
                           "train split, validation prompts of its validation split (split by file path hash)")
    add_flags(p, DistillSettings)  # every preset setting, with its help and default, from the dataclasses
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --out")
    p.add_argument("--export-only", action="store_true", help="export the best (else latest) checkpoint and exit")
    p.add_argument("--bench", type=int, default=0, metavar="N",
                   help="time N train steps (and the target-tap forward alone) on random sequences, then exit")
    sharding.add_mesh_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_output_path(args.out, directory=True)  # before any work
        return _main(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _settings(args) -> DistillSettings:
    return load_preset(args.preset, args)


def read_data(args, data: dict, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, validation) examples from --prompts/--val-prompts or --corpus; checked before any model loads."""
    if (args.prompts is None) == (args.corpus is None):
        which = "both" if args.prompts is not None else "neither"
        raise ValueError(f"give your data with --prompts FILE.jsonl (prompts, optionally with responses) or --corpus "
                         f"DIR (a tree of .py files); got {which}")
    if args.val_prompts is not None and args.prompts is None:
        raise ValueError("--val-prompts goes with --prompts (--corpus takes its validation prompts from its own split)")
    if args.prompts is not None:
        return read_split(args.prompts, args.val_prompts, data.val_fraction)
    if not args.corpus.is_dir():
        raise ValueError(f"--corpus {args.corpus} is not a directory; give a tree of .py files")
    from train.corpus import build_prompts

    def take(split, n, seed):
        return [Example(p["prompt"]) for p in build_prompts(split, n=n, seed=seed, root=args.corpus)]

    return take("train", data.num_sequences, seed), take(data.val_split, data.val_sequences, seed + 1)


def sequences_from_pairs(pairs, gen_tokens: int, max_prompt_tokens: int | None, seq_multiple: int = 16) -> Sequences:
    """Given prompt + response pairs as Sequences (prompts keep their last tokens, responses their first)."""
    rows = [((p[-max_prompt_tokens:] if max_prompt_tokens else p), r[:gen_tokens]) for p, r in pairs]
    width = -(-max(len(p) + len(r) for p, r in rows) // seq_multiple) * seq_multiple
    tokens = np.full((len(rows), width), PAD_ID, np.int32)
    for i, (p, r) in enumerate(rows):
        tokens[i, : len(p) + len(r)] = p + r
    return Sequences(tokens, np.array([len(p) for p, _ in rows], np.int32),
                     np.array([len(p) + len(r) for p, r in rows], np.int32))


def _export(out: Path, graphdef, params) -> Path:
    path = export(out / "export", graphdef, params)
    digests = out / PROMPT_DIGESTS
    if digests.is_file():  # train.traces refuses these prompts
        shutil.copy(digests, path / PROMPT_DIGESTS)
    return path


def _main(args) -> int:
    s = _settings(args)
    d, data, config = s.drafter, s.data, s.train
    optim = s.optim.optim(config.steps)
    train_ex = val_ex = None
    if not (args.bench or args.export_only):
        train_ex, val_ex = read_data(args, data, config.seed)  # bad data is refused before the target loads
    mesh = sharding.setup_mesh(args)
    target = load_target(args.target, mesh=mesh)  # on the mesh: data generation runs data-parallel too
    V = target.config.vocab_size
    pairs = val_pairs = []
    mask = d.mask_token_id
    if args.export_only and (args.out / "run.json").is_file():
        mask = json.loads((args.out / "run.json").read_text())["drafter"]["mask_token_id"]  # as trained
    if train_ex is not None:
        pairs = encode_examples(train_ex, target.tokenizer, V, str(args.prompts or args.corpus))
        val_pairs = encode_examples(val_ex, target.tokenizer, V, str(args.val_prompts or args.prompts or args.corpus))
    given = [t for pair in pairs + val_pairs for t in pair if t is not None]
    mask = resolve_mask_token(target.tokenizer, V, mask, given, reserved=target.eos_ids)
    dcfg = make_drafter_config(
        target.config, num_layers=d.num_layers, block_size=d.block_size, target_layer_ids=d.target_layer_ids,
        num_taps=d.num_taps, mask_token_id=mask, intermediate_size=d.intermediate_size,
    )
    drafter = Drafter(dcfg, nnx.Rngs(config.seed))
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.split(drafter)[1])))
    H = dcfg.block_size - 1
    print(f"drafter: {dcfg.num_layers} layers x {dcfg.hidden_size}, taps {list(dcfg.target_layer_ids)} of "
          f"{dcfg.num_target_layers}, block {dcfg.block_size}, mask id {dcfg.mask_token_id}, {n_params:,} params; "
          f"gamma {config.gamma or default_gamma(dcfg.block_size):.3f}; batch {config.batch_size} seqs x "
          f"{config.anchors_per_seq} anchors x {H} = {config.batch_size * config.anchors_per_seq * H:,} "
          f"draft tokens/step; {optim}", flush=True)

    if args.bench:
        return bench(target, drafter, config, optim, data.gen_tokens, args.bench, mesh=mesh)

    if args.export_only:
        graphdef, params = nnx.split(drafter)
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
        out = _export(args.out, graphdef, final)
        print(f"exported the {info} params to {out}", flush=True)
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    write_prompt_digests(args.out, [p for p, _ in pairs + val_pairs])
    # Rows are as wide as the longest prompt + gen_tokens, so a few long prompts would pad every row: keep
    # their last max_prompt_tokens (the default set's prompts: 25 tokens on average, 69 at the 99th percentile).
    cut = data.max_prompt_tokens
    if pairs[0][1] is not None:  # responses given: no generation
        train_seqs = sequences_from_pairs(pairs, data.gen_tokens, cut)
        val_seqs = sequences_from_pairs(val_pairs, data.gen_tokens, cut) if val_pairs else None
    else:
        gen = dict(batch_size=data.gen_batch_size, temperature=data.temperature, cache_dir=args.out / "data")
        train_seqs = generate_sequences(target, [p[-cut:] if cut else p for p, _ in pairs], data.gen_tokens,
                                        greedy_fraction=data.greedy_fraction, seed=config.seed, name="train", **gen)
        val_name = data.val_split if args.corpus else "validation"
        val_seqs = generate_sequences(target, [p[-cut:] if cut else p for p, _ in val_pairs], data.gen_tokens,
                                      greedy_fraction=1.0, seed=config.seed + 1, name=val_name,
                                      **gen) if val_pairs else None
        cont = np.arange(train_seqs.seq_len)[None] >= train_seqs.prompt_lens[:, None]
        hits = int(np.sum((train_seqs.tokens == mask) & cont & (np.arange(train_seqs.seq_len)[None]
                                                                < train_seqs.lengths[:, None])))
        if hits:
            print(f"warning: the target generated the mask token {mask} {hits} times in its continuations; it "
                  f"is then both a label and the mask (pass --mask-token-id with a token the target never emits)",
                  file=sys.stderr, flush=True)
    cont = train_seqs.lengths - train_seqs.prompt_lens
    print(f"train: {len(train_seqs)} sequences of width {train_seqs.seq_len}, continuation mean {cont.mean():.0f} "
          f"tokens ({(cont < data.gen_tokens).mean():.0%} stopped at EOS); validation: "
          f"{len(val_seqs) if val_seqs is not None else 0} sequences; "
          f"{config.steps * config.batch_size / len(train_seqs):.1f} passes over the sequences", flush=True)
    (args.out / "run.json").write_text(json.dumps({
        "target": str(args.target), "drafter": dataclasses.asdict(dcfg), "settings": dataclasses.asdict(s),
        "data": {"prompts": str(args.prompts) if args.prompts else None,
                 "val_prompts": str(args.val_prompts) if args.val_prompts else None,
                 "corpus": str(args.corpus) if args.corpus else None},
        "optim": dataclasses.asdict(optim), "params": n_params,
    }, indent=2, default=str))

    graphdef = nnx.split(drafter)[0]
    result = distill(target, drafter, train_seqs, val_seqs, args.out, config, optim, resume=args.resume, mesh=mesh,
                     meta={"preset": args.preset})
    final = result.best_params if result.best_params is not None else result.state.params
    out = _export(args.out, graphdef, final)
    which = f"best validation (step {result.best_step})" if result.best_params is not None else "final"
    print(f"exported the {which} drafter to {out}", flush=True)
    return 0


def bench(target: Target, drafter: Drafter, config: DistillConfig, optim: loop.OptimConfig,
          gen_tokens: int, n: int, prompt_len: int = 64, mesh=None) -> int:
    """Time n train steps on random sequences of prompt_len + gen_tokens tokens; also the tap forward alone."""
    rng = np.random.default_rng(0)
    B = config.batch_size
    S = -(-(prompt_len + gen_tokens) // 16) * 16
    N = max(4 * B, 8)
    seqs = Sequences(rng.integers(3, target.config.vocab_size, (N, S)).astype(np.int32),
                     np.full(N, prompt_len, np.int32), np.full(N, S, np.int32))
    run = setup(target, drafter, seqs, config, optim, mesh)
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

    taps_fn = jax.jit(lambda p, tok: target_taps(nnx.merge(target.graphdef, p), tok, drafter.config.target_layer_ids))
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
    print(f"BENCH drafter {c.num_layers}x{c.hidden_size} on target {target.config.num_layers}x"
          f"{target.config.hidden_size}: B{B} S{S} A{config.anchors_per_seq} Kb{c.block_size}: "
          f"{dt:.3f} s/step ({cpu:.3f} CPU-s)  {draft / dt:,.0f} draft tok/s  {B * S / dt:,.0f} seq tok/s  "
          f"{B / dt:.2f} seq/s; target-tap forward alone {dt_taps:.3f} s ({cpu_taps:.3f} CPU-s, "
          f"{cpu_taps / cpu:.0%} of the step's CPU time)  "
          f"loss {float(m['loss']):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
