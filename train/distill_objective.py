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


def anchor_context_visibility(anchors_BA, context_len: int):
    """The context part of `anchor_block_mask`, once per block: block j sees positions < anchors[j]. [B, A, C]"""
    return jnp.arange(context_len)[None, None, :] < anchors_BA[:, :, None]


def block_tokens(tokens_BS, anchors_BA, block_size: int, mask_token_id: int):
    """[tok[anchor], MASK x H] per anchor. [B, A, Kb] int32"""
    anchor_tok_BA = jnp.take_along_axis(tokens_BS, anchors_BA, axis=1)
    B, A = anchors_BA.shape
    masks = jnp.full((B, A, block_size - 1), mask_token_id, tokens_BS.dtype)
    return jnp.concatenate([anchor_tok_BA[..., None], masks], axis=-1)


def block_forward(drafter: Drafter, target: Transformer, blocks_BAK, anchors_BA, taps_BSF):
    """Drafter logits [B, A, H, V] (float32; [B, A, H, K] over a draft vocabulary) of all blocks of each sequence
    in ONE forward.

    Block j (tokens blocks_BAK[:, j], embedded with the target's table) sits at
    positions anchors[j] .. anchors[j] + H and attends per `anchor_block_mask`
    to the fused context taps_BSF (positions 0..S-1) and its own block
    (`Drafter.forward_blocks`: the blocks never score each other's keys).
    Slot k predicts the token at anchors[j] + k; slot 0 (the anchor) is not a
    prediction.
    """
    B, A, Kb = blocks_BAK.shape
    S = taps_BSF.shape[1]
    positions_BAK = anchors_BA[..., None] + jnp.arange(Kb, dtype=jnp.int32)
    ctx_positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    embeds_BTD = target.embed(blocks_BAK.reshape(B, A * Kb))
    hidden_BTD = drafter.forward_blocks(
        embeds_BTD, positions_BAK.reshape(B, A * Kb), taps_BSF, ctx_positions_BS,
        anchor_context_visibility(anchors_BA, S),
    )
    hidden_BAHD = hidden_BTD.reshape(B, A, Kb, -1)[:, :, 1:]
    return drafter.head(target, hidden_BAHD)


def target_taps(target: Transformer, tokens_BS, layer_ids: tuple[int, ...]):
    """Frozen tap features [B, S, n_taps * D] of whole sequences (causal; the lm head is skipped)."""
    return target_features(target, tokens_BS, layer_ids)[0]


def target_features(target: Transformer, tokens_BS, layer_ids: tuple[int, ...], soft_k: int = 0):
    """One frozen forward: tap features [B, S, F] and, with soft_k, the target's top-k next-token ids [B, S, k]
    (int32) and probabilities [B, S, k] at every position (the soft targets; None, None without)."""
    B, S = tokens_BS.shape
    positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    causal_BSS = jnp.broadcast_to(jnp.tril(jnp.ones((S, S), bool)), (B, S, S))
    x_BSD, taps_BSF, _ = target.hidden(tokens_BS, positions_BS, causal_BSS, taps=layer_ids)
    if not soft_k:
        return jax.lax.stop_gradient(taps_BSF), None, None
    p_BSk, ids_BSk = jax.lax.top_k(jax.nn.softmax(target.head(x_BSD), axis=-1), soft_k)
    return jax.lax.stop_gradient(taps_BSF), ids_BSk.astype(jnp.int32), jax.lax.stop_gradient(p_BSk)


def soft_targets_at(ids_BSk, p_BSk, anchors_BA, H: int, index_V=None):
    """The soft targets of block slots 1..H: the target's top-k after position anchor + k - 1, [B, A, H, k] ids (in
    the head's index: -1 outside a draft vocabulary) and probabilities renormalised over the ids kept."""
    S = ids_BSk.shape[1]
    pos_BAH = jnp.minimum(anchors_BA[..., None] + jnp.arange(H, dtype=jnp.int32), S - 1)
    batch_B11 = jnp.arange(ids_BSk.shape[0])[:, None, None]
    ids_BAHk, p_BAHk = ids_BSk[batch_B11, pos_BAH], p_BSk[batch_B11, pos_BAH].astype(jnp.float32)
    if index_V is not None:
        ids_BAHk = index_V[ids_BAHk]
        p_BAHk = jnp.where(ids_BAHk >= 0, p_BAHk, 0.0)
    return ids_BAHk, p_BAHk / jnp.maximum(jnp.sum(p_BAHk, axis=-1, keepdims=True), 1e-9)


