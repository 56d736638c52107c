"""GGUF model files (llama.cpp's format): metadata -> ModelConfig, tensors -> HF names, dequantized.

Parsing and dequantization are ggml's own `gguf` package; this module adds
what a reader of llama.cpp's converter output must undo (DESIGN.md 13):
llama's q/k rows permuted for llama.cpp's rope layout, GGUF dims listed
fastest first, a tied model without `output.weight`, Llama-3 rope scaling as
a `rope_freqs` tensor of per-frequency factors (run as they are, llama.cpp's
rule: each inverse frequency divided by its factor).

Every check that can fail runs on the header before any tensor is read: the
header is read by `read_header` with every count and length bounded by the
file's size (a corrupted count must not make the reader loop or allocate
gigabytes); tensor data stays memory-mapped until it is dequantized.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from pathlib import Path

import numpy as np

from taps_jax.config import ModelConfig, RopeFactors, RopeScaling

MAGIC = b"GGUF"
ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF general.architecture -> our family of the same name
FIX = "re-download or re-convert it"

# GGUF value types (gguf.GGUFValueType) -> struct format of a scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"  # read into the config, not a parameter


def is_gguf(path) -> bool:
    """True for a path that names a GGUF file (by suffix, or by its magic when it is a file)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order (slowest first): GGUF dims reversed
    type: int  # gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the data
    nbytes: int


class _Header:
    """A bounds-checked reader over the GGUF header (metadata + tensor infos): every length is checked
    against the file's size before it is used, so a corrupted count fails at once instead of allocating."""

    def __init__(self, file: Path):
        self.file = file
        self.buf = np.memmap(file, dtype=np.uint8, mode="r") if file.stat().st_size else np.zeros(0, np.uint8)
        self.size = len(self.buf)
        self.pos = 0

    def fail(self, why: str):
        raise ValueError(f"{self.file}: not a readable GGUF file: {why}; {FIX}")

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            self.fail(f"truncated at byte {self.pos} (needs {n} more, the file has {self.size})")

    def scalar(self, fmt: str):
        n = struct.calcsize(fmt)
        self.need(n)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"a string at byte {self.pos - n} is not UTF-8")

    def value(self, kind: int, depth: int = 0):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY and depth == 0:
            item, count = self.scalar("I"), self.scalar("Q")
            if item in _SCALARS:
                fmt = _SCALARS[item]
                n = count * struct.calcsize(fmt)
                self.need(n)
                out = np.frombuffer(self.buf, np.dtype("<" + fmt), count, self.pos).tolist()
                self.pos += n
                return out
            if item == _STRING:
                if count * 8 > self.size - self.pos:
                    self.fail(f"an array claims {count} strings, more than the file can hold")
                return [self.string() for _ in range(count)]
            self.fail(f"unsupported array item type {item}")
        self.fail(f"unsupported metadata value type {kind}")


