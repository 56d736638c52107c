"""Byte-level BPE for the default model set, trained on the corpus train split.

Byte-level (GPT-2 style) means every string maps to bytes first, so
decode(encode(x)) == x for any Python source: no normalizer, no unknown token,
no prefix space is added, tabs/CRLF/non-ASCII survive.

Pre-tokenization is ByteLevel's GPT-2 regex. For code that means:
  * merges never cross a word/punctuation/whitespace boundary, so no token
    spans code on two different lines;
  * a newline plus the following indentation is one whitespace pre-token
    except for its last space, which attaches to the next word:
    "\\n        return" -> ["\\n       ", " return"] (newline + 7 spaces, then
    " return"). BPE then learns newline+indent tokens for the common depths
    (4, 8, 12, ... minus one), so indentation costs ~1 token per line.

Special tokens, in this id order: <|endoftext|> = 0 (document separator),
<|pad|> = 1, <|mask|> = 2 (the drafter's mask token). They are never produced
from document text: `load_tokenizer` turns on `encode_special_tokens`, so a
literal "<|endoftext|>" inside a source file is encoded as ordinary bytes.

    python -m train.tokenizer --out runs/default/tokenizer --vocab-size 8192
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from train import corpus

EOS, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = (EOS, PAD, MASK)
EOS_ID, PAD_ID, MASK_ID = 0, 1, 2
TOKENIZER_FILE = "tokenizer.json"


def _limited(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """Texts until about max_bytes of UTF-8 have been yielded (the last one is cut)."""
    budget = max_bytes
    for text in texts:
        if budget is None:
            yield text
            continue
        if budget <= 0:
            return
        data = text.encode("utf-8")[:budget]
        budget -= len(data)
        yield data.decode("utf-8", errors="ignore")  # a cut may split a multi-byte char


def train_tokenizer(
        out_dir: str | Path,
        vocab_size: int = 8192,
        max_bytes: int | None = None,
        show_progress: bool = True,
) -> Path:
    """Trains BPE on the train split (or its first max_bytes) and saves out_dir/tokenizer.json."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} cannot hold the 256 byte tokens and 3 specials; use >= 259.")
    if vocab_size > 2**16:
        raise ValueError(f"vocab_size={vocab_size} does not fit the uint16 token cache; use <= 65536.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),  # ids 0, 1, 2 in this order
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
            show_progress=show_progress,
    )
    tok.train_from_iterator(_limited(corpus.iter_texts("train"), max_bytes), trainer=trainer)
    for token, expected in zip(SPECIAL_TOKENS, (EOS_ID, PAD_ID, MASK_ID)):
        assert tok.token_to_id(token) == expected, (token, tok.token_to_id(token))

    out = Path(out_dir) / TOKENIZER_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads tokenizer.json (or a directory holding it) for encoding documents.

    `encode_special_tokens` is not stored in tokenizer.json, so it is set here:
    document text must never turn into control tokens.
    """
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(f"No tokenizer at {path}; train one with `python -m train.tokenizer --out DIR`.")
    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True
    return tok


def tokenizer_hash(path: str | Path) -> str:
    """sha1 of tokenizer.json's bytes: caches of token ids are keyed on it."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    return hashlib.sha1(path.read_bytes()).hexdigest()


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def decode(tok: Tokenizer, ids: list[int]) -> str:
    # Keep specials: skipping them would silently drop ids from a round trip.
    return tok.decode(ids, skip_special_tokens=False)


def bytes_per_token(tok: Tokenizer, texts: Iterable[str], batch: int = 64) -> tuple[int, int]:
    """(total UTF-8 bytes, total tokens) over texts; compression = bytes / tokens."""
    n_bytes = n_tokens = 0
    texts = list(texts)
    for i in range(0, len(texts), batch):
        chunk = texts[i : i + batch]
        n_bytes += sum(len(t.encode("utf-8")) for t in chunk)
        n_tokens += sum(len(e.ids) for e in tok.encode_batch(chunk, add_special_tokens=False))
    return n_bytes, n_tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.tokenizer", description="Train the byte-level BPE tokenizer on the stdlib train split.")
    parser.add_argument("--out", type=Path, required=True, help="directory for tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (3 special tokens included)")
    parser.add_argument("--max-bytes", type=int, default=None, help="train on only the first N bytes of the split")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    path = train_tokenizer(args.out, args.vocab_size, args.max_bytes)
    print(f"wrote {path} ({time.perf_counter() - start:.1f}s, sha1 {tokenizer_hash(path)[:12]})")
    tok = load_tokenizer(path)
    n_bytes, n_tokens = bytes_per_token(tok, corpus.iter_texts("validation"))
    print(f"validation: {n_bytes} bytes / {n_tokens} tokens = {n_bytes / n_tokens:.3f} bytes/token")


if __name__ == "__main__":
    main()
