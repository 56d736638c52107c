"""The public Python API: load a target, get logits, generate."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from taps_jax import chat, sharding
from taps_jax.calls import GenerateCall, GenerateResult, Programs, STREAM_CHUNK
from taps_jax.checkpoints.hf import (
    _prefix, check_dir, config_from_hf, ignored_tensors, load_transformer, read_json, save_transformer,
)
from taps_jax.checkpoints import gguf
from taps_jax.checkpoints.tensors import load_weights
from taps_jax.checkpoints.tokenizer import Tokenizer, load_dir_tokenizer, load_gguf_tokenizer, stop_ids
from taps_jax.config import ModelConfig
from taps_jax.engine.ar import (
    DecodeConfig, ar_advance, ar_extend, ar_generate, ar_outputs, ar_refill, ar_start, ar_until,
)
from taps_jax.engine.batching import check_call, check_lengths, encode_prompts, pad_batch
from taps_jax.engine.prefill import FINISH_NAMES, PREFILL_CHUNK
from taps_jax.engine.sampling import SamplingConfig
from taps_jax.engine.sizing import check_memory, estimate_memory, params_bytes, plan_capacity
from taps_jax.engine.static import StaticGraph
from taps_jax.models.transformer import Transformer
from taps_jax.session import SESSION_CHUNK, ChatSession, session_sizes


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits(graphdef, params, tokens_BT):
    return nnx.merge(graphdef, params).logits(tokens_BT)


class Target:
    """A target model with its tokenizer; the unit every decoder builds on.

    mesh: a `taps_jax.sharding.make_mesh` mesh; the params are placed on it by
    the logical-axis rules (heads / kv heads / MLP / vocab over "model") and
    `generate` splits the batch over "data" (padding it to a multiple of the
    data axis). A model axis that divides the query heads but not the kv
    heads gets each kv head repeated (`sharding.replicate_kv_heads`; `config`
    then reports the repeated count). None (default): one device, as before.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None, eos_ids: tuple[int, ...] = (),
                 mesh=None):
        if mesh is not None:
            sharding.check_config(model.config, mesh, "target", replicate_kv=True)
            model = sharding.replicate_kv_heads(model, mesh)  # a model axis wider than the kv heads
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.mesh = mesh
        self.graphdef, self.params = nnx.split(model)
        self._static_graph = StaticGraph(self.graphdef)  # what generate passes to jit (hashed once)
        if mesh is not None:
            self.params = sharding.shard_params(self.params, mesh)

    def on_mesh(self, mesh) -> "Target":
        """The same model and tokenizer with params placed on `mesh` (None: one device)."""
        if mesh is self.mesh:
            return self
        return Target(nnx.merge(self.graphdef, self.params), self.tokenizer, self.eos_ids, mesh)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def logits(self, token_ids) -> jax.Array:
        """[B, T] int token ids -> [B, T, V] float32 causal logits."""
        tokens = np.asarray(token_ids)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token_ids must be a non-empty [batch, length] integer array, got {tokens.dtype} {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got {tokens.min()}..{tokens.max()}")
        return _logits(self.graphdef, self.params, jnp.asarray(tokens, jnp.int32))

    def encode(self, prompts) -> list[list[int]]:
        return encode_prompts(prompts, self.tokenizer, self.config.vocab_size)

    def chat_prompts(self, conversations) -> list[str]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them -> prompt texts,
        rendered by the model's chat template with the assistant's turn opened."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat; pass token ids to generate")
        if chat.is_conversation(conversations):
            conversations = [conversations]
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise ValueError(f"pass a conversation or a list of them; {chat.ROLES_HINT}")
        return [self.tokenizer.render_chat(c) for c in conversations]

    def chat(self, conversations, max_new_tokens: int = 64, **options) -> GenerateResult:
        """`generate` on chat-templated conversations: each result is the assistant's answer
        (generation stops at the template's end-of-turn token as well as at EOS)."""
        return self.generate(self.chat_prompts(conversations), max_new_tokens, **options)

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; read the token ids instead")
        return self.tokenizer.decode(ids)

    def prepare(
        self,
        prompts,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        capacity: int | None = None,
        stop_at_eos: bool = True,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> GenerateCall:
        """`generate`'s checks and host work, without the decode: a `GenerateCall` to
        `.compile()` ahead of time, `.run()` or `.stream()` (taps_jax.calls)."""
        check_lengths(max_new_tokens)
        sampling = SamplingConfig(temperature, top_k, top_p)
        check_call(seed, capacity, stop_at_eos, prefill_chunk)
        ids = self.encode(prompts)
        capacity = plan_capacity(max(map(len, ids)), max_new_tokens, 0, self.config, capacity)
        prompt, lens, active = pad_batch(ids, capacity, min_batch=sharding.data_size(self.mesh))
        estimate = estimate_memory(self.config, params_bytes(self.params), prompt.shape[0], prompt.shape[1],
                                   capacity, chunk=prefill_chunk)
        check_memory(estimate, self.mesh)
        config = DecodeConfig(max_new_tokens, capacity, sampling, self.eos_ids if stop_at_eos else (), prefill_chunk)
        mesh = self.mesh
        args = (self._static_graph, self.params, sharding.put_batch(prompt, mesh), sharding.put_batch(lens, mesh),
                sharding.put_batch(active, mesh), jax.random.key(seed))
        programs = Programs(ar_generate, ar_start, ar_advance, lambda s, kw: ar_outputs(s), ("graphdef", "config"),
                            ar_until, ar_refill, ar_extend)
        return GenerateCall(programs, args, {"config": config},
                            lambda out: self._result(*out, len(ids)), mesh, estimate)

    def session(self, max_new_tokens: int = 64, *, context: int | None = None, chunk: int = SESSION_CHUNK,
                **options) -> ChatSession:
        """A conversation that keeps its KV cache between turns (`taps_jax.session`): each turn prefills only
        what follows what the cache holds. context: conversation tokens it may hold (default: 4096, or less on a
        shorter target); chunk: prefill tokens per step; options: temperature, top_k, top_p, seed, stop_at_eos."""
        context, capacity = session_sizes(self.config, context, max_new_tokens, 0, chunk)
        call = self.prepare([[0]], max_new_tokens, capacity=capacity, prefill_chunk=chunk, **options)
        return ChatSession(self, call, context, 0)

    def generate(self, prompts, max_new_tokens: int = 64, **options) -> GenerateResult:
        """Plain autoregressive decoding (batched; greedy when temperature is 0).

        prompts: a string, a list of strings, or lists of token ids.
        options: temperature=0.0, top_k=0, top_p=1.0, seed=0, capacity=None,
        stop_at_eos=True, prefill_chunk=512 (see `prepare`).
        capacity: KV-cache slots per sequence (default: the prompt + new tokens, bucketed;
        at most the target's max_position_embeddings).
        prefill_chunk: prompt tokens per prefill step (memory O(chunk x context)).
        Sizes (context, memory) are checked before anything compiles.
        """
        return self.prepare(prompts, max_new_tokens, **options).run()

    def stream(self, prompts, max_new_tokens: int = 64, *, chunk: int = STREAM_CHUNK, **options):
        """Like `generate`, yielding the result so far every `chunk` steps (the last yield == generate's)."""
        return self.prepare(prompts, max_new_tokens, **options).stream(chunk)

    def _result(self, out, n, finish, count, stats=None) -> GenerateResult:
        tokens = [out[b, : n[b]].tolist() for b in range(count)]
        texts = [self.tokenizer.decode(t) for t in tokens] if self.tokenizer else None
        reasons = [FINISH_NAMES[int(f)] for f in finish[:count]]
        return GenerateResult(tokens, reasons, texts, stats or {})

    def save(self, path) -> None:
        """Write the HF layout (config.json, model.safetensors, generation_config.json; tokenizer.json and
        tokenizer_config.json with the chat template when the model has a tokenizer)."""
        path = Path(path)
        eos = list(self.eos_ids)[0] if len(self.eos_ids) == 1 else list(self.eos_ids)
        extra = {"eos_token_id": eos} if self.eos_ids else None
        save_transformer(nnx.merge(self.graphdef, self.params), path, extra)
        if self.eos_ids:
            (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
        if self.tokenizer is not None:
            self.tokenizer.save(path / "tokenizer.json")
            self.tokenizer.save_config(path)


def load_target(path, dtype: str = "float32", mesh=None) -> Target:
    """Load a target: a Hugging Face checkpoint directory or a GGUF file (Qwen3, Llama 3, Qwen2).

    A GGUF file (llama.cpp's format; any type the `gguf` package dequantizes:
    F32/F16/BF16, Q8_0, Q4_0/1, Q5_0/1, K-quants) is dequantized to `dtype`,
    with its tokenizer and chat template.

    mesh: load straight onto a device mesh (`taps_jax.sharding.make_mesh`):
    every parameter is assembled from the slices its devices hold, read
    lazily from the safetensors files, so on a multi-host slice each host
    reads only its own shards. None (default): one device.
    """
    if gguf.is_gguf(path):
        return _load_gguf_target(Path(path), dtype, mesh)
    path = check_dir(path)
    if mesh is None:
        model, raw = load_transformer(path, dtype)
    else:
        raw = read_json(path / "config.json")
        config = config_from_hf(raw, str(path / "config.json"), dtype)
        sharding.check_config(config, mesh, "target", replicate_kv=True)
        abstract = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0)))
        model = sharding.load_module(abstract, path, _prefix, str(path), mesh, ignored_tensors(config))
    tokenizer, eos = load_dir_tokenizer(path, stop_ids(path, raw))
    return Target(model, tokenizer, eos, mesh)


def _load_gguf_target(path: Path, dtype: str, mesh) -> Target:
    """Every check (header, architecture, tensor types, names and shapes, tokenizer) before any weight is read."""
    f = gguf.GGUFFile(path)
    config = gguf.config_from_gguf(f, dtype)
    f.check_types()
    tokenizer, eos = load_gguf_tokenizer(f)
    abstract = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0)))
    if mesh is None:
        model = load_weights(abstract, f, _prefix, str(path), ignored_tensors(config))
    else:
        sharding.check_config(config, mesh, "target", replicate_kv=True)
        model = sharding.load_module(abstract, f, _prefix, str(path), mesh, ignored_tensors(config))
    return Target(model, tokenizer, eos, mesh)
