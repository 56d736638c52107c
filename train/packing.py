"""Pretraining data as packed token windows.

A split becomes one token stream: every file is tokenised and followed by
<|endoftext|> (doc0 EOS doc1 EOS ...), stored as a uint16 `.npy` in a cache dir.
The cache name carries the split, the tokenizer's sha1 and a fingerprint of
the split's file list, so a new tokenizer or another Python's stdlib builds a
new cache instead of silently reusing a stale one.

Batches are windows of seq_len + 1 tokens (inputs = [:, :-1], targets = [:, 1:]).
Training order is an epoch-shuffled set of windows rather than independent
random offsets: the corpus is small, and i.i.d. offsets would leave ~1/e of
it unseen per epoch's worth of samples while repeating other parts. Each epoch
tiles the stream with non-overlapping windows starting at a random phase
(so window boundaries move between epochs) and visits them in a random
permutation. Phase and permutation are functions of (seed, epoch) only, so
`batch_at(step)` needs no iterator state: a resumed run sees exactly the
batches an uninterrupted one would.

    python -m train.packing --tokenizer runs/default/tokenizer --cache-dir runs/default/tokens
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from train import corpus
from train import tokenizer as tokenizer_lib


def cache_path(split: corpus.Split, tokenizer_path: str | Path, cache_dir: str | Path) -> Path:
    files = corpus.files_of(split)
    fingerprint = hashlib.sha1(
        "\n".join(f"{f.rel}:{f.path.stat().st_size}" for f in files).encode()
    ).hexdigest()
    tok_hash = tokenizer_lib.tokenizer_hash(tokenizer_path)
    return Path(cache_dir) / f"{split}-tok{tok_hash[:12]}-files{fingerprint[:8]}.npy"


def tokenize_split(split: corpus.Split, tokenizer_path: str | Path, chunk_files: int = 32) -> np.ndarray:
    """The split's token stream: each document followed by EOS. uint16 [n_tokens]."""
    tok = tokenizer_lib.load_tokenizer(tokenizer_path)
    if tok.get_vocab_size() > 2**16:
        raise ValueError(f"Vocab of {tok.get_vocab_size()} does not fit uint16; use a vocab <= 65536.")
    files = corpus.files_of(split)
    eos = np.array([tokenizer_lib.EOS_ID], dtype=np.uint16)
    parts: list[np.ndarray] = []
    with tqdm(total=len(files), desc=f"tokenise {split}", unit="file") as bar:
        for i in range(0, len(files), chunk_files):
            chunk = files[i : i + chunk_files]
            texts = [t for t in (f.read_text() for f in chunk) if t is not None]  # skip non-UTF-8
            # encode_batch runs the chunk in parallel on the Rust side.
            for enc in tok.encode_batch(texts, add_special_tokens=False):
                parts.append(np.asarray(enc.ids, dtype=np.uint16))
                parts.append(eos)
            bar.update(len(chunk))
    return np.concatenate(parts) if parts else np.zeros([0], np.uint16)


def load_tokens(split: corpus.Split, tokenizer_path: str | Path, cache_dir: str | Path) -> np.ndarray:
    """The split's token stream from the cache (memory-mapped), building it first if missing."""
    path = cache_path(split, tokenizer_path, cache_dir)
    if not path.exists():
        tokens = tokenize_split(split, tokenizer_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, tokens)
        os.replace(tmp, path)  # atomic: a killed build never leaves a truncated cache
    return np.load(path, mmap_mode="r")


def _check_shape(n_tokens: int, batch_size: int, seq_len: int, need: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size={batch_size} and seq_len={seq_len} must both be >= 1.")
    if n_tokens < need:
        raise ValueError(
            f"{n_tokens} tokens are too few for windows of seq_len={seq_len} (need >= {need}); "
            "use a shorter seq_len or a larger split."
        )


class PackedBatches:
    """Deterministic, resumable iterator of int32 batches [batch_size, seq_len + 1].

    `batch_at(step)` is a pure function of (tokens, batch_size, seq_len, seed,
    step); iterating just calls it for start_step, start_step + 1, ... To
    resume, build a new iterator with start_step = the next step to train on.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        start_step: int = 0,
    ):
        # Windows start at phase + w * seq_len with phase < seq_len, and need
        # seq_len + 1 tokens, so one window's worth of the tail is given up.
        _check_shape(len(tokens), batch_size, seq_len, need=2 * seq_len)
        self.tokens = tokens  # [n_tokens] uint16, usually a memmap
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.step = start_step  # the step `next()` returns
        self.num_windows = len(tokens) // seq_len - 1  # per epoch
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}  # small cache: (phase, perm)

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        if epoch not in self._epochs:
            rng = np.random.default_rng([self.seed, epoch])
            phase = int(rng.integers(self.seq_len))
            perm = rng.permutation(self.num_windows)
            if len(self._epochs) >= 2:  # a batch spans at most two epochs when B <= num_windows
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (phase, perm)
        return self._epochs[epoch]

    def window_starts(self, step: int) -> np.ndarray:
        """Token offsets of the batch's windows. [batch_size] int64"""
        samples = step * self.batch_size + np.arange(self.batch_size)
        starts = np.empty(self.batch_size, dtype=np.int64)
        for i, sample in enumerate(samples):
            epoch, index = divmod(int(sample), self.num_windows)
            phase, perm = self._epoch(epoch)
            starts[i] = phase + int(perm[index]) * self.seq_len
        return starts

    def batch_at(self, step: int) -> np.ndarray:
        """int32 [batch_size, seq_len + 1]; inputs = [:, :-1], targets = [:, 1:]."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0.")
        idx_BT = self.window_starts(step)[:, None] + np.arange(self.seq_len + 1)
        return np.asarray(self.tokens[idx_BT], dtype=np.int32)

    def epoch_of(self, step: int) -> float:
        return step * self.batch_size / self.num_windows

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> np.ndarray:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch


def eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None
) -> list[np.ndarray]:
    """Fixed validation batches: int32 [batch_size, seq_len + 1] each.

    Non-overlapping windows from offset 0; when there are more than
    batch_size * max_batches, an evenly spaced subset, so the evaluation still
    covers the whole split rather than its first files. Only full batches.
    """
    _check_shape(len(tokens), batch_size, seq_len, need=batch_size * seq_len + 1)
    n_windows = (len(tokens) - 1) // seq_len
    n_batches = n_windows // batch_size
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    k = n_batches * batch_size
    windows = (np.arange(k) * n_windows) // k  # distinct, evenly spaced, first is 0
    idx_KT = (windows * seq_len)[:, None] + np.arange(seq_len + 1)
    data_KT = np.asarray(tokens[idx_KT], dtype=np.int32)
    return [data_KT[b * batch_size : (b + 1) * batch_size] for b in range(n_batches)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.packing", description="Build the packed token caches of the corpus splits.")
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer.json or its directory")
    parser.add_argument("--cache-dir", type=Path, required=True, help="where the .npy token caches go")
    parser.add_argument("--splits", nargs="+", default=list(corpus.SPLITS), choices=corpus.SPLITS,
                        help="which corpus splits to tokenise")
    args = parser.parse_args(argv)

    for split in args.splits:
        start = time.perf_counter()
        tokens = load_tokens(split, args.tokenizer, args.cache_dir)
        path = cache_path(split, args.tokenizer, args.cache_dir)
        print(f"{split:>10}: {len(tokens):10d} tokens  {path}  ({time.perf_counter() - start:.1f}s)")


if __name__ == "__main__":
    main()
