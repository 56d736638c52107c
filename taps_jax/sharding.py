"""Device meshes and logical-axis sharding rules (one jitted program, many devices).

Mesh
    Two axes, ``("data", "model")``, built with `jax.make_mesh`. "data" splits
    the batch (decoding: sequences; training: examples); "model" is tensor
    parallelism over attention heads, kv heads, the MLP hidden width and the
    vocabulary.

Axis types: Auto, on purpose
    `jax.make_mesh` defaults to Explicit axes in jax 0.10 (sharding in types).
    We pass `AxisType.Auto` for both axes: the models and the decode loop are
    written without sharding annotations, and with Explicit axes every
    ambiguous op (an einsum contracting a sharded dimension, a gather from a
    vocab-sharded table, top-k over a sharded vocabulary, the while-loop carry)
    would need an annotation or would raise. With Auto axes XLA's GSPMD
    propagation places the collectives; we pin only the boundaries: parameters
    (`param_shardings`), inputs (`put_batch`), and, through the optional hooks
    `constrain_kv_cache` / `constrain_batch`, the caches inside the loop. The
    same code runs unchanged with no mesh at all (the hooks are then no-ops).

Logical rules
    Parameters are matched by their NNX path (dotted, e.g.
    ``layers.3.self_attn.q_proj.kernel``; also inside a train state, e.g.
    ``opt_state.1.0.mu.layers.3.self_attn.q_proj.kernel``) against
    `PARAM_RULES`, which name a logical axis per dimension; `LOGICAL_AXES` maps
    logical axes to mesh axes. Unmatched parameters (norms, the drafter's fc,
    the TAPS scorer) are replicated.

    ================================  ====================  ==========
    parameter                         logical axes          mesh axes
    ================================  ====================  ==========
    q_proj kernel [D, N*H]            (embed, heads)        (-, model)
    k/v_proj kernel [D, K*H]          (embed, kv_heads)     (-, model)
    o_proj kernel [N*H, D]            (heads, embed)        (model, -)
    gate/up kernel [D, F]             (embed, mlp)          (-, model)
    down kernel [F, D]                (mlp, embed)          (model, -)
    embed_tokens [V, D]               (vocab, embed)        (model, -)
    lm_head kernel [D, V]             (embed, vocab)        (-, model)
    KV caches [L, B, S, K, H]         (-, batch, -, kv_heads, -)
    decode state [B, ...]             (batch, ...)
    ================================  ====================  ==========

    Embeddings are vocab-parallel (they are the largest single tensors of
    real targets and the head's logits come out vocab-sharded); a vocabulary
    that the model axis does not divide is replicated instead (the only
    "soft" axis). Heads and the MLP width must divide the model axis:
    `check_config` says so before anything is loaded. KV heads that the
    model axis does not divide are repeated for decoding
    (`replicate_kv_heads`: weights, hence caches, grow to lcm(K, M) heads;
    training still requires the model axis to divide them).

Padding
    A batch that the data axis does not divide is padded (`padded_batch`) with
    inactive rows that start finished; callers only see their own rows.

Multi-host
    `initialize_distributed` wraps `jax.distributed.initialize`;
    `load_module` builds each parameter with `jax.make_array_from_callback`
    and reads, from the safetensors files, only the slices that this host's
    devices hold; `put_batch` / `to_host` move host data to and from global
    arrays.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# logical axis -> mesh axis (absent: never sharded)
LOGICAL_AXES: dict[str, str] = {
    "batch": DATA,
    "heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
}
# Logical axes that fall back to replication when the mesh axis does not divide them.
SOFT_AXES = frozenset({"vocab"})

# (pattern matched at the END of the dotted parameter path, logical axis per dimension)
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens\.embedding", ("vocab", "embed")),
    (r"lm_head\.kernel", ("embed", "vocab")),
    (r"self_attn\.q_proj\.kernel", ("embed", "heads")),
    (r"self_attn\.q_proj\.bias", ("heads",)),
    (r"self_attn\.[kv]_proj\.kernel", ("embed", "kv_heads")),
    (r"self_attn\.[kv]_proj\.bias", ("kv_heads",)),
    (r"self_attn\.o_proj\.kernel", ("heads", "embed")),
    (r"mlp\.(gate|up)_proj\.kernel", ("embed", "mlp")),
    (r"mlp\.down_proj\.kernel", ("mlp", "embed")),
)
_COMPILED = tuple((re.compile(r"(^|\.)" + pattern + r"$"), logical) for pattern, logical in PARAM_RULES)

KV_CACHE_AXES = (None, "batch", "kv_heads", None, None)  # keys [L, B, K, H, S], values [L, B, K, S, H]


# --------------------------------------------------------------------------- meshes


def parse_mesh(text: str | None) -> tuple[int, int] | str | None:
    """`--mesh` value -> (data, model), "auto", or None (one device).

    "D,M" asks for a D x M mesh; "auto" for all devices on the data axis.
    Parsing touches no device, so it is safe before `jax.distributed.initialize`.
    """
    if text is None or text.strip().lower() in ("", "none"):
        return None
    if text.strip().lower() == "auto":
        return "auto"
    parts = text.split(",")
    try:
        data, model = (int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"--mesh expects DATA,MODEL (two positive integers, e.g. 4,2) or 'auto', got {text!r}") from None
    if data < 1 or model < 1:
        raise ValueError(f"--mesh sizes must be positive, got {text!r}")
    return data, model


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh with Auto axis types over the first data*model devices.

    data=None: all the devices left after the model axis. A mesh over all
    devices lets `jax.make_mesh` order them for the interconnect (TPU
    topology); on several hosts the mesh must cover every device.
    """
    given = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise ValueError(f"the model axis must be a positive integer, got {model!r}")
    if data is None:
        if len(devices) % model:
            raise ValueError(f"{len(devices)} devices cannot be split into a model axis of {model}")
        data = len(devices) // model
    if isinstance(data, bool) or not isinstance(data, int) or data < 1:
        raise ValueError(f"the data axis must be a positive integer, got {data!r}")
    if data * model > len(devices):
        platform = devices[0].platform if devices else "cpu"
        hint = (" On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting Python."
                if platform == "cpu" else "")
        raise ValueError(f"a {data}x{model} mesh needs {data * model} devices but only {len(devices)} "
                         f"{platform} device(s) are visible.{hint}")
    if data * model < len(devices) and jax.process_count() > 1:
        raise ValueError(f"a {data}x{model} mesh leaves {len(devices) - data * model} of the {len(devices)} devices "
                         f"of this {jax.process_count()}-host job idle; on several hosts the mesh must use them all")
    subset = given or data * model < len(devices)
    return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: data * model] if subset else None)


