"""Graph definitions as jit static arguments, hashed once.

jit hashes every static argument on every call, and a flax `GraphDef`
hashes its whole node tree each time: 0.3 ms for the default target, a
third of one of its AR steps, paid per generate call (three times for a
speculative call: target, drafter, scorer). `StaticGraph` keeps the hash.
"""

from __future__ import annotations

import jax
from flax import nnx


class StaticGraph:
    """A `GraphDef` with its hash computed once; equal when the graphs are equal."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef = graphdef.graphdef if isinstance(graphdef, StaticGraph) else graphdef
        self._hash = hash(self.graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticGraph) and (
            self.graphdef is other.graphdef or (self._hash == other._hash and self.graphdef == other.graphdef))

    def __repr__(self) -> str:
        return f"StaticGraph({self.graphdef!r})"


# A pytree without leaves, as a GraphDef is: tracing helpers (eval_shape, make_jaxpr) take a call's args as they are.
jax.tree_util.register_pytree_node(StaticGraph, lambda s: ((), s), lambda s, _: s)


def merge(graphdef, params):
    """`nnx.merge` of a `GraphDef` or a `StaticGraph` with its params."""
    return nnx.merge(graphdef.graphdef if isinstance(graphdef, StaticGraph) else graphdef, params)
