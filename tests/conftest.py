"""Shared tiny-model fixtures: checkpoints written by `transformers.save_pretrained`.

Everything is float32 and seeded, so the tests are deterministic.

Devices: 8 CPU devices, set here at import, before anything initialises JAX
(it cannot change afterwards), so the sharding tests can build (8,1), (4,2)
and (2,4) meshes in-process. Every other test keeps running on device 0, the
default device; nothing is placed on a mesh unless a test asks for one.
Subprocess tests that need several devices set
XLA_FLAGS=--xla_force_host_platform_device_count=N in the child's environment.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import jax
import numpy as np
import pytest

N_CPU_DEVICES = 8
# The suite compiles with LLVM's backend optimisation off (set here, before JAX starts its CPU backend; the xdist
# workers and every subprocess inherit it). Most of the suite's time is XLA compiling small programs, and the LLVM
# passes are a third of that: tests/test_speculative.py alone took 177 s of CPU at XLA's default level and 109 s
# at 0, run side by side (2026-12-05); the SmolLM2 tests, where the real model's matmuls dominate, took the same
# (253 vs 243 s). The HLO is the same and matmuls are library calls, so results differ only by rounding (the default
# set's logits by 7e-6 of 12; greedy tokens equal); what users run, at XLA's default, is exercised by
# .ci/wheel_check and every benchmark. TAPS_JAX_TEST_XLA_DEFAULT=1 runs the suite at the default level.
if os.environ.get("TAPS_JAX_TEST_XLA_DEFAULT") != "1" and "xla_backend_optimization_level" not in \
        os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
jax.config.update("jax_num_cpu_devices", N_CPU_DEVICES)
# Nothing is written to your home, and a program that several tests build compiles once per run: the compile cache
# (and every other file taps-jax keeps in its cache dir) lives in this run's pytest temp dir, shared by the xdist
# workers and every subprocess (`_suite_cache`). JAX keys an entry on the whole lowered program, its compile options
# and devices, so a test still runs exactly the program it built. tests/test_compile_cache.py uses private dirs.

# Tiny shapes shared by every family: GQA with 4 query heads over 2 kv heads.
TINY = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,  # larger than the default so logits are not all ~0
)

# Llama 3 rope scaling with a small original context, so positions ~40 are
# well past it and the scaled frequencies matter.
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=16, rope_theta=10000.0,
)

# name -> (family, tie_word_embeddings, extra config kwargs)
SPECS = {
    "qwen3": ("qwen3", False, dict(head_dim=16)),
    "qwen3_tied": ("qwen3", True, dict(head_dim=16)),
    "llama3": ("llama", False, dict(hidden_size=64, rope_parameters=LLAMA3_ROPE)),
    "qwen2_tied": ("qwen2", True, dict()),
}


def _hf_classes(family):
    import transformers

    return {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]


def build_hf_model(family: str, tie: bool, seed: int = 0, **overrides):
    """A random tiny HF model (torch, float32, eager attention).

    Norm weights and biases are moved away from their defaults (1 and 0) so
    a loader that dropped them would fail the parity tests.
    """
    import torch

    config_cls, model_cls = _hf_classes(family)
    kwargs = {**TINY, **overrides}
    config = config_cls(tie_word_embeddings=tie, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.3)
    return model


def hf_logits(model, ids) -> np.ndarray:
    """[T] token ids -> [T, V] float32 logits from the torch model."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor(np.asarray(ids)[None], dtype=torch.long)).logits
    return out[0].float().numpy()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: name in SPECS -> (checkpoint dir, torch model); built once per session."""
    made: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in made:
            family, tie, extra = SPECS[name]
            model = build_hf_model(family, tie, seed=len(made) + 1, **extra)
            path = tmp_path_factory.mktemp(f"hf_{name}")
            model.save_pretrained(path)
            made[name] = (path, model)
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_target_dir(hf_checkpoint) -> Path:
    """A transformers-saved tiny Qwen3 (q/k norm, GQA 4/2, untied head, vocab 100)."""
    return hf_checkpoint("qwen3")[0]


@pytest.fixture(scope="session")
def tiny_hf_model(hf_checkpoint):
    """The torch model behind `tiny_target_dir`."""
    return hf_checkpoint("qwen3")[1]


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    """`taps_jax.load_target(tiny_target_dir)` (float32)."""
    import taps_jax

    return taps_jax.load_target(tiny_target_dir)


LITE_LAYERS = 2  # target layers the lite set keeps
LITE_TAPS = (0, 1)  # its drafter's target_layer_ids
LITE_FC_BLOCKS = (1, 0)  # which of the default drafter's fc input blocks (one per tap: layers 1, 3, 5) feed them


@pytest.fixture(scope="session")
def lite_set_dir(tmp_path_factory) -> Path:
    """A model set derived from the embedded default set with a 2-layer target: for engine tests whose property
    does not depend on the shipped set's quality (stream == generate, greedy speculative == greedy AR, shapes,
    recompiles, error messages).

    Why: XLA compiles of the default set's programs are most of the suite's time, and the target's 6 layers are
    unrolled into every program. This set is the same target cut to its first 2 layers (config
    num_hidden_layers=2, the other layers' tensors left out; embedding, final norm, tokenizer and
    generation_config unchanged), so prompts tokenize and decode the same way with 2 layers' compile and run time.
    Its drafter is the default drafter with num_target_layers=2 and target_layer_ids (0, 1): its fc reads
    n_taps x hidden inputs (taps_jax.models.drafter) and ids must be distinct (DrafterConfig), so fc keeps 2 of
    its 3 input blocks: tap 1 keeps its own block (layer 1's output is the same in both targets), tap 0 takes the
    block that read layer 3. scorer/, scorer_greedy/ (their embedding probe still matches: same embedding table),
    adaptive.json, lookup.json (when the set has one) and prompts_heldout.jsonl are copied unchanged.

    What it is not: a good set. Greedy drafts are still accepted (tau about 2 on short code prompts, measured
    2026-12-04, against 3.8-4.1 for the default set), but the shipped figures, tau thresholds and the fitted
    adaptive.json describe the default set; tests of those stay on it (tests/test_default_set.py, ...).
    """
    import json
    import shutil

    from taps_jax.checkpoints.dflash import config_to_dflash, read_drafter_config
    from taps_jax.checkpoints.hf import config_to_hf, read_json, read_target_config
    from taps_jax.checkpoints.tensors import read_tensors, write_tensors
    from taps_jax.model_sets import resolve_set

    src, root = resolve_set("default"), tmp_path_factory.mktemp("lite_set")
    # Target: the first LITE_LAYERS layers, written in the same dtype (bfloat16) as the shipped files.
    raw = read_json(src / "target" / "config.json")
    config = read_target_config(src / "target", dtype=raw["torch_dtype"]).replace(num_layers=LITE_LAYERS)
    extra = {k: raw[k] for k in ("eos_token_id",) if k in raw}
    tensors = {name: t for name, t in read_tensors(src / "target").items()
               if not name.startswith("model.layers.") or int(name.split(".")[2]) < LITE_LAYERS}
    write_tensors(root / "target", tensors)
    (root / "target" / "config.json").write_text(json.dumps(config_to_hf(config, extra), indent=2))
    for file in (src / "target").iterdir():  # tokenizer.json, generation_config.json, ...
        if file.is_file() and file.name != "config.json" and not file.name.endswith(".safetensors"):
            shutil.copy(file, root / "target" / file.name)
    # Drafter: the same layers, fc cut to the taps the shorter target has.
    dconfig = read_drafter_config(src / "drafter", dtype=read_json(src / "drafter" / "config.json")["torch_dtype"])
    assert len(dconfig.target_layer_ids) > max(LITE_FC_BLOCKS), dconfig.target_layer_ids
    dtensors = read_tensors(src / "drafter")
    D = dconfig.hidden_size
    fc = dtensors["fc.weight"]  # [D, n_taps * D]: HF layout [out, in]
    dtensors["fc.weight"] = np.concatenate([fc[:, b * D:(b + 1) * D] for b in LITE_FC_BLOCKS], axis=1)
    dconfig = dconfig.replace(num_target_layers=LITE_LAYERS, target_layer_ids=LITE_TAPS)
    write_tensors(root / "drafter", dtensors)
    (root / "drafter" / "config.json").write_text(json.dumps(config_to_dflash(dconfig), indent=2))
    for name in ("scorer", "scorer_greedy"):
        shutil.copytree(src / name, root / name)
    for name in ("adaptive.json", "lookup.json", "prompts_heldout.jsonl"):
        if (src / name).is_file():
            shutil.copy(src / name, root / name)
    return root


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module.

    XLA:CPU maps every compiled program's code into memory; one process
    running the whole suite reached the kernel's vm.max_map_count (65,530
    mappings) and the next compile segfaulted (CI, exit 139). Clearing
    the caches once a module's fixtures are gone unmaps them (measured: 4,622
    mappings -> 631 after tests/test_generation_edges.py).
    """
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def _suite_cache(tmp_path_factory):
    """$TAPS_JAX_CACHE_DIR for the run (the workers' temp dirs share a parent; pytest deletes old ones), the compile
    cache turned on there for this process and, through the environment, for subprocesses.

    Measured on this 2-core machine: XLA's backend compile is 80% of tests/test_adaptive.py's time.
    """
    from taps_jax import compile_cache

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "taps-jax-cache"
    folder.mkdir(exist_ok=True)
    os.environ.setdefault("TAPS_JAX_CACHE_DIR", str(folder))
    os.environ.setdefault(compile_cache.ENV, "1")
    compile_cache.ensure()  # as a command starts: $TAPS_JAX_CACHE_DIR/xla, or off with $TAPS_JAX_COMPILE_CACHE=0
    yield folder


@pytest.fixture
def no_tracing(monkeypatch):
    """Fail loudly if a call reaches a jitted program: bad input must be rejected before tracing."""
    import taps_jax.api as api
    import taps_jax.decoder as decoder

    def traced(*args, **kwargs):
        raise AssertionError("reached the jitted program; the input should have been rejected before tracing")

    monkeypatch.setattr(decoder, "spec_generate", traced)
    monkeypatch.setattr(api, "ar_generate", traced)
    monkeypatch.setattr(api, "_logits", traced)


# The slowest files first (by `--durations` on this 2-core machine, 2026-12-03): with `--dist loadfile` each file
# runs whole on one worker, and xdist by default hands out files with MORE TESTS first (`--loadscope-reorder`), so
# test_recipe and test_set_recipe (3 tests each, the two longest tests) ran last. pyproject's addopts pass
# `--no-loadscope-reorder`: files go out in this collection order, longest first, the short ones fill the end.
SLOW_FILES = ("test_adaptive", "test_stream", "test_recipe", "test_smollm2", "test_sharding", "test_set_recipe",
              "test_speculative", "test_cli", "test_smollm2_set", "test_refill", "test_docs", "test_compile_cache",
              "test_taps", "test_lookup", "test_distill", "test_traces", "test_long_prompts", "test_own_data",
              "test_default_set")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(SLOW_FILES)))  # stable: order within