def mesh_from_flag(text: str | None) -> Mesh | None:
    """The mesh a `--mesh` flag names (None: no mesh, i.e. one device, the default)."""
    shape = parse_mesh(text)
    if shape is None:
        return None
    if shape == "auto":
        return make_mesh(None, 1)
    return make_mesh(*shape)


def data_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.shape[DATA])


def model_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.shape[MODEL])


def describe(mesh: Mesh | None) -> str:
    if mesh is None:
        return "one device"
    platform = mesh.devices.flat[0].platform
    return f"mesh data={data_size(mesh)} x model={model_size(mesh)} ({mesh.devices.size} {platform} devices)"


def use_mesh(mesh: Mesh | None):
    """Context that makes `mesh` current (so the constrain_* hooks apply); a no-op for None."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


# --------------------------------------------------------------------------- rules


def kv_replicas(config, mesh: Mesh | None) -> int:
    """How many copies of each kv head a model axis needs (1: the model axis divides the kv heads).

    A model axis M that does not divide the K kv heads (e.g. 8 kv heads on a
    v5e-16 slice) still works when it divides the N query heads: each kv head
    is repeated r = lcm(K, M) / K times, so every device holds the kv heads its
    own query heads read. r divides the group size N / K (both K and M divide
    N), so query head h still reads (a copy of) kv head h // (N / K).
    """
    m, k = model_size(mesh), config.num_kv_heads
    if k % m == 0:
        return 1
    return math.lcm(k, m) // k


def check_config(config, mesh: Mesh | None, what: str = "model", replicate_kv: bool = False) -> None:
    """Heads, kv heads and MLP width must divide the model axis (a ModelConfig or DrafterConfig).

    replicate_kv: kv heads need not divide the model axis (decoding repeats
    them, `replicate_kv_heads`); heads and the MLP width still must.
    """
    m = model_size(mesh)
    if m == 1:
        return
    n = mesh.devices.size
    values = {"attention heads": config.num_heads, "kv heads": config.num_kv_heads,
              "MLP hidden size": config.intermediate_size}
    if replicate_kv:
        del values["kv heads"]
    for label, value in values.items():
        if value % m:
            fits = max(d for d in range(1, n + 1) if n % d == 0 and all(v % d == 0 for v in values.values()))
            need = "the heads and MLP width" if replicate_kv else "the heads, kv heads and MLP width"
            raise ValueError(
                f"the {what}'s {label} ({value}) are not divisible by the model axis ({m}); "
                f"use a model axis that divides {need}, e.g. --mesh {n // fits},{fits}"
            )


_KV_PARAM = re.compile(r"(^|\.)self_attn\.[kv]_proj\.(kernel|bias)$")


def _repeat_kv(x, r: int, head_dim: int):
    """[..., K*H] -> [..., K*r*H]: each head's H columns repeated r times in place (head k -> k*r .. k*r+r-1)."""
    *lead, width = x.shape
    k = width // head_dim
    x = jax.numpy.broadcast_to(x.reshape(*lead, k, 1, head_dim), (*lead, k, r, head_dim))
    return x.reshape(*lead, k * r * head_dim)


