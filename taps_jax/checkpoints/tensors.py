"""Safetensors I/O and the mapping between NNX parameter paths and HF names.

Weights are read on the host (jax CPU device, which handles bfloat16, unlike
numpy-only readers), checked against the model's expected shapes, and placed
on the accelerator once by the caller.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _host():
    return jax.default_device(jax.local_devices(backend="cpu")[0])  # this process's own CPU


def safetensor_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint dir (single file or sharded with index), each size-checked."""
    if (path / INDEX_NAME).is_file():
        try:
            names = sorted(set(json.loads((path / INDEX_NAME).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path / INDEX_NAME}: not a safetensors index ({e!r}); re-download or re-export "
                             f"the checkpoint") from e
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{path}: shards listed in {INDEX_NAME} are missing: {missing}; "
                             f"re-download or re-export the checkpoint")
        files = [path / n for n in names]
    elif (path / SINGLE_NAME).is_file():
        files = [path / SINGLE_NAME]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{path}: no weights found; expected {SINGLE_NAME} or {INDEX_NAME} with its shards"
        )
    for file in files:
        check_file_size(file)
    return files


def check_file_size(file: Path) -> None:
    """ValueError unless the file is exactly as long as its header says (catches truncated copies).

    Layout: 8-byte little-endian header length n, n bytes of JSON header whose
    tensors' `data_offsets` index the data block that follows.
    """
    size = file.stat().st_size
    fix = "re-download or re-export it"
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise ValueError(f"{file}: cannot read safetensors file: truncated inside its header "
                             f"({size} bytes); {fix}")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"{file}: cannot read safetensors file: malformed header ({e!r}); {fix}") from e
    expected = 8 + n + end
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise ValueError(f"{file}: cannot read safetensors file: {what} (header describes {expected} bytes, "
                         f"the file has {size}); {fix}")


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint dir as host numpy arrays (bf16 via ml_dtypes)."""
    with open_tensors(path) as where:
        return {name: np.asarray(h.get_tensor(name)) for name, h in where.items()}


def write_tensors(path: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int = 4 << 30) -> None:
    """Write tensors as model.safetensors, or as shards with an index when large."""
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    stale = _weight_files(path)  # a previous save here, in either layout
    with _host():
        if len(shards) == 1:
            _atomic_save(shards[0], path / SINGLE_NAME)
            keep = {SINGLE_NAME}
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _atomic_save(shard, path / fname)
                weight_map.update({name: fname for name in shard})
            total = sum(t.nbytes for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (path / INDEX_NAME).write_text(json.dumps(index, indent=2))
            keep = {INDEX_NAME, *weight_map.values()}
    # Remove what the new save did not rewrite: a stale index would otherwise
    # win over a fresh model.safetensors and silently load the old weights.
    # The index goes first, so an interruption never leaves it pointing at nothing.
    for name in sorted(stale - keep, key=lambda n: n != INDEX_NAME):
        (path / name).unlink(missing_ok=True)


def _weight_files(path: Path) -> set[str]:
    """Names of the weight files (and index) a checkpoint dir holds now."""
    names = {n for n in (SINGLE_NAME, INDEX_NAME) if (path / n).is_file()}
    if INDEX_NAME in names:
        try:
            names |= set(json.loads((path / INDEX_NAME).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return names


def _atomic_save(tensors: dict[str, np.ndarray], file: Path) -> None:
    """Write to a temp name and rename, so an interrupted save never leaves a torn file."""
    tmp = file.with_suffix(".tmp")
    save_file({k: jax.numpy.asarray(v) for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, file)


# --- NNX paths <-> Hugging Face names -------------------------------------

def hf_name(path: tuple, prefix: str) -> tuple[str, bool]:
    """HF tensor name for an NNX param path, and whether to transpose it.

    Linear kernels are [in, out] here and [out, in] in HF; embedding tables
    and norm weights keep their shape.
    """
    *parents, leaf = (str(p) for p in path)
    transpose = leaf == "kernel"
    leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    return prefix + ".".join([*parents, leaf]), transpose


def module_to_tensors(module: nnx.Module, prefix_of: Callable[[tuple], str]) -> dict[str, np.ndarray]:
    """Host numpy tensors of a module under HF names (its params and buffers, e.g. a draft vocabulary)."""
    from taps_jax.models.layers import Buffer  # noqa: PLC0415 (models import this module's readers)

    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, (nnx.Param, Buffer))):
        name, transpose = hf_name(path, prefix_of(path))
        value = np.asarray(jax.device_get(var.get_value()))
        out[name] = value.T if transpose else value
    return out


def _match(flat, shapes: dict[str, tuple], prefix_of, source: str, ignore) -> list[tuple]:
    """[(param path, variable, HF name, transpose)] for every parameter, after checking names and shapes.

    Every parameter must be present with the right shape; tensors that map to
    no parameter are an error unless `ignore` accepts them (the names of
    both sides are in the message, so a wrong architecture is obvious).
    """
    used, plan, missing = set(), [], []
    for path, var in flat:
        name, transpose = hf_name(path, prefix_of(path))
        want = tuple(var.get_value().shape)
        expected = want[::-1] if transpose else want
        if name not in shapes:
            missing.append(f"{name!r} (shape {expected})")
            continue
        if tuple(shapes[name]) != expected:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(shapes[name])}, the config expects {expected}")
        used.add(name)
        plan.append((path, var, name, transpose))
    extra = sorted(n for n in shapes if n not in used and not ignore(n))
    if missing:
        # Name the stray tensors too: a renamed tensor shows up on both sides.
        stray = f"; the checkpoint has unmatched tensors: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}" if extra else ""
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:4])}{' ...' if len(missing) > 4 else ''})" if len(missing) > 1 else ""
        raise ValueError(f"{source}: missing tensor {missing[0]}{more}{stray}")
    if extra:
        shown = ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")
        raise ValueError(f"{source}: {len(extra)} tensors match no parameter of this architecture: {shown}")
    return plan


def load_module(
    abstract: nnx.Module,
    tensors: dict[str, np.ndarray],
    prefix_of: Callable[[tuple], str],
    source: str,
    ignore: Callable[[str], bool] = lambda name: False,
) -> nnx.Module:
    """Fill an abstract (eval_shape'd) module from HF-named host tensors in memory (checked as `load_weights`)."""
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    plan = _match(flat, {k: v.shape for k, v in tensors.items()}, prefix_of, source, ignore)
    values = [np.asarray(tensors[n].T if t else tensors[n], dtype=var.get_value().dtype) for _, var, n, t in plan]
    for (_, var, _, _), leaf in zip(plan, jax.device_put(values)):  # one transfer of the whole set
        var.set_value(leaf)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@contextlib.contextmanager
def open_tensors(path: Path):
    """{HF name: lazy safetensors handle} over every weight file of a checkpoint dir, read on the host.

    A GGUF file (taps_jax.checkpoints.gguf) gives handles of the same shape
    that dequantize on read, under the HF names.
    """
    from taps_jax.checkpoints import gguf

    with contextlib.ExitStack() as stack:
        stack.enter_context(_host())
        if isinstance(path, gguf.GGUFFile) or gguf.is_gguf(path):
            yield gguf.Handles(path if isinstance(path, gguf.GGUFFile) else gguf.GGUFFile(path)).mapping()
            return
        where = {}
        for file in safetensor_files(Path(path)):
            try:
                handle = stack.enter_context(safe_open(str(file), framework="flax"))
            except Exception as e:  # truncated or not a safetensors file
                raise ValueError(f"{file}: cannot read safetensors file ({e}); re-export or re-download it") from e
            for name in handle.keys():
                where[name] = handle
        yield where


def read_tensor(path: Path, name: str) -> np.ndarray | None:
    """One tensor of a checkpoint dir as a host array (None if absent), nothing else read."""
    with open_tensors(path) as where:
        return np.asarray(where[name].get_tensor(name)) if name in where else None


def load_weights(
    abstract: nnx.Module,
    path: Path,
    prefix_of: Callable[[tuple], str],
    source: str,
    ignore: Callable[[str], bool] = lambda name: False,
    sharding_of: Callable[[str, tuple], "jax.sharding.Sharding"] | None = None,
) -> nnx.Module:
    """The one safetensors reader of targets, drafters and scorers: fill an abstract module from a checkpoint dir.

    sharding_of: None puts every parameter whole on the default device (one
    transfer). Otherwise sharding_of(param path "a.b.c", shape) gives each
    parameter's sharding and it is built with `jax.make_array_from_callback`:
    only the slices this host's devices hold are read from disk, and the full
    tensor never sits on one device (taps_jax.sharding.load_module).
    """
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    with open_tensors(path) as where:
        shapes = {name: tuple(h.get_slice(name).get_shape()) for name, h in where.items()}
        plan = _match(flat, shapes, prefix_of, source, ignore)
        if sharding_of is None:
            values = []
            for _, var, name, transpose in plan:
                value = np.asarray(where[name].get_tensor(name))
                values.append(np.asarray(value.T if transpose else value, dtype=var.get_value().dtype))
            for (_, var, _, _), leaf in zip(plan, jax.device_put(values)):
                var.set_value(leaf)
            return nnx.merge(graphdef, nnx.from_flat_state(flat))
        for p, var, name, transpose in plan:
            shape, dtype = tuple(var.get_value().shape), var.get_value().dtype
            tensor = where[name].get_slice(name)
            read: dict[tuple, np.ndarray] = {}  # replicated slices are read once, not once per device

            def block(index, tensor=tensor, transpose=transpose, dtype=dtype, shape=shape, read=read):
                index = tuple(index) + (slice(None),) * (len(shape) - len(index))
                key = tuple(s.indices(n) for s, n in zip(index, shape))
                if key not in read:
                    hf_index = index[::-1] if transpose else index
                    value = np.asarray(tensor[hf_index] if hf_index else tensor[:])
                    read[key] = np.asarray(value.T if transpose else value, dtype=dtype)
                return read[key]

            sharding = sharding_of(".".join(str(k) for k in p), shape)
            var.set_value(jax.make_array_from_callback(shape, sharding, block))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def param_shapes(module: nnx.Module, prefix_of: Callable[[tuple], str]) -> dict[str, tuple]:
    """HF tensor names and HF-layout shapes of a module's params (abstract modules too)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        name, transpose = hf_name(path, prefix_of(path))
        shape = tuple(var.get_value().shape)
        out[name] = shape[::-1] if transpose else shape
    return out
