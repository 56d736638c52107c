"""Distillation data: the target's continuations of the prompts, cached, and anchor-keyed batches.

See train/distill.py (steps 1 and 4 of its pipeline). `batch_at(step)` is a
pure function of the step, so a resumed run sees the batches an uninterrupted
one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from taps_jax.api import Target
from taps_jax.engine.batching import bucket
from train.tokenizer import PAD_ID


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
    def concat(cls, parts: list["Sequences"]) -> "Sequences":
        """The rows of every part in order, right-padded with PAD to the widest part."""
        if len(parts) == 1:
            return parts[0]
        width = max(part.seq_len for part in parts)
        tokens = np.full((sum(map(len, parts)), width), PAD_ID, np.int32)
        lo = 0
        for part in parts:
            tokens[lo:lo + len(part), :part.seq_len] = part.tokens
            lo += len(part)
        return cls(tokens, *(np.concatenate([getattr(part, name) for part in parts])
                             for name in ("prompt_lens", "lengths")))

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
    refill_rows: int | None = None,
    static_batches: bool = False,
    save_every_s: float = 60.0,
) -> Sequences:
    """Continue every prompt with the target (AR, `batch_size` rows, continuous batching), cached on disk.

    The first round(greedy_fraction * N) prompts are continued greedily, the
    rest sampled at `temperature` (prompts come in random order, so both
    halves are random subsets); each half is one refilled run (`calls.refilled`:
    a row that stops takes the next prompt, `refill_rows` at a time, default
    batch_size / 8), so no slot waits for the longest answer of its batch (on a
    data-parallel mesh, or with `static_batches`: fixed batches that end with
    their longest answer, for comparison, as decoding jobs do). One cache
    capacity for all: it compiles once per mode and refill bucket. Rows
    are padded to a multiple of `seq_multiple` tokens. Finished answers are
    saved every `save_every_s` seconds under cache_dir: an interrupted run
    continues with the prompts not answered yet (its samples then differ from
    an uninterrupted run's, as any other draw would).
    """
    from taps_jax import sharding  # noqa: PLC0415 (train.distill_data is imported by CPU-only tools too)

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
    static = static_batches or sharding.data_size(target.mesh) > 1  # refilled rows: one batch placement
    rows_per_refill = 0 if static else refill_rows or max(1, batch_size // 8)
    key = hashlib.sha1(json.dumps({
        "target": params_fingerprint(target.params), "eos": list(target.eos_ids),
        "prompts": hashlib.sha1(json.dumps(prompts).encode()).hexdigest(), "gen_tokens": gen_tokens,
        "batch_size": batch_size, "n_greedy": n_greedy, "temperature": temperature, "seed": seed,
        "width": width, "refill_rows": rows_per_refill,
    }, sort_keys=True).encode()).hexdigest()[:12]
    final = cache_dir / f"{name}-{key}" if cache_dir is not None else None
    if (seqs := _cached_answers(final, name)) is not None:
        return seqs
    with contextlib.ExitStack() as held:
        if final is not None:  # two runs answering the same prompts take turns: the second finds the answers
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            held.enter_context(_exclusive(Path(cache_dir) / f"lock-{name}-{key}", f"generate {name}"))
            if (seqs := _cached_answers(final, name)) is not None:
                return seqs
        parts = final / "parts" if final is not None else None
        rows = np.full((n, 2 + width), PAD_ID, np.int32)  # [prompt_len, length, tokens...]
        done = np.zeros(n, bool)
        if parts is not None:
            parts.mkdir(parents=True, exist_ok=True)
            for part in sorted(parts.glob("part-*.npy")):  # answers of an interrupted run: [index, row...]
                got = np.load(part)
                rows[got[:, 0]], done[got[:, 0]] = got[:, 1:], True
        bar = tqdm(total=n, initial=int(done.sum()), desc=f"generate {name}", unit="seq", dynamic_ncols=True,
                   smoothing=0.1, mininterval=1.0 if sys.stderr.isatty() else 30.0)
        t0, made, unsaved, saved_at = time.perf_counter(), 0, [], time.perf_counter()

        def save():
            if parts is not None and unsaved:
                part = parts / f"part-{int(done.sum()):07d}-{len(unsaved):05d}.npy"
                np.save(part.with_suffix(".tmp.npy"), np.concatenate([np.asarray(unsaved)[:, None], rows[unsaved]], 1))
                os.replace(part.with_suffix(".tmp.npy"), part)
                unsaved.clear()

        # The two modes never share a run: [0, n_greedy) greedy, [n_greedy, n) sampled.
        for lo, hi, greedy in ((0, n_greedy, True), (n_greedy, n, False)):
            todo = [i for i in range(lo, hi) if not done[i]]
            if not todo:
                continue
            answers = _static_answers if static else _refilled_answers
            options = dict(temperature=0.0 if greedy else temperature, seed=seed + (0 if greedy else 1),
                           capacity=capacity)
            for finished, utilisation in answers(target, prompts, todo, gen_tokens, batch_size, rows_per_refill,
                                                 options):
                for i, tokens in finished:
                    seq = list(prompts[i]) + list(tokens)
                    rows[i, 0], rows[i, 1] = len(prompts[i]), len(seq)
                    rows[i, 2:2 + len(seq)] = seq
                    done[i] = True
                    unsaved.append(i)
                    made += len(tokens)
                bar.update(len(finished))
                shown = {"slots": f"{utilisation:.0%}"} if utilisation is not None else {}
                bar.set_postfix(tok_s=f"{made / max(time.perf_counter() - t0, 1e-9):,.0f}", **shown, refresh=False)
                if time.perf_counter() - saved_at >= save_every_s:
                    save()
                    saved_at = time.perf_counter()
        save()
        bar.close()
        seqs = Sequences(rows[:, 2:].copy(), rows[:, 0].copy(), rows[:, 1].copy())
        if final is not None:
            seqs.save(final)
            (final / "meta.json").write_text(json.dumps({
                "sequences": n, "greedy": n_greedy, "temperature": temperature if n_greedy < n else None,
                "gen_tokens": gen_tokens, "batch_size": batch_size, "refill_rows": rows_per_refill,
                "seed": seed, "mean_continuation": float(np.mean(seqs.lengths - seqs.prompt_lens)),
                "tokens_per_s": made / max(time.perf_counter() - t0, 1e-9),
            }, indent=2))
            shutil.rmtree(parts, ignore_errors=True)
        return seqs


def _cached_answers(final: Path | None, name: str) -> Sequences | None:
    """The finished answer set cached at `final`, or None."""
    if final is None or not (final / "lengths.npy").is_file():
        return None
    seqs = Sequences.load(final)
    tqdm.write(f"{name}: {len(seqs)} cached target continuations from {final}")
    return seqs


def pack_answers(cache_dir: Path, dest: Path) -> list[Path]:
    """Copy every finished answer set of a data cache (`generate_sequences`' cache_dir) into dest as one compressed
    `<name>-<key>.npz` of token ids (+ its meta.json), small enough to commit; sets already in dest are kept.

    With `unpack_answers` a training run on a new machine starts from these answers instead of generating them
    again (SmolLM2's 990 answers: 11 min of generation here, 0.25 MB packed). The key in the name is what
    `generate_sequences` hashes (target weights, prompts, settings), so answers to other prompts or from another
    target are never picked up: they are simply not found.
    """
    dest.mkdir(parents=True, exist_ok=True)
    packed = []
    for done in sorted(Path(cache_dir).glob("*-*/lengths.npy")):
        out = dest / f"{done.parent.name}.npz"
        if out.is_file():
            continue
        seqs = Sequences.load(done.parent)
        tmp = dest / f"{out.stem}.tmp{os.getpid()}.npz"
        np.savez_compressed(tmp, tokens=seqs.tokens, prompt_lens=seqs.prompt_lens, lengths=seqs.lengths)
        if (done.parent / "meta.json").is_file():
            shutil.copy(done.parent / "meta.json", dest / f"{out.stem}.json")
        os.replace(tmp, out)
        packed.append(out)
    return packed


def unpack_answers(src: Path, cache_dir: Path) -> list[Path]:
    """The inverse of `pack_answers`: each `<name>-<key>.npz` under src becomes the cached answer set
    cache_dir/<name>-<key>/ (unless that exists), where `generate_sequences` finds it by its key."""
    unpacked = []
    for packed in sorted(Path(src).glob("*-*.npz")):
        final = Path(cache_dir) / packed.stem
        if (final / "lengths.npy").is_file():
            continue
        try:
            with np.load(packed) as z:
                seqs = Sequences(z["tokens"], z["prompt_lens"], z["lengths"])
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{packed}: not a packed answer set ({e}); delete it to generate the answers "
                             f"again") from None
        seqs.save(final)
        if packed.with_suffix(".json").is_file():
            shutil.copy(packed.with_suffix(".json"), final / "meta.json")
        unpacked.append(final)
    return unpacked


def _refilled_answers(target, prompts, todo, gen_tokens, batch_size, refill_rows, options):
    """[(prompt index, answer tokens)] as rows finish, with the run's slot utilisation so far."""
    from taps_jax.calls import refilled  # noqa: PLC0415

    run = refilled(target, [prompts[i] for i in todo], gen_tokens, rows=min(batch_size, len(todo)),
                   refill_rows=min(refill_rows, len(todo), batch_size), **options)
    for finished in run:
        yield [(todo[f.index], f.tokens) for f in finished], run.utilisation


def _static_answers(target, prompts, todo, gen_tokens, batch_size, refill_rows, options):
    """[(prompt index, answer tokens)] batch by batch (batch b samples with seed + b)."""
    for b, lo in enumerate(range(0, len(todo), batch_size)):
        idx = todo[lo:lo + batch_size]
        chunk = [prompts[i] for i in idx]
        chunk = chunk + [chunk[0]] * (batch_size - len(chunk))  # one batch shape: one compile
        result = target.generate(chunk, gen_tokens, **{**options, "seed": options["seed"] + b})
        yield list(zip(idx, result.tokens)), None


# --------------------------------------------------------------------------- the draft vocabulary


def label_tokens(seqs: Sequences, region: str = "continuation") -> np.ndarray:
    """The tokens that can be labels (the continuations, or whole sequences for region "all"), flat."""
    S = seqs.seq_len
    j = np.arange(S)[None]
    lo = seqs.prompt_lens[:, None] if region == "continuation" else 0
    return seqs.tokens[(j >= lo) & (j < seqs.lengths[:, None])]


def fit_draft_vocab(seqs: Sequences, size: int, vocab_size: int, region: str = "continuation") -> np.ndarray:
    """The `size` ids the labels use most (ties: the smaller id), ascending. [size] int32"""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"a draft vocabulary of {size} ids does not fit the target's {vocab_size}")
    counts = np.bincount(label_tokens(seqs, region), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # most used first, then by id
    return np.sort(order[:size]).astype(np.int32)


def vocab_coverage(seqs: Sequences, ids: np.ndarray, region: str = "continuation") -> tuple[float, int]:
    """(share of the label tokens inside `ids`, distinct label ids)."""
    tokens = label_tokens(seqs, region)
    return float(np.isin(tokens, ids).mean()) if len(tokens) else 1.0, int(len(np.unique(tokens)))


# --------------------------------------------------------------------------- tap features, computed once


WIDTH_STEP = 64  # the target feature forward's widths are multiples of this


def tap_features(target: Target, seqs: Sequences, layer_ids: tuple[int, ...], cache_dir: Path, name: str,
                 batch_size: int = 8) -> "RowFeatures":
    """The frozen target's tap features [N, S, n_taps * D] (float32) of every sequence, read from disk row by row
    (`target_feature_cache` without soft targets)."""
    return target_feature_cache(target, seqs, layer_ids, cache_dir, name, batch_size=batch_size)["taps"]


class RowFeatures:
    """Features of each row's real positions, stored without padding: row i is flat_TF[offsets[i]:offsets[i + 1]]
    (its first lengths[i] positions). Indexed like the [N, S, F] array it stands for, it gives rows right-padded
    with zeros (no loss reads past a row's end: anchors stop before it and a block sees the context before its
    anchor). SmolLM2's answers fill 62% of their rows, so this holds 0.62x the padded array's bytes."""

    def __init__(self, flat_TF: np.ndarray, lengths_N: np.ndarray, width: int):
        self.flat, self.lengths = flat_TF, np.asarray(lengths_N, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.shape = (len(self.lengths), int(width), flat_TF.shape[1])
        self.dtype = flat_TF.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        rows = np.arange(self.shape[0])[first]
        out = np.zeros((rows.size, *self.shape[1:]), self.dtype)
        for j, r in enumerate(rows.reshape(-1)):
            out[j, :self.lengths[r]] = self.flat[self.offsets[r]:self.offsets[r + 1]]
        out = out[0] if rows.ndim == 0 else out
        return out[rest] if rest else out

    def __array__(self, dtype=None, copy=None):
        return self[:] if dtype is None else self[:].astype(dtype)


def target_feature_cache(target: Target, seqs: Sequences, layer_ids: tuple[int, ...], cache_dir: Path, name: str,
                         soft_k: int = 0, batch_size: int = 8, rows: np.ndarray | None = None) -> dict:
    """What the frozen target gives every sequence, computed once and read from disk: "taps" [N, S, F] float32
    (a `RowFeatures`) and, with soft_k, "soft_ids" [N, S, k] int32 / "soft_p" [N, S, k] float32 memmaps (its top-k
    next tokens).

    The same `target_features` forward the step would run, done once: for a real target it is most of a step
    (SmolLM2: 50-70%), and every pass after the first repeats it. Kept as cache_dir/rows-<name>-<key>.npy (the
    rows' real positions, back to back; soft<k>-ids-... / soft<k>-p-... beside it); the key hashes the weights,
    the tap ids and each row's tokens, so other data or weights never reuse it. When the data grew (a drafter leg
    that adds answers after the earlier ones), an earlier cache of the same weights whose rows are this data's
    first rows becomes this one's start (grown in place, `_grow_in_place`; copied when it has soft targets or is
    one of the padded taps-<name>-<key>.npy files caches were before), and the target runs only over the rows it
    lacks (`_earlier_rows`).

    rows: the rows the caller will read (a training run that draws only some: `AnchorBatches.rows_drawn`); the
    others are left unfilled (zeros) until a later call needs them. A cache that lacks rows has a done-<name>-<key>.npy
    mask beside it, saved as the pass goes, so an interrupted pass resumes with the rows it finished; a complete
    cache has none.
    """
    weights = hashlib.sha1(params_fingerprint(target.params).encode())
    weights.update(repr(tuple(layer_ids)).encode())
    N, S = seqs.tokens.shape
    F = len(layer_ids) * target.config.hidden_size
    cache_dir = Path(cache_dir)
    key = _rows_key(weights, seqs, N)
    files = _feature_files(name, key, N, S, F, soft_k, int(seqs.lengths.astype(np.int64).sum()))
    done_path = cache_dir / f"done-{name}-{key}.npy"
    needed = np.zeros(N, bool)
    needed[np.arange(N) if rows is None else np.asarray(rows, np.int64)] = True

    def cached() -> tuple[dict | None, np.ndarray | None]:  # (the features if they hold every needed row, mask)
        out = _open_features(cache_dir, files, seqs)
        done = _read_done(done_path, N) if out is not None else None
        return (out if out is not None and (done is None or done[needed].all()) else None), done

    if (out := cached()[0]) is not None:
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_dir / f"lock-{name}-{key}", f"target features ({name})"):
        out, done = cached()  # again: a process we waited for may have filled it
        if out is not None:
            return out
        return _fill_features(target, seqs, layer_ids, cache_dir, name, soft_k, batch_size, weights, files,
                              done_path, needed, done)


def _fill_features(target, seqs, layer_ids, cache_dir, name, soft_k, batch_size, weights, files, done_path,
                   needed, done) -> dict:
    """`target_feature_cache`'s pass over the rows `needed` [N] bool that the cache lacks (`done` [N] bool, its
    mask; None: no cache yet, and an earlier cache's rows are taken over first). Runs holding the cache's lock."""
    from flax import nnx  # noqa: PLC0415 (train.distill_data is imported by CPU-only tools too)

    from train.distill_objective import target_features  # noqa: PLC0415

    N, S = seqs.tokens.shape
    F = len(layer_ids) * target.config.hidden_size
    lengths = seqs.lengths.astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n_earlier, earlier = (0, {}) if done is not None else _earlier_rows(cache_dir, name, weights, seqs, F, soft_k)
    if n_earlier and not soft_k and isinstance(earlier["taps"], RowFeatures) and jax.process_count() == 1:
        done = _grow_in_place(cache_dir, name, _rows_key(weights, seqs, n_earlier), files, done_path, N, n_earlier)
    if done is not None:  # a cache that lacks some of the rows needed now: fill them in
        mm = {what: np.load(cache_dir / file, mmap_mode="r+") for what, (file, _, _) in files.items()}
    else:
        done = np.zeros(N, bool)
        _save_done(done_path, done)  # first: files without a mask beside them are complete
        mm = {what: np.lib.format.open_memmap(cache_dir / file, mode="w+", dtype=dtype, shape=shape)
              for what, (file, shape, dtype) in files.items()}
        had = None  # a padded cache of before is complete; a rows cache may lack rows
        if isinstance(earlier.get("taps"), RowFeatures):
            had = _read_done(cache_dir / f"done-{name}-{_rows_key(weights, seqs, n_earlier)}.npy", n_earlier)
        had = np.ones(n_earlier, bool) if had is None else had
        chunks = [lo for lo in range(0, n_earlier, 256) if had[lo:lo + 256].any()]
        for lo in tqdm(chunks, desc=f"target features ({name}): {int(had.sum()):,} rows from an earlier cache",
                       unit="x256 rows", file=sys.stderr, disable=not chunks):
            hi = min(lo + 256, n_earlier)
            for what, old in earlier.items():
                if isinstance(old, RowFeatures):  # the same rows back to back: a prefix of ours
                    mm["taps"][offsets[lo]:offsets[hi]] = old.flat[offsets[lo]:offsets[hi]]
                elif what == "taps":  # a padded cache of before
                    for r in range(lo, hi):
                        mm["taps"][offsets[r]:offsets[r + 1]] = old[r, :lengths[r]]
                else:
                    width = min(S, old.shape[1])  # past it every row is padding
                    mm[what][lo:hi, :width] = old[lo:hi, :width]
        done[:n_earlier] = had
    graphdef = target.graphdef
    features_of = jax.jit(lambda params, tokens_BS: target_features(nnx.merge(graphdef, params), tokens_BS,
                                                                    layer_ids, soft_k))
    todo = np.flatnonzero(needed & ~done)
    gb = sum(int(np.prod(shape)) * 4 for _, shape, _ in files.values()) / 2**30

    def save():
        for value in mm.values():
            value.flush()
        _save_done(done_path, done)

    # Batches of similar lengths, each run only as wide as its longest row (rounded up to WIDTH_STEP: a few
    # compiled shapes). The model is causal, so a position's features do not depend on the width.
    order = todo[np.argsort(seqs.lengths[todo], kind="stable")]
    M, saved = len(order), time.monotonic()
    desc = f"target features ({name}, {gb:.1f} GB{'' if M == N else f', {M:,} of {N:,} rows'})"
    with tqdm(total=M, desc=desc, unit="seq", file=sys.stderr) as bar:
        for lo in range(0, M, batch_size):
            batch = order[np.arange(lo, lo + batch_size) % M]  # the last batch wraps: its batch shape stays
            n = min(batch_size, M - lo)
            width = min(S, -(-int(seqs.lengths[batch].max()) // WIDTH_STEP) * WIDTH_STEP)
            got = jax.device_get(features_of(target.params, seqs.tokens[batch, :width].astype(np.int32)))
            for what, value in zip(("taps", "soft_ids", "soft_p"), got):
                if what == "taps":
                    for j, r in enumerate(batch[:n]):
                        mm["taps"][offsets[r]:offsets[r + 1]] = np.asarray(value[j, :lengths[r]])
                elif what in mm:
                    mm[what][batch[:n], :width] = np.asarray(value)[:n]
            done[batch[:n]] = True
            bar.update(n)
            if time.monotonic() - saved > 120:  # an interrupted pass keeps what it finished
                save()
                saved = time.monotonic()
    save()
    del mm
    if done.all():
        done_path.unlink()
    return _open_features(cache_dir, files, seqs)


def _grow_in_place(cache_dir: Path, name: str, earlier_key: str, files: dict, done_path: Path, N: int,
                   n_earlier: int) -> np.ndarray | None:
    """Makes the earlier rows cache (no soft targets) of this data's first n_earlier rows this cache, in place:
    its rows' positions are the first of ours, back to back, so the file is renamed, its .npy header given our
    shape and its end extended (sparse). Copying instead holds both on disk at once (SmolLM2's leg 10: two files
    of 32 GB and more) and takes minutes. The earlier data's features are then no longer kept apart: a run on that
    data computes them again. Returns our done mask [N] (the earlier's rows that it held), or None when the
    earlier header has no room for our shape (then it is copied)."""
    old_path = cache_dir / f"rows-{name}-{earlier_key}.npy"
    old_done = cache_dir / f"done-{name}-{earlier_key}.npy"
    new_path = cache_dir / files["taps"][0]
    (total, F), dtype = files["taps"][1:]
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                  "fortran_order": False, "shape": (total, F)})
    header = header.getvalue()
    with _exclusive(cache_dir / f"lock-{name}-{earlier_key}", f"target features ({name}, the earlier cache)"):
        if not old_path.exists():  # a run on other data that starts with the same rows took it over meanwhile
            raise RuntimeError(f"the earlier feature cache {old_path} was grown into another run's cache while this "
                               f"one waited for it; run again")
        with open(old_path, "rb") as f:
            if np.lib.format.read_magic(f) != (1, 0):
                return None
            np.lib.format.read_array_header_1_0(f)
            if f.tell() != len(header):  # numpy leaves room in it for a longer first axis
                return None
        had = _read_done(old_done, n_earlier)
        done = np.zeros(N, bool)
        done[:n_earlier] = True if had is None else had
        _save_done(done_path, done)  # first: files without a mask beside them are complete
        # Renamed before it is changed: a crash in between leaves a file of the wrong shape under our name, which
        # the next run overwrites (computing every row again); nothing half-changed is left under the earlier name.
        os.replace(old_path, new_path)
        old_done.unlink(missing_ok=True)
        with open(new_path, "r+b") as f:
            f.write(header)
            f.truncate(len(header) + total * F * np.dtype(dtype).itemsize)
    print(f"target features ({name}): {int(done.sum()):,} rows from the earlier cache {old_path.name}, grown in "
          f"place into {new_path.name}", file=sys.stderr, flush=True)
    return done


@contextlib.contextmanager
def _exclusive(path: Path, what: str):
    """Holds an exclusive lock on the file `path` while the block runs. Two processes filling one cache at once
    (two runs in one work dir) would each write rows and masks the other overwrites, and the second to create the
    files would truncate the first's; with the lock the second waits, then computes only what is still missing.
    The processes of one multi-host job are one run: they compute every row together (a collective on the mesh)
    and write the same bytes, so they take no lock (one would wait on the lock while the other waits on it)."""
    if jax.process_count() > 1:
        yield
        return
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{what}: another process is computing them ({path} is locked); waiting for it", file=sys.stderr,
                  flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock, also when the process dies


def _read_done(path: Path, n: int) -> np.ndarray | None:
    """A feature cache's mask of finished rows; None when it has none (a complete cache), all False when it is
    damaged (the rows are computed again)."""
    if not path.exists():
        return None
    try:
        done = np.load(path)
    except (OSError, ValueError):
        return np.zeros(n, bool)
    return done if done.shape == (n,) and done.dtype == bool else np.zeros(n, bool)


def _save_done(path: Path, done: np.ndarray) -> None:
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npy")
    np.save(tmp, done)
    os.replace(tmp, path)


def _rows_key(weights, seqs: Sequences, n: int) -> str:
    """The cache key of the first n rows' features under `weights` (a sha1 of the weights and tap ids): their
    lengths and real tokens, whatever width the rows were padded to."""
    h = weights.copy()
    h.update(seqs.lengths[:n].astype(np.int64).tobytes())
    for tokens, length in zip(seqs.tokens[:n], seqs.lengths[:n]):
        h.update(tokens[:length].astype(np.int32).tobytes())
    return h.hexdigest()[:12]


def _padded_key(weights, tokens_NS: np.ndarray) -> str:
    """The key of a padded taps-<name>-<key>.npy cache (before `RowFeatures`): the weights and the padded tokens."""
    h = weights.copy()
    h.update(tokens_NS.tobytes())
    return h.hexdigest()[:12]


def _feature_files(name: str, key: str, N: int, S: int, F: int, soft_k: int, total: int | None = None
                   ) -> dict[str, tuple]:
    """{what: (file name, shape, dtype)} of one feature cache: its rows' real positions back to back ([total, F],
    `RowFeatures`), or with total None a padded cache of before ([N, S, F])."""
    files = ({"taps": (f"taps-{name}-{key}.npy", (N, S, F), np.float32)} if total is None else
             {"taps": (f"rows-{name}-{key}.npy", (total, F), np.float32)})
    if soft_k:
        files["soft_ids"] = (f"soft{soft_k}-ids-{name}-{key}.npy", (N, S, soft_k), np.int32)
        files["soft_p"] = (f"soft{soft_k}-p-{name}-{key}.npy", (N, S, soft_k), np.float32)
    return files


def _open_features(cache_dir: Path, files: dict[str, tuple], seqs: Sequences | None = None) -> dict | None:
    """The cache's memmaps (its rows' taps as a `RowFeatures` of seqs' rows), or None when a file is absent,
    damaged or of another shape."""
    out = {}
    for what, (file, shape, dtype) in files.items():
        try:
            got = np.load(cache_dir / file, mmap_mode="r")
        except (OSError, ValueError):
            return None
        if got.shape != shape or got.dtype != dtype:
            return None
        out[what] = got
    if seqs is not None and out["taps"].ndim == 2:
        out["taps"] = RowFeatures(out["taps"], seqs.lengths, seqs.seq_len)
    return out


def _earlier_rows(cache_dir: Path, name: str, weights, seqs: Sequences, F: int,
                  soft_k: int) -> tuple[int, dict]:
    """(n, features) of the largest earlier cache in cache_dir whose data was this data's first n rows (padded
    as `Sequences.concat` padded them then, for a padded cache), under the same weights and tap ids; (0, {}) if
    none. Its key, recomputed from the first n rows, proves the match."""
    N, S = seqs.tokens.shape
    offsets = np.cumsum(seqs.lengths.astype(np.int64))
    best = (0, {})
    for path in sorted(cache_dir.glob(f"rows-{name}-*.npy")):
        try:
            total = np.load(path, mmap_mode="r").shape[0]
        except (OSError, ValueError):
            continue
        n = int(np.searchsorted(offsets, total)) + 1  # the rows whose positions fill `total`
        if not best[0] < n < N or offsets[n - 1] != total:
            continue
        key, width = _rows_key(weights, seqs, n), S
        if soft_k:  # the soft targets are padded to the earlier data's width
            try:
                width = np.load(cache_dir / _feature_files(name, key, n, S, F, soft_k)["soft_ids"][0],
                                mmap_mode="r").shape[1]
            except (OSError, ValueError, IndexError):
                continue
        first = Sequences(seqs.tokens[:n, :width], seqs.prompt_lens[:n], seqs.lengths[:n])
        got = _open_features(cache_dir, _feature_files(name, key, n, width, F, soft_k, total), first)
        if got is not None:
            best = (n, got)
    for path in sorted(cache_dir.glob(f"taps-{name}-*.npy")):
        try:
            n, width = np.load(path, mmap_mode="r").shape[:2]
        except (OSError, ValueError):
            continue
        if not best[0] < n <= N or (width < S and np.any(seqs.tokens[:n, width:] != PAD_ID)):  # n = N: convert
            continue
        tokens = np.full((n, width), PAD_ID, seqs.tokens.dtype)
        tokens[:, :min(width, S)] = seqs.tokens[:n, :min(width, S)]
        got = _open_features(cache_dir, _feature_files(name, _padded_key(weights, tokens), n, width, F, soft_k))
        if got is not None:
            best = (n, got)
    return best


# --------------------------------------------------------------------------- anchors and batches


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
                 region: str = "continuation", seed: int = 0, taps: np.ndarray | None = None,
                 soft: dict[str, np.ndarray] | None = None):
        if len(seqs) == 0:
            raise ValueError("no training sequences")
        if taps is not None and taps.shape[:2] != seqs.tokens.shape:
            raise ValueError(f"tap features {taps.shape} do not match the sequences {seqs.tokens.shape}")
        self.seqs, self.B, self.A, self.Kb = seqs, batch_size, anchors_per_seq, block_size
        self.taps = taps  # [N, S, F] precomputed features (`tap_features`), or None: computed in the step
        self.soft = soft or {}  # precomputed soft targets, "soft_ids" / "soft_p" [N, S, k] (with taps only)
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

    def rows_drawn(self, steps: int) -> np.ndarray:
        """The distinct rows that steps 0 .. steps - 1 draw (sorted): all a run of that length reads."""
        if steps * self.B >= len(self.seqs):
            return np.arange(len(self.seqs))
        return np.unique(np.concatenate([self.rows_at(step) for step in range(steps)]))

    def batch_at(self, step: int) -> dict:
        return self.batch_of(self.rows_at(step), np.random.default_rng([self.seed, 1 << 20, step]))

    def batch_of(self, rows: np.ndarray, rng: np.random.Generator) -> dict:
        anchors, valid = zip(*(sample_anchors(rng, *self.ranges[r], self.A) for r in rows))
        batch = {
            "tokens": self.seqs.tokens[rows].astype(np.int32),
            "anchors": np.stack(anchors),
            "anchor_valid": np.stack(valid),
            "lengths": self.seqs.lengths[rows].astype(np.int32),
        }
        if self.taps is not None:
            batch["taps"] = np.asarray(self.taps[rows])
        for what, values in self.soft.items():
            batch[what] = np.asarray(values[rows])
        return batch

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


def sequences_from_pairs(pairs, gen_tokens: int, max_prompt_tokens: int | None, seq_multiple: int = 16) -> Sequences:
    """Given prompt + response pairs as Sequences (prompts keep their last tokens, responses their first)."""
    rows = [((p[-max_prompt_tokens:] if max_prompt_tokens else p), r[:gen_tokens]) for p, r in pairs]
    width = -(-max(len(p) + len(r) for p, r in rows) // seq_multiple) * seq_multiple
    tokens = np.full((len(rows), width), PAD_ID, np.int32)
    for i, (p, r) in enumerate(rows):
        tokens[i, : len(p) + len(r)] = p + r
    return Sequences(tokens, np.array([len(p) for p, _ in rows], np.int32),
                     np.array([len(p) + len(r) for p, r in rows], np.int32))