def read_header(file: Path) -> tuple[dict, list[TensorInfo]]:
    """The metadata and tensor infos of a GGUF file; ValueError naming the file for anything malformed.

    Checks the magic, the version, every length against the file's size, the
    tensor types and that every tensor's data lies inside the file; reads no
    tensor data.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if not file.is_file():
        raise ValueError(f"GGUF file {str(file)!r} does not exist; check the path")
    h = _Header(file)
    if h.size < 24:
        h.fail(f"{h.size} bytes, too short for a GGUF header")
    magic = bytes(h.buf[:4])
    h.pos = 4
    if magic != MAGIC:
        h.fail(f"wrong magic {magic!r} (a GGUF file starts with b'GGUF')")
    version = h.scalar("I")
    if version not in (2, 3):
        h.fail(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = h.scalar("Q"), h.scalar("Q")
    if n_tensors > h.size or n_kv > h.size:
        h.fail(f"the header claims {n_tensors} tensors and {n_kv} metadata keys, more than the file can hold")
    meta = {}
    for _ in range(n_kv):
        key, kind = h.string(), h.scalar("I")
        meta[key] = h.value(kind)
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        h.fail(f"general.alignment {alignment!r} is not a power of two")
    raw = []
    for _ in range(n_tensors):
        name, n_dims = h.string(), h.scalar("I")
        if not 1 <= n_dims <= 4:
            h.fail(f"tensor {name!r} has {n_dims} dimensions (1 to 4 expected)")
        dims = [h.scalar("Q") for _ in range(n_dims)]
        raw.append((name, dims, h.scalar("I"), h.scalar("Q")))
    start = -(-h.pos // alignment) * alignment  # the data block starts at the next aligned offset
    infos = []
    for name, dims, kind, offset in raw:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            h.fail(f"tensor {name!r} has unknown type {kind}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            h.fail(f"tensor {name!r}: rows of {dims[0]} do not fill whole {qtype.name} blocks of {block}")
        nbytes = math.prod(dims) // block * type_size
        if start + offset + nbytes > h.size:
            h.fail(f"tensor {name!r} ({qtype.name}, {nbytes} bytes at offset {start + offset}) runs past the end "
                   f"of the file ({h.size} bytes): the file is truncated")
        infos.append(TensorInfo(name, tuple(reversed(dims)), kind, start + offset, nbytes))
    if len({i.name for i in infos}) != len(infos):
        h.fail("two tensors share a name")
    return meta, infos


class GGUFFile:
    """An opened, checked GGUF file: metadata values, tensor infos, and dequantizing reads under HF names.

    The header is read by `read_header` (bounds-checked; gguf.GGUFReader
    builds a numpy view per string, 3 s for a 49k-token vocabulary); the
    tensor bytes are mapped, not read, until `read`.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.meta, infos = read_header(self.path)
        self.infos = {t.name: t for t in infos}
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.arch = self.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.path}: architecture {self.arch!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")

    def get(self, key: str, default=None):
        return self.meta.get(key, default)

    def arch_key(self, key: str, kind, default=None):
        """`{arch}.{key}` as `kind`; missing without a default is an error naming the key."""
        value = self.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ValueError(f"{self.path}: metadata key {self.arch}.{key!r} is missing; {FIX}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"{self.path}: metadata key {self.arch}.{key} must be a number, got {value!r}")
        if kind is float:  # stored as float32: 1e-5 reads back as 9.99999974e-06; keep the value that was meant
            return float(str(np.float32(value)))
        return kind(value)

    # --- tensors under HF names --------------------------------------------

    def hf_names(self) -> dict[str, str]:
        """{HF name: GGUF name} for every parameter tensor (rope_freqs is config, not a parameter)."""
        out = {}
        for name in self.infos:
            if name == ROPE_FREQS:
                continue
            stem, _, leaf = name.rpartition(".")
            parts = stem.split(".")
            if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
                out[f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{leaf}"] = name
            elif stem in _TOP_NAMES:
                out[f"{_TOP_NAMES[stem]}.{leaf}"] = name
            else:
                raise ValueError(f"{self.path}: tensor {name!r} is not part of a {self.arch} model this loader "
                                 f"knows; is it a {self.arch} model converted by llama.cpp?")
        return out

    def read(self, name: str) -> np.ndarray:
        """One tensor by GGUF name, dequantized to float32 in numpy (HF) order; llama q/k un-permuted."""
        from gguf import GGMLQuantizationType, quants

        info = self.infos[name]
        qtype = GGMLQuantizationType(info.type)
        raw = self._data[info.offset:info.offset + info.nbytes]
        plain = {GGMLQuantizationType.F32: "<f4", GGMLQuantizationType.F16: "<f2"}
        try:
            if qtype in plain:
                value = raw.view(plain[qtype]).astype(np.float32)
            else:
                value = quants.dequantize(np.asarray(raw).reshape(-1, info.nbytes // (math.prod(info.shape) //
                                                                                  info.shape[-1])), qtype)
        except NotImplementedError:
            raise ValueError(f"{self.path}: tensor {name!r} has type {qtype.name}, which the gguf package cannot "
                             f"dequantize; re-quantize the model to a supported type (e.g. Q8_0, Q4_K)") from None
        value = value.reshape(info.shape)
        if self.arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight", ".attn_q.bias",
                                                   ".attn_k.bias")):
            heads = self.arch_key("attention.head_count", int)
            if ".attn_k." in name:
                heads = self.arch_key("attention.head_count_kv", int, heads)
            value = unpermute(value, heads)
        return value

    def check_types(self) -> None:
        """ValueError naming the first tensor whose type cannot be dequantized (before anything is read)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

        for qtype in sorted({GGMLQuantizationType(i.type) for i in self.infos.values()}):
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                continue
            try:  # one zero block: the package says whether it can dequantize this type
                quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
            except NotImplementedError:
                name = next(i.name for i in self.infos.values() if i.type == qtype)
                raise ValueError(f"{self.path}: tensor {name!r} has type {qtype.name}, which the gguf package "
                                 f"cannot dequantize; re-quantize the model to a supported type (e.g. Q8_0, Q4_K)") from None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its rope pairs adjacent dims; HF rotates halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (the inverse of `unpermute`)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- metadata -> ModelConfig ---------------------------------------------


def config_from_gguf(f: GGUFFile, dtype: str = "float32") -> ModelConfig:
    hidden = f.arch_key("embedding_length", int)
    heads = f.arch_key("attention.head_count", int)
    head_dim = f.arch_key("attention.key_length", int, hidden // heads if heads else 0)
    if f.arch_key("attention.value_length", int, head_dim) != head_dim:
        raise ValueError(f"{f.path}: key and value head sizes differ; not supported")
    rotary = f.arch_key("rope.dimension_count", int, head_dim)
    if rotary != head_dim:
        raise ValueError(f"{f.path}: rope over {rotary} of {head_dim} head dims (partial rotary) is not supported")
    kind = f.get(f"{f.arch}.rope.scaling.type", "none")
    if kind not in ("none", "llama3"):
        raise ValueError(f"{f.path}: rope scaling {kind!r} is not supported (supported: none, Llama-3 rope_freqs)")
    for key in ("rope.scaling.factor", "rope.scale_linear"):  # llama.cpp divides every frequency by it
        linear = f.get(f"{f.arch}.{key}")
        if linear not in (None, 0, 1):
            raise ValueError(f"{f.path}: metadata key {f.arch}.{key} = {linear!r} asks for linear rope scaling, "
                             f"which is not supported")
    vocab = f.infos["token_embd.weight"].shape[0] if "token_embd.weight" in f.infos else None
    if vocab is None:
        raise ValueError(f"{f.path}: no token_embd.weight tensor; {FIX}")
    theta = f.arch_key("rope.freq_base", float, 10000.0)
    rope = rope_factors(f, head_dim, theta)
    try:
        return ModelConfig(
            vocab_size=f.arch_key("vocab_size", int, vocab),
            hidden_size=hidden,
            intermediate_size=f.arch_key("feed_forward_length", int),
            num_layers=f.arch_key("block_count", int),
            num_heads=heads,
            num_kv_heads=f.arch_key("attention.head_count_kv", int, heads),
            head_dim=head_dim,
            family=f.arch,
            rope_theta=theta,
            rope_scaling=rope,
            rms_norm_eps=f.arch_key("attention.layer_norm_rms_epsilon", float, 1e-6),
            tie_embeddings="output.weight" not in f.infos,
            max_position_embeddings=f.arch_key("context_length", int, 32768),
            dtype=dtype,
        )
    except ValueError as e:
        raise ValueError(f"{f.path}: {e}") from None


def rope_factors(f: GGUFFile, head_dim: int, theta: float) -> RopeFactors | None:
    """The file's `rope_freqs` factors, to run as they are (llama.cpp divides inverse frequency i by factor i).

    Checked first: head_dim / 2 positive finite factors, in a llama file
    (llama.cpp applies no rope_freqs to qwen2/qwen3). All ones is plain rope.
    The Llama-3 scaling that gives the same factors, when one does, rides
    along for a Hugging Face config (`llama3_equivalent`).
    """
    if ROPE_FREQS not in f.infos:
        return None
    where = f"{f.path}: tensor {ROPE_FREQS!r}"
    if f.arch != "llama":
        raise ValueError(f"{where} in a {f.arch} file: llama.cpp applies rope factors to llama models only, so "
                         f"this is not a file its converter writes; not supported")
    shape = f.infos[ROPE_FREQS].shape
    if shape != (head_dim // 2,):
        raise ValueError(f"{where} has shape {list(shape)}, expected [{head_dim // 2}] (one factor per frequency "
                         f"of head_dim {head_dim}); {FIX}")
    factors = f.read(ROPE_FREQS).astype(np.float64).reshape(-1)
    bad = np.flatnonzero(~(np.isfinite(factors) & (factors > 0)))
    if bad.size:
        raise ValueError(f"{where} holds {float(factors[bad[0]])!r} at frequency {bad[0]} ({bad.size} of "
                         f"{factors.size} factors are not positive and finite); {FIX}")
    if np.all(factors == 1.0):
        return None
    original = f.arch_key("rope.scaling.original_context_length", int, 0) or None
    return RopeFactors(tuple(factors.tolist()), llama3_equivalent(factors, head_dim, theta, original))


def llama3_equivalent(factors, head_dim: int, theta: float, original: int | None = None) -> RopeScaling | None:
    """A Llama-3 rope scaling that gives `factors` (within 1e-5, float32 storage) under llama.cpp's converter
    rule, or None when none does.

    The rule: factor 1 for wavelengths below original / high, `factor`
    above original / low, 1 / ((1 - s) / factor + s) between, with
    s = (original / wavelength - low) / (high - low). Only `factor` and the two
    wavelength bounds shape the factors, so one set of factors has many
    equal parameter sets (and when at most one frequency falls between the
    bounds, many pairs of bounds too: Llama 3's high = 4 x low is tried
    first). The one returned states `original` when the file gives it (a
    `rope.scaling.original_context_length` key), else the long bound as the
    original context with low 1 (Llama 3's) when that bound is a whole
    number of tokens, else 8192 (Llama 3.1's).
    """
    from taps_jax.models.layers import rope_inv_freq

    f = np.asarray(factors, np.float64)
    factor = float(f.max())
    if factor <= 1 or f.min() < 1 - 1e-6 or np.any(np.diff(f) < -1e-6 * factor):
        return None  # Llama-3 factors rise from 1 to `factor` as the wavelength grows
    base = theta ** -(np.arange(0, head_dim, 2) / head_dim)
    u = base / (2 * np.pi)  # 1 / wavelength, decreasing
    s = (1 / f - 1 / factor) / (1 - 1 / factor)  # 1 where a factor is 1, 0 where it is `factor`
    mid = np.flatnonzero((s > 1e-6) & (s < 1 - 1e-6))
    windows = []  # (u_lo, u_hi): the bounds in 1 / wavelength, s = (u - u_lo) / (u_hi - u_lo) between them
    if mid.size >= 2:
        slope, intercept = np.polyfit(u[mid], s[mid], 1)
        if slope > 0:
            windows.append((-intercept / slope, (1 - intercept) / slope))
    elif mid.size == 1:
        j = int(mid[0])
        uj, sj = u[j], s[j]
        windows.append((uj / (1 + 3 * sj), 4 * uj / (1 + 3 * sj)))
        if j > 0:  # the short bound at the next shorter wavelength
            windows.append(((uj - sj * u[j - 1]) / (1 - sj), u[j - 1]))
        if j + 1 < u.size:  # the long bound at the next longer wavelength
            windows.append((u[j + 1], u[j + 1] + (uj - u[j + 1]) / sj))
    else:
        b = int(np.argmax(s < 0.5))  # the first frequency scaled by the full factor
        windows.append((u[b], 4 * u[b] if b == 0 else min(4 * u[b], u[b - 1])))
    tidy_factor = float(f"{factor:.6g}")
    for u_lo, u_hi in windows:
        if not 0 < u_lo < u_hi:
            continue
        low_wavelen, high_wavelen = 1 / u_lo, 1 / u_hi
        context = original
        if context is None:
            whole = round(low_wavelen)
            context = whole if whole >= 1 and abs(low_wavelen - whole) <= 1e-5 * low_wavelen else 8192
        low, high = context / low_wavelen, context / high_wavelen
        for candidate in ((tidy_factor, float(f"{low:.6g}"), float(f"{high:.6g}")), (factor, low, high)):
            scaling = RopeScaling(*map(float, candidate), int(context))
            if np.allclose(base / rope_inv_freq(head_dim, theta, scaling), f, rtol=1e-5, atol=0):
                return scaling
    return None


# --- the tensor source of `taps_jax.checkpoints.tensors.load_weights` -------


class _Slice:
    def __init__(self, file: GGUFFile, name: str):
        self.file, self.name = file, name

    def get_shape(self) -> tuple[int, ...]:
        return self.file.infos[self.name].shape

    def __getitem__(self, index):
        return self.file.read(self.name)[index]  # dequantized whole: blocks span rows


class Handles:
    """{HF name: handle} over a GGUF file, shaped like safetensors' `safe_open` handles (get_slice / get_tensor)."""

    def __init__(self, file: GGUFFile):
        self.file = file
        self.names = file.hf_names()

    def mapping(self) -> dict[str, "Handles"]:
        return {name: self for name in self.names}

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.file, self.names[name])

    def get_tensor(self, name: str) -> np.ndarray:
        return self.file.read(self.names[name])
