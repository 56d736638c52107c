"""`python -m decode.device_bench`: what this accelerator charges for AR steps, tree verification and each round stage.

On whatever device JAX sees (GPU, TPU or CPU), with random-initialised
bfloat16 models of a chosen size (nothing is downloaded): a target and a
DFlash-shaped drafter (plus a random TAPS scorer). Measures
  * AR ms per step (one token per sequence), batch 1 and 8;
  * the verify cost curve: one target forward over T tree tokens, T = 1..128;
  * per-stage round costs (draft / select / verify) of chain, ddtree and
    taps at budgets 16/32/64/128, batch 1 and 8;
and writes JSON + a PNG. Random weights accept about one token per round, so
the predicted speedup = tau x AR ms / round ms uses these measured costs
with the tau the embedded default set measured (greedy), and says so.
Timings are medians of --reps repeats after a compile-and-warm call.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from decode.common import Parser, choice_list, positive_int
from decode.stages import times_ms
from taps_jax import compile_cache

# Model sizes: (target config, drafter config) as HF / DFlash config fields, or a published config name.
TINY_TARGET = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1024, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=10000.0)
TINY_DRAFTER = dict(architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=1024, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, block_size=16, num_target_layers=2, rope_theta=10000.0,
                    dflash_config={"mask_token_id": 3, "target_layer_ids": [0, 1]})
# ~1.7B: Qwen3-1.7B's published shapes, with a 5-layer DFlash drafter of its width (taps as DFlash spreads them).
ONE_B_TARGET = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2048,
                    intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                    head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0)
ONE_B_DRAFTER = dict(architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=151936, hidden_size=2048,
                     intermediate_size=6144, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, block_size=16, num_target_layers=28, rope_theta=1000000.0,
                     dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 7, 13, 19, 25]})
SIZES = ("tiny", "1b", "4b")
POLICY_NAMES = ("chain", "ddtree", "taps")
CURVE = (1, 2, 4, 8, 16, 32, 64, 128)


def configs(size: str, dtype: str):
    from decode import rehearse
    from taps_jax.checkpoints.dflash import config_from_dflash
    from taps_jax.checkpoints.hf import config_from_hf

    if size == "4b":
        return rehearse.read_configs("qwen3-4b", "dflash-b16", dtype)
    raw_t, raw_d = (TINY_TARGET, TINY_DRAFTER) if size == "tiny" else (ONE_B_TARGET, ONE_B_DRAFTER)
    return config_from_hf(raw_t, f"{size} target", dtype), config_from_dflash(raw_d, f"{size} drafter", dtype)


def random_models(size: str, dtype: str = "bfloat16", seed: int = 0):
    """(Target, DrafterModel, ScorerModel) with random weights, built on the default device."""
    from taps_jax.api import Target
    from taps_jax.checkpoints.scorer import ScorerModel
    from taps_jax.decoder import DrafterModel
    from taps_jax.models.drafter import Drafter
    from taps_jax.models.transformer import Transformer

    tcfg, dcfg = configs(size, dtype)
    target = Target(Transformer(tcfg, nnx.Rngs(seed)), None, ())
    drafter = DrafterModel(Drafter(dcfg, nnx.Rngs(seed + 1)))
    scorer = ScorerModel.for_models(tcfg, dcfg, seed=seed)
    return target, drafter, scorer


def _median_ms(fn, reps: int) -> dict:
    times = times_ms(fn, reps)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, params, cache, tokens_BT):
    """One target forward of T new tokens per sequence over the cache, greedy tokens out (a verify / AR step)."""
    B, T = tokens_BT.shape
    positions_BT = cache.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    mask_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))  # any mask costs the same
    logits_BTV, _, cache = nnx.merge(graphdef, params)(tokens_BT, positions_BT, mask_BTT, cache)
    return jnp.argmax(logits_BTV, axis=-1), cache


def forward_ms(target, batch: int, tokens: int, context: int, reps: int) -> dict:
    from taps_jax.models.cache import KVCache

    cache = KVCache.zeros(target.config, batch, context + tokens)
    cache = cache.replace(lengths_B=jnp.full((batch,), context, jnp.int32))
    tokens_BT = jnp.ones((batch, tokens), jnp.int32)
    return _median_ms(lambda: _forward(target.graphdef, target.params, cache, tokens_BT), reps)


def default_tau(policy: str, budget: int) -> float:
    from decode.rehearse import default_tau as tau

    return tau(policy, budget)


def run(size: str, *, batches=(1, 8), budgets=(16, 32, 64, 128), policies=POLICY_NAMES, curve=CURVE,
        context: int = 512, reps: int = 10, dtype: str = "bfloat16", progress=None) -> dict:
    """All measurements as a dict (see the module docstring).

    Per batch, one prefill and one draft serve every policy and budget (a round's draft does not
    depend on the tree), so only select and verify compile per (policy, budget): fewer compiles of
    the large target, which dominate the wall time on an accelerator.
    """
    from taps_jax.decoder import SpeculativeDecoder, tree_config
    from taps_jax.engine import stages
    from taps_jax.engine.speculative import SpecConfig

    if min(budgets) < 15:  # the shared prefill sizes every state for trees of >= H + 1 nodes
        raise ValueError(f"--budgets must be >= 15 (the drafter's 15 drafted positions), got {min(budgets)}")
    device = jax.devices()[0]
    target, drafter, scorer = random_models(size, dtype)
    H = drafter.config.block_size - 1
    combos = [(policy, H if policy == "chain" else budget)  # a chain is DFlash's whole argmax path
              for policy in policies for budget in ((H,) if policy == "chain" else budgets)]
    jobs = ([("ar", b, None) for b in batches] + [("curve", b, t) for b in batches for t in curve]
            + [("draft", b, None) for b in batches] + [(c, b, None) for b in batches for c in combos])
    bar = tqdm(jobs, desc=f"device_bench {size}", unit="config", file=sys.stderr, disable=progress is False)
    out = {
        "note": ("MEASURED on this device with RANDOM weights (no downloads); the predicted speedup combines these "
                 "measured costs with the greedy tau the embedded default set measured (random weights accept ~1 "
                 "token per round), so it is a prediction, not a measured speedup"),
        "device": f"{device.platform}: {device.device_kind}", "device_count": jax.device_count(),
        "jax": jax.__version__, "size": size, "dtype": dtype, "context": context, "reps": reps,
        "target": {k: getattr(target.config, k) for k in ("num_layers", "hidden_size", "vocab_size", "num_heads",
                                                           "num_kv_heads", "intermediate_size")},
        "drafter_layers": drafter.config.num_layers, "block_size": drafter.config.block_size,
        "ar_ms": {}, "verify_curve_ms": {}, "draft_ms": {}, "rounds": [],
    }
    scorer_graphdef, scorer_params = nnx.split(scorer.module)
    ready = {}
    for kind, b, arg in bar:
        bar.set_postfix_str(f"{kind if isinstance(kind, str) else '%s %d' % kind} batch {b}")
        if kind == "ar":
            out["ar_ms"][str(b)] = forward_ms(target, b, 1, context, reps)
        elif kind == "curve":
            out["verify_curve_ms"].setdefault(str(b), {})[str(arg)] = forward_ms(target, b, arg, context, reps)
        elif kind == "draft":
            # Prefill once, sized for the largest tree; time the draft stage on that state.
            decoder = SpeculativeDecoder(target, drafter, "ddtree", max(budgets))
            call = decoder.prepare([[5 + i] * context for i in range(b)], 64)
            tg, tp, dg, dp, prompt, lens, active, key = call.args
            static = dict(target_graphdef=tg, drafter_graphdef=dg, scorer_graphdef=None, config=call.kwargs["config"])
            state = stages.init_jit((tp, dp, None), prompt, lens, active, key, **static)
            draft = lambda: stages.draft_jit((tp, dp, None), state, **static)
            out["draft_ms"][str(b)] = _median_ms(draft, reps)
            ready[b] = (tg, tp, dg, dp, call.kwargs["config"].decode, state, draft())
        else:
            policy, budget = kind
            tg, tp, dg, dp, decode, state, (dcache, draft_BHV, hidden_BHD) = ready[b]
            tree = tree_config(policy, budget, target.config.vocab_size)
            taps = policy == "taps"
            static = dict(target_graphdef=tg, drafter_graphdef=dg, scorer_graphdef=scorer_graphdef if taps else None,
                          config=SpecConfig(decode, tree))
            params = (tp, dp, scorer_params if taps else None)
            select = lambda: stages.select_jit(params, draft_BHV, hidden_BHD, state.bonus_B, **static)
            select_ms = _median_ms(select, reps)
            chosen = select()
            verify_ms = _median_ms(lambda: stages.verify_jit(params, state, dcache, chosen, **static), reps)
            times = {"draft": out["draft_ms"][str(b)]["median"], "select": select_ms["median"],
                     "verify": verify_ms["median"]}
            round_ms = sum(times.values())
            tau = default_tau(policy, budget)
            ar = out["ar_ms"][str(b)]["median"]
            out["rounds"].append({"policy": policy, "budget": None if policy == "chain" else budget, "batch": b,
                                  "tree_size": tree.tree_size(H), "stage_ms": times,
                                  "spread_ms": {"select": select_ms, "verify": verify_ms},
                                  "round_ms": round_ms, "tau_default_set": tau,
                                  "predicted_speedup": tau * ar / round_ms})
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for batch, curve in result["verify_curve_ms"].items():
        ts = sorted(int(t) for t in curve)
        a.plot(ts, [curve[str(t)]["median"] / curve[str(ts[0])]["median"] for t in ts], marker="o",
               label=f"batch {batch}")
    a.set_xscale("log", base=2)
    a.set_xlabel("tree tokens T")
    a.set_ylabel("forward ms / forward ms at T=1")
    a.set_title("verify cost curve")
    a.legend()
    rows = result["rounds"]
    labels = [f"{r['policy']}{'' if r['budget'] is None else r['budget']}\nb{r['batch']}" for r in rows]
    bottom = np.zeros(len(rows))
    for stage in ("draft", "select", "verify"):
        values = np.array([r["stage_ms"][stage] for r in rows])
        b.bar(range(len(rows)), values, bottom=bottom, label=stage)
        bottom += values
    b.set_xticks(range(len(rows)), labels, fontsize=7)
    b.set_ylabel("ms per round")
    b.set_title("round stages")
    b.legend()
    fig.suptitle(f"device_bench {result['size']} on {result['device']} (random weights, {result['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m decode.device_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=SIZES, default="4b",
                   help="tiny (seconds, any CPU), 1b (Qwen3-1.7B shapes), 4b (Qwen3-4B + DFlash-b16 shapes); default 4b")
    p.add_argument("--batches", type=_ints, default=(1, 8), help="batch sizes (default 1,8)")
    p.add_argument("--budgets", type=_ints, default=(16, 32, 64, 128), help="tree budgets (default 16,32,64,128)")
    p.add_argument("--policies", type=choice_list(POLICY_NAMES), default=POLICY_NAMES, help="default chain,ddtree,taps")
    p.add_argument("--curve", type=_ints, default=CURVE, help="tree sizes of the verify cost curve (default 1..128)")
    p.add_argument("--context", type=positive_int, default=512, help="committed tokens per sequence (default 512)")
    p.add_argument("--reps", type=positive_int, default=10, help="timed repeats per figure (default 10)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--out", type=Path, default=Path("runs/device_bench"),
                   help="directory for device_bench_SIZE.json and .png (default runs/device_bench)")
    compile_cache.add_flag(p)
    return p


def format_result(r: dict) -> str:
    lines = [f"device_bench {r['size']} on {r['device']} ({r['dtype']}, context {r['context']}, median of {r['reps']})"]
    for b, t in r["ar_ms"].items():
        lines.append(f"AR step, batch {b}: {t['median']:.3f} ms (min {t['min']:.3f}, max {t['max']:.3f})")
    for b, curve in r["verify_curve_ms"].items():
        base = r["ar_ms"][b]["median"]
        lines.append(f"verify cost / AR step, batch {b}: " + ", ".join(
            f"T={t}: {c['median'] / base:.2f}x" for t, c in curve.items()))
    lines.append(f"{'policy':8} {'budget':>6} {'batch':>5} {'draft':>8} {'select':>8} {'verify':>8} {'round':>8} "
                 f"{'tau':>5} {'pred. x':>7}")
    for row in r["rounds"]:
        s = row["stage_ms"]
        lines.append(f"{row['policy']:8} {row['budget'] or '-':>6} {row['batch']:>5} {s['draft']:8.2f} "
                     f"{s['select']:8.2f} {s['verify']:8.2f} {row['round_ms']:8.2f} {row['tau_default_set']:5.2f} "
                     f"{row['predicted_speedup']:7.2f}")
    lines.append(r["note"])
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        compile_cache.setup(args)
    except ValueError as e:
        parser.error(str(e))
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    if min(args.budgets) < 15:
        parser.error(f"--budgets must be >= 15 (the drafter's 15 drafted positions), got {min(args.budgets)}")
    start = time.perf_counter()
    result = run(args.size, batches=args.batches, budgets=args.budgets, policies=args.policies, curve=args.curve,
                 context=args.context, reps=args.reps, dtype=args.dtype)
    result["wall_s"] = time.perf_counter() - start
    result["command"] = "python -m decode.device_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"device_bench_{args.size}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(format_result(result))
    print(f"wrote {stem}.json and {stem}.png ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