def replicate_kv_heads(module, mesh: Mesh | None):
    """The module (Transformer or Drafter) with kv heads repeated for `mesh`'s model axis, sharded on it.

    Returns the module unchanged when no copy is needed (`kv_replicas` == 1).
    Otherwise the k/v projections are widened to lcm(K, M) heads, the
    config says so (the caches follow it), and the new parameters come out
    of one jitted repeat already placed by the rules: the same function as
    the original, so greedy tokens match one device.
    """
    from flax import nnx

    r = kv_replicas(module.config, mesh)
    if r == 1:
        return module
    config = module.config.replace(num_kv_heads=module.config.num_kv_heads * r)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: type(module)(config, nnx.Rngs(0))))
    _, params = nnx.split(module)

    def expand(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, x: _repeat_kv(x, r, config.head_dim) if _KV_PARAM.search(_path_name(path)) else x, params)

    return nnx.merge(graphdef, jax.jit(expand, out_shardings=param_shardings(abstract, mesh))(params))


def load_spec(name: str, shape, mesh: Mesh, replicate_kv: bool = False) -> P:
    """`param_spec`, except that k/v projections are read whole when they are about to be repeated."""
    if replicate_kv and _KV_PARAM.search(name):
        return P()
    return param_spec(name, shape, mesh)


def _path_name(path) -> str:
    parts = []
    for entry in path:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    while parts and parts[-1] in ("value", "raw_value"):
        parts.pop()
    return ".".join(parts)


