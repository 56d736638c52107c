"""Write GGUF files from Hugging Face models the way llama.cpp's converter does, for the loader's tests.

llama.cpp's conventions (convert_hf_to_gguf.py): the gguf package's
GGUFWriter and tensor-name map; llama's q/k rows permuted for its rope layout;
1-D tensors (norms, biases) kept in F32, matrices in the file type; a tied
model without output.weight; Llama-3 rope scaling as a rope_freqs tensor of
per-frequency factors. `reference_state` gives the tensors a reader must
recover: the HF weights after the same quantize/dequantize round trip.
"""

from __future__ import annotations

import math

import numpy as np

ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # As llama.cpp's LlamaModel.permute writes it.
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _store_type(name: str, w: np.ndarray, qtype):
    import gguf

    if w.ndim == 1 or name == "rope_freqs.weight":
        return gguf.GGMLQuantizationType.F32
    return qtype


def round_trip(w: np.ndarray, qtype) -> np.ndarray:
    """What a file of `qtype` holds of w, back in float32."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), qtype), qtype).reshape(w.shape)


def rope_of(config) -> tuple[float, dict | None]:
    """(rope theta, llama3 scaling dict or None) from a transformers 4 or 5 config."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = params if params.get("rope_type") == "llama3" else getattr(config, "rope_scaling", None)
    return float(theta), (scaling if scaling and scaling.get("rope_type") == "llama3" else None)


def llama3_rope_factors(config) -> np.ndarray:
    """llama.cpp's rope_freqs for a Llama-3 rope_scaling config (its converter's loop)."""
    theta, s = rope_of(config)
    head_dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(out, np.float32)


def write_gguf(model, family: str, path, qtype_name: str = "F16", tokenizer_from=None) -> None:
    """A transformers model as a GGUF file of `qtype_name` (F32, F16, Q8_0, ...).

    tokenizer_from: a GGUF file whose tokenizer.* metadata is copied (optional).
    """
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    c = model.config
    arch = gguf.MODEL_ARCH[ARCH[family]]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    if family == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_of(c)[0])
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if qtype_name == "F16" else gguf.LlamaFileType.MOSTLY_Q8_0))
    if tokenizer_from is not None:
        _copy_tokenizer(tokenizer_from, writer)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    if rope_of(c)[1] is not None:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(c))
    for hf_name, tensor in model.state_dict().items():
        if hf_name.endswith("rotary_emb.inv_freq") or (c.tie_word_embeddings and hf_name == "lm_head.weight"):
            continue
        w = tensor.detach().float().numpy()
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if family == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _permute(w, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        kind = _store_type(name, w, qtype)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w.astype(np.float32))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference_state(model, qtype_name: str) -> dict:
    """The HF state dict as the GGUF file holds it (matrices through the quantization round trip)."""
    import gguf
    import torch

    qtype = gguf.GGMLQuantizationType[qtype_name]
    out = {}
    for name, tensor in model.state_dict().items():
        w = tensor.detach().float().numpy()
        out[name] = torch.from_numpy(w if w.ndim == 1 else round_trip(w, qtype))
    return out


def _copy_tokenizer(source, writer) -> None:
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))
