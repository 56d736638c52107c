"""The round's stages as separately jitted functions, for timing and inspection.

`generate` never uses these (it runs the fused `round_step` inside one
`while_loop`); they exist so a benchmark can time draft / select / verify in
isolation and a notebook can look at one round's tree.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from taps_jax.engine import speculative as spec

_STATIC = ("target_graphdef", "drafter_graphdef", "scorer_graphdef", "config")
_jit = functools.partial(jax.jit, static_argnames=_STATIC)


def _models(params, static):
    return spec._merge(static["target_graphdef"], params[0], static["drafter_graphdef"], params[1],
                       static["scorer_graphdef"], params[2], static["config"])


@_jit
def init_jit(params, prompt_BT, prompt_len_B, active_B, key, **static):
    target, drafter, _ = _models(params, static)
    return spec.init_state(target, drafter, prompt_BT, prompt_len_B, active_B, key, static["config"])


@_jit
def draft_jit(params, state, **static):
    target, drafter, _ = _models(params, static)
    return spec.draft_stage(target, drafter, state, static["config"].lookup)


@_jit
def select_jit(params, draft_BHV, hidden_BHD, bonus_B, **static):
    target, _, scorer = _models(params, static)
    return spec.select_stage(static["config"].tree, target, scorer, draft_BHV, hidden_BHD, bonus_B)


@_jit
def verify_jit(params, state, dcache, tree, **static):
    target, drafter, _ = _models(params, static)
    return spec.verify_stage(target, drafter, state, dcache, tree, static["config"])


@dataclasses.dataclass
class Stages:
    """Inputs of one speculative round, ready to run stage by stage."""

    params: tuple
    static: dict
    state: spec.SpecState

    @classmethod
    def after_prefill(cls, decoder, prompts, max_new_tokens: int = 64, **sampling) -> "Stages":
        call = decoder.prepare(prompts, max_new_tokens, **sampling)
        kwargs = call.kwargs
        tg, tp, dg, dp, prompt, lens, active, key = call.args
        static = dict(target_graphdef=tg, drafter_graphdef=dg,
                      scorer_graphdef=kwargs.get("scorer_graphdef"), config=kwargs["config"])
        params = (tp, dp, kwargs.get("scorer_params"))
        return cls(params, static, init_jit(params, prompt, lens, active, key, **static))

    def draft(self):
        return draft_jit(self.params, self.state, **self.static)

    def select(self, draft_BHV, hidden_BHD):
        return select_jit(self.params, draft_BHV, hidden_BHD, self.state.bonus_B, **self.static)

    def verify(self, dcache, tree):
        return verify_jit(self.params, self.state, dcache, tree, **self.static)


def first_round(decoder, prompt, max_new_tokens: int = 64) -> dict:
    """The draft tree of the first round for one prompt and the path the target accepted.

    Returns numpy arrays: tokens, parents, depths (valid nodes only, root
    first), accepted (tree indices root-first), bonus (the target's next token).
    """
    stages = Stages.after_prefill(decoder, [prompt], max_new_tokens)
    dcache, draft, hidden = stages.draft()
    tree = stages.select(draft, hidden)
    _, acc = stages.verify(dcache, tree)
    valid = np.asarray(tree.valid_BT[0])
    n = int(acc.num_accepted_B[0])
    return {
        "tokens": np.asarray(tree.tokens_BT[0])[valid],
        "parents": np.asarray(tree.parents_BT[0])[valid],
        "depths": np.asarray(tree.depths_BT[0])[valid],
        "accepted": np.asarray(acc.path_BA[0])[:n],
        "bonus": int(acc.bonus_token_B[0]),
    }


def format_tree(view: dict, decode=str, max_children: int = 6) -> str:
    """The tree as indented text; accepted nodes are marked with '*'."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(view["parents"]):
        if i:
            children.setdefault(int(p), []).append(i)
    accepted = set(int(a) for a in view["accepted"])
    lines = []

    def walk(i, indent):
        mark = "*" if i in accepted else " "
        lines.append(f"{'  ' * indent}{mark} {decode([int(view['tokens'][i])])!r}")
        kids = sorted(children.get(i, []), key=lambda c: c not in accepted)  # accepted child first
        for c in kids[:max_children]:
            walk(c, indent + 1)
        if len(kids) > max_children:
            lines.append(f"{'  ' * (indent + 1)}  ... {len(kids) - max_children} more")

    walk(0, 0)
    return "\n".join(lines)
