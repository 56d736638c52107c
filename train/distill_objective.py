"""The distillation objective: anchor blocks, the tap forward, the weighted loss and the validation metrics.

See train/distill.py (steps 2, 3 and 6 of its pipeline).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from taps_jax.models.drafter import Drafter
from taps_jax.models.transformer import Transformer


def default_gamma(block_size: int) -> float:
    """Loss-weight decay: 7 for Kb = 16 (DFlash), scaled as 7 * (Kb - 1) / 15 otherwise."""
    return 7.0 * (block_size - 1) / 15.0


def position_weights(block_size: int, gamma: float | None = None) -> np.ndarray:
    """w_k = exp(-(k-1)/gamma) for drafted slots k = 1..H. [H] float32"""
    gamma = default_gamma(block_size) if gamma is None else gamma
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0 (the decay length of the loss weights), got {gamma!r}")
    return np.exp(-np.arange(block_size - 1) / gamma).astype(np.float32)


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
        # Precomputed features (`tap_features`) when the batch carries them, else the frozen forward here.
        taps_BSF = batch["taps"] if "taps" in batch else target_taps(target, tokens_BS, c.target_layer_ids)
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