def labels_and_weights(tokens_BS, anchors_BA, anchor_valid_BA, lengths_B, weights_H):
    """Labels tok[anchor + k] [B, A, H] and loss weights w_k (0 where invalid or past the end)."""
    S = tokens_BS.shape[1]
    H = weights_H.shape[0]
    pos_BAH = anchors_BA[..., None] + jnp.arange(1, H + 1, dtype=jnp.int32)
    labels_BAH = jnp.take_along_axis(tokens_BS[:, None, :], jnp.minimum(pos_BAH, S - 1), axis=2)
    valid_BAH = anchor_valid_BA[..., None] & (pos_BAH < lengths_B[:, None, None])
    return labels_BAH, jnp.where(valid_BAH, weights_H, 0.0), valid_BAH


def make_forward(drafter_graphdef, target_graphdef, weights_H: np.ndarray, buffers=None, soft_k: int = 0):
    """(drafter params, batch) -> (logits [B,A,H,V], labels [B,A,H], weights [B,A,H], valid [B,A,H], soft).

    batch holds the frozen target params under "target" (`loop.run(frozen=...)`: an argument, not a
    closure constant, so they are not baked into the compiled program). buffers: the drafter's untrained
    state (`nnx.split(drafter, nnx.Param, ...)`). With a draft vocabulary the logits are [B,A,H,K] and the
    labels are indices into it: -1 (weight 0, never a hit) for a target token outside it. soft: with
    soft_k, the soft targets (`soft_targets_at`: ids [B,A,H,k], probabilities [B,A,H,k]), else None; from
    the batch's "soft_ids" / "soft_p" when it carries precomputed features.
    """
    weights_H = jnp.asarray(weights_H)
    states = () if buffers is None else (buffers,)

    def forward(params, batch):
        drafter = nnx.merge(drafter_graphdef, params, *states)
        target = nnx.merge(target_graphdef, batch["target"])
        c = drafter.config
        tokens_BS, anchors_BA = batch["tokens"], batch["anchors"]
        # Precomputed features (`tap_features`) when the batch carries them, else the frozen forward here.
        if "taps" in batch:
            taps_BSF, ids_BSk, p_BSk = batch["taps"], batch.get("soft_ids"), batch.get("soft_p")
        else:
            taps_BSF, ids_BSk, p_BSk = target_features(target, tokens_BS, c.target_layer_ids, soft_k)
        blocks_BAK = block_tokens(tokens_BS, anchors_BA, c.block_size, c.mask_token_id)
        logits_BAHV = block_forward(drafter, target, blocks_BAK, anchors_BA, taps_BSF)
        labels_BAH, w_BAH, valid_BAH = labels_and_weights(
            tokens_BS, anchors_BA, batch["anchor_valid"], batch["lengths"], weights_H)
        index_V = None
        if c.draft_vocab_size is not None:
            index_V = jnp.full((c.vocab_size,), -1, jnp.int32).at[drafter.draft_vocab[...]].set(
                jnp.arange(c.draft_vocab_size, dtype=jnp.int32))
            labels_BAH = index_V[labels_BAH]
            w_BAH = jnp.where(labels_BAH >= 0, w_BAH, 0.0)
        soft = None
        if soft_k and ids_BSk is not None:  # validation batches carry none (its loss is the hard labels')
            soft = soft_targets_at(ids_BSk, p_BSk, anchors_BA, weights_H.shape[0], index_V)
        return logits_BAHV, labels_BAH, w_BAH, valid_BAH, soft

    return forward


def cross_entropy(logits_BAHV, labels_BAH):
    """CE per position; a label of -1 (outside the draft vocabulary, weight 0) reads as 0, so it stays finite."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BAHV, jnp.maximum(labels_BAH, 0))


def soft_cross_entropy(logits_BAHV, soft):
    """-sum_j p_j log q(id_j) per position over the soft targets (ids outside a draft vocabulary have p = 0)."""
    ids_BAHk, p_BAHk = soft
    logq_BAHk = jnp.take_along_axis(jax.nn.log_softmax(logits_BAHV, axis=-1), jnp.maximum(ids_BAHk, 0), axis=-1)
    return -jnp.sum(p_BAHk * logq_BAHk, axis=-1)


def make_loss_fn(forward, soft_weight: float = 0.0):
    """(params, batch) -> (sum_k w_k CE_k / sum_k w_k over the batch, {}); with soft targets, CE_k is
    (1 - soft_weight) x the hard label's CE + soft_weight x the soft targets' CE."""

    def loss_fn(params, batch):
        logits_BAHV, labels_BAH, w_BAH, _, soft = forward(params, batch)
        ce_BAH = cross_entropy(logits_BAHV, labels_BAH)
        if soft is not None:
            ce_BAH = (1.0 - soft_weight) * ce_BAH + soft_weight * soft_cross_entropy(logits_BAHV, soft)
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
        logits_BAHV, labels_BAH, w_BAH, valid_BAH, _ = forward(params, batch)
        ce_BAH = cross_entropy(logits_BAHV, labels_BAH)  # hard labels: comparable with or without soft targets
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
