"""`python -m taps_jax.convert model.gguf OUT_DIR`: a GGUF file as a Hugging Face model directory.

Writes config.json, model.safetensors, generation_config.json, tokenizer.json
and tokenizer_config.json (with the chat template), the layout every other
tool (and `taps_jax.load_target`) reads. The weights are the GGUF's,
dequantized to --dtype. OUT_DIR must be new or empty: nothing already there
is touched.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def convert(gguf_file, out_dir, dtype: str = "float32") -> Path:
    """Convert a GGUF file into a new (or empty) HF model directory; returns it."""
    from taps_jax.api import load_target
    from taps_jax.checkpoints.gguf import GGUFFile, config_from_gguf, is_gguf
    from taps_jax.checkpoints.hf import config_to_hf

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file() or not is_gguf(gguf_file):
        raise ValueError(f"{gguf_file} is not a GGUF file; pass the .gguf model file to convert")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not an empty directory; choose a new output directory "
                         f"(nothing there was changed)")
    # Every check of the file, and of what a Hugging Face config can say of it, runs before anything is read
    # or written.
    try:
        config_to_hf(config_from_gguf(GGUFFile(gguf_file), dtype))
    except ValueError as e:
        message = str(e)
        raise ValueError(message if message.startswith(str(gguf_file)) else
                         f"{gguf_file}: cannot be written as a Hugging Face model: {message}") from None
    target = load_target(gguf_file, dtype)
    target.save(out_dir)
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m taps_jax.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", type=Path, help="the GGUF model file (llama, qwen2 or qwen3)")
    p.add_argument("out", type=Path, help="a new or empty directory for the Hugging Face layout")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weight dtype written (default float32)")
    args = p.parse_args(argv)
    try:
        out = convert(args.gguf, args.out, args.dtype)
    except ValueError as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