def logical_axes(name: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of a parameter from its dotted path (all None: replicated)."""
    for pattern, logical in _COMPILED:
        if pattern.search(name) and len(logical) == ndim:
            return logical
    return (None,) * ndim


def spec_from_logical(logical, shape, mesh: Mesh, name: str = "array") -> P:
    """PartitionSpec for an array with these logical axes; checks divisibility."""
    axes = []
    for dim, axis in zip(shape, logical):
        mesh_axis = LOGICAL_AXES.get(axis) if axis else None
        size = int(mesh.shape[mesh_axis]) if mesh_axis else 1
        if size == 1:
            axes.append(None)
        elif dim % size:
            if axis in SOFT_AXES:
                axes.append(None)  # e.g. a vocabulary the model axis does not divide: replicate
            else:
                raise ValueError(f"{name}: dimension {dim} ({axis}) is not divisible by the {mesh_axis!r} mesh axis "
                                 f"({size}); choose a mesh whose {mesh_axis} axis divides it")
        else:
            axes.append(mesh_axis)
    while axes and axes[-1] is None:
        axes.pop()
    return P(*axes)


def param_spec(name: str, shape, mesh: Mesh) -> P:
    return spec_from_logical(logical_axes(name, len(shape)), shape, mesh, name)


def param_shardings(tree, mesh: Mesh):
    """A NamedSharding for every array leaf of a params / train-state pytree (rules by path)."""

    def one(path, leaf):
        shape = getattr(leaf, "shape", ())
        return NamedSharding(mesh, param_spec(_path_name(path), shape, mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def shard_params(tree, mesh: Mesh | None):
    """Place a params / train-state pytree on the mesh by the rules (None: unchanged)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, param_shardings(tree, mesh))


def replicate(tree, mesh: Mesh | None):
    """Every leaf replicated over the mesh (small models such as the TAPS scorer)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, P()))


# --------------------------------------------------------------------------- batches


def padded_batch(n: int, mesh: Mesh | None) -> int:
    """Smallest multiple of the data axis >= n."""
    d = data_size(mesh)
    return -(-n // d) * d


def batch_spec(ndim: int) -> P:
    return P(DATA, *([None] * (ndim - 1))) if ndim else P()


def put_batch(x, mesh: Mesh | None):
    """A host array [B, ...] as a global array sharded over "data" (B must divide it).

    Works on several hosts too: every host passes the same full array and
    provides only its own devices' rows.
    """
    if mesh is None:
        return jax.numpy.asarray(x)
    x = np.asarray(x)
    if x.ndim and x.shape[0] % data_size(mesh):
        raise ValueError(f"a batch of {x.shape[0]} rows is not divisible by the data axis ({data_size(mesh)}); "
                         "pad it (sharding.padded_batch) or change the batch size")
    sharding = NamedSharding(mesh, batch_spec(x.ndim))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def shard_batch(tree, mesh: Mesh | None):
    """Training batches: host (numpy) leaves are split over "data" on their leading axis.

    Leaves that are already jax arrays are treated as placed by the caller
    (e.g. frozen target params riding in the batch) and left alone.
    """
    if mesh is None:
        return tree

    def one(leaf):
        if isinstance(leaf, jax.Array):
            return leaf
        return put_batch(leaf, mesh)

    return jax.tree.map(one, tree)


def to_host(x) -> np.ndarray:
    """A (possibly multi-host) global array as a full numpy array on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# --------------------------------------------------------------------------- hooks for jitted code


def _current_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def constrain(x, logical: tuple[str | None, ...]):
    """`with_sharding_constraint` by logical axes under the current mesh; identity without one.

    Meant for code traced inside `use_mesh(mesh)` (the decoder and trainer
    enter it around their jitted calls). Axes the mesh does not divide are
    left unconstrained.
    """
    mesh = _current_mesh()
    if mesh is None:
        return x
    axes = []
    for dim, axis in zip(x.shape, logical):
        mesh_axis = LOGICAL_AXES.get(axis) if axis else None
        size = int(mesh.shape[mesh_axis]) if mesh_axis else 1
        axes.append(mesh_axis if size > 1 and dim % size == 0 else None)
    return jax.lax.with_sharding_constraint(x, P(*axes))


def constrain_kv_cache(cache):
    """Pin a KVCache / DrafterCache to (-, data, model, -, -) and its lengths to data.

    Hook for the engine: call it on the caches right after they are created
    (prefill) and on the loop state each round; a no-op without a mesh.
    """
    if _current_mesh() is None:
        return cache

    def one(x):
        if x.ndim == 5:
            return constrain(x, KV_CACHE_AXES)
        return constrain_batch(x)

    return jax.tree.map(one, cache)


def constrain_batch(tree):
    """Pin every array leaf with a leading batch axis to "data" (a no-op without a mesh)."""
    if _current_mesh() is None:
        return tree
    return jax.tree.map(lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1)) if x.ndim else x, tree)


# --------------------------------------------------------------------------- sharded checkpoint loading


def load_module(abstract, path, prefix_of: Callable[[tuple], str], source: str, mesh: Mesh,
                ignore: Callable[[str], bool] = lambda name: False):
    """Fill an abstract (eval_shape'd) module from HF-named safetensors, sharded over `mesh`.

    The shared reader `taps_jax.checkpoints.tensors.load_weights` with this
    module's parameter shardings: only the slices held by this host's devices
    are read from disk, and the full unsharded tensor never sits on one device.
    """
    from taps_jax.checkpoints.tensors import load_weights

    replicate_kv = kv_replicas(abstract.config, mesh) > 1  # k/v read whole, then repeated
    module = load_weights(abstract, Path(path) if isinstance(path, str) else path, prefix_of, source, ignore,
                          sharding_of=lambda name, shape: NamedSharding(mesh, load_spec(name, shape, mesh,
                                                                                        replicate_kv)))
    return replicate_kv_heads(module, mesh)


# --------------------------------------------------------------------------- multi-host


def distributed_settings(coordinator: str | None = None, num_processes: int | None = None,
                         process_id: int | None = None, env=None) -> dict:
    """Arguments for `jax.distributed.initialize`: flags win, then the environment.

    Environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID.
    Whatever stays unset is left to JAX's own cluster detection (TPU pod
    slices, SLURM, ...), which needs nothing at all on a TPU pod slice.
    """
    env = os.environ if env is None else env
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"the process count must be positive, got {num_processes}")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is outside [0, {num_processes})")
    return {k: v for k, v in (("coordinator_address", coordinator), ("num_processes", num_processes),
                              ("process_id", process_id)) if v is not None}


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """`jax.distributed.initialize` from flags or the environment; call before any JAX computation."""
    jax.distributed.initialize(**distributed_settings(coordinator, num_processes, process_id))


def is_main_process() -> bool:
    return jax.process_index() == 0


# --------------------------------------------------------------------------- command-line flags


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (shared by every command-line tool)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_mesh_args(parser: argparse.ArgumentParser) -> None:
    """--mesh and the multi-host flags (see `setup_mesh`)."""
    g = parser.add_argument_group("devices")
    g.add_argument("--mesh", default=None, metavar="DATA,MODEL",
                   help="device mesh: DATA sequences in parallel x MODEL-way tensor parallelism, e.g. 4,2; "
                        "'auto' = all devices on the data axis. Default: one device (no mesh). On CPU, devices come "
                        "from XLA_FLAGS=--xla_force_host_platform_device_count=N, set before starting")
    g.add_argument("--distributed", action="store_true",
                   help="multi-host: call jax.distributed.initialize() first (coordinator, process count and id "
                        "from the flags below, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, "
                        "else JAX's cluster auto-detection, e.g. on TPU pod slices)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="coordinator address (process 0)")
    g.add_argument("--num-processes", type=positive_int, default=None, help="number of processes (hosts)")
    g.add_argument("--process-id", type=int, default=None, help="this process's id in [0, num-processes)")


def setup_mesh(args):
    """Initialise multi-host JAX if asked, then build the --mesh mesh (None: one device).

    Must run before anything touches a device.
    """
    parse_mesh(args.mesh)  # check the flag before any (slow) initialisation
    if args.distributed:
        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    elif args.coordinator or args.num_processes or args.process_id is not None:
        raise ValueError("--coordinator/--num-processes/--process-id only apply with --distributed")
    return mesh_from_flag(args.mesh)
