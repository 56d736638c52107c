"""A GGUF's `rope_freqs` factors run as they are (llama.cpp's rule: inverse frequency i divided by factor i).

Tiny Llama models (head_dim 16, so few frequencies fall between Llama 3's
wavelength bounds), written the way llama.cpp's converter writes them, match
transformers (float32, eager) on the original config at positions past the
original context; factors that follow no Llama-3 rule match a reference whose
rotary buffers hold them; a bad rope_freqs is one line naming the file and
the tensor.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_helpers import llama3_rope_factors, reference_state, write_gguf  # noqa: E402

import taps_jax  # noqa: E402
from taps_jax import RopeFactors, RopeScaling  # noqa: E402
from taps_jax.checkpoints.gguf import llama3_equivalent  # noqa: E402
from taps_jax.convert import convert  # noqa: E402
from taps_jax.models.layers import rope_inv_freq  # noqa: E402

QTYPE = "F16"
HEAD_DIM = 16


def tiny_llama(theta: float, scaling: dict | None, max_positions: int):
    """hidden 32, 2 heads of 16, 1 layer, vocab 100; q/k and the head scaled up so rope shows in the logits."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=max_positions, rms_norm_eps=1e-5, rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=False, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)  # sharp attention: which position a head looks at depends on its rope angles
            elif name == "lm_head.weight":
                p.mul_(20.0)
    return model


def rewritten(src, dst, *, factors=None, meta=()):
    """A copy of an F16/F32 GGUF file with rope_freqs.weight set to `factors` (added when absent) and extra
    metadata keys [(key, value, GGUFValueType)]."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    for key, value, kind in meta:
        writer.add_key_value(key, value, kind)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(factors, np.float32))
    for t in reader.tensors:
        if t.name == "rope_freqs.weight" and factors is not None:
            continue
        assert t.tensor_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32), t.name
        writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def llama3(factor, original, low=1.0, high=4.0):
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}


def reference_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def plain_rope_logits(model, tokens, theta):
    """The same weights with unscaled rope: how far rope scaling moves these logits (the test's resolution)."""
    rotary = model.model.rotary_emb
    saved = rotary.inv_freq.clone()
    rotary.inv_freq.copy_(torch.from_numpy(rope_inv_freq(HEAD_DIM, theta, None)))
    try:
        return reference_logits(model, tokens)
    finally:
        rotary.inv_freq.copy_(saved)


# (theta, factor, original context, tokens): the first is the file a user's llama.cpp conversion wrote and the
# old loader refused (its fit assumed an original context of 8192); factor 32 is Llama 3.2's, its original
# context scaled down from 8192 to 16 so that a short sequence runs past it.
CASES = {
    "factor8-orig1024": (500000.0, 8.0, 1024, 1100),
    "factor8-orig16": (10000.0, 8.0, 16, 64),
    "factor32-orig16": (10000.0, 32.0, 16, 64),
}


@pytest.mark.parametrize("with_key", [False, True], ids=["no-key", "original-context-key"])
@pytest.mark.parametrize("case", list(CASES))
def test_llama3_rope_freqs_run_as_stored(tmp_path, case, with_key):
    theta, factor, original, length = CASES[case]
    model = tiny_llama(theta, llama3(factor, original), max_positions=2 * length)
    path = tmp_path / "m.gguf"
    write_gguf(model, "llama", path, QTYPE)
    if with_key:
        path = rewritten(path, tmp_path / "key.gguf", meta=[
            ("llama.rope.scaling.original_context_length", original, gguf.GGUFValueType.UINT32)])
    model.load_state_dict(reference_state(model, QTYPE), strict=False)  # what the file holds, dequantized

    target = taps_jax.load_target(path)
    rope = target.config.rope_scaling
    assert isinstance(rope, RopeFactors)
    np.testing.assert_array_equal(rope.factors, llama3_rope_factors(model.config))  # exactly the file's
    assert rope.llama3 == RopeScaling(factor, 1.0, 4.0, original)  # the config's own (low 1: a whole bound)
    hash(target.config)  # a static jit argument

    tokens = np.random.default_rng(1).integers(0, 100, (1, length))
    want = reference_logits(model, tokens)
    got = np.asarray(target.logits(tokens))
    err = np.abs(got - want).max()
    moved = np.abs(plain_rope_logits(model, tokens, theta) - want)[:, original:].max()
    print(f"{case} {'key' if with_key else 'no key'}: max |logit diff| {err:.2e} (rope scaling moves logits "
          f"past position {original} by up to {moved:.2f})")
    assert err < 1e-3 and moved > 0.1


def test_the_refused_file_converts_to_the_same_model(tmp_path):
    """The user's file (factor 8, low 1, high 4, original 1024, head_dim 16, no key): convert writes a config
    whose Llama-3 scaling transformers runs as the file's factors."""
    theta, factor, original, length = CASES["factor8-orig1024"]
    model = tiny_llama(theta, llama3(factor, original), max_positions=2 * length)
    write_gguf(model, "llama", tmp_path / "m.gguf", QTYPE)
    model.load_state_dict(reference_state(model, QTYPE), strict=False)
    out = convert(tmp_path / "m.gguf", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert hf.config.rope_parameters["original_max_position_embeddings"] == original
    tokens = np.random.default_rng(2).integers(0, 100, (1, length))
    err = np.abs(reference_logits(hf, tokens) - reference_logits(model, tokens)).max()
    print(f"converted: max |logit diff| {err:.2e}")
    assert err < 1e-3


def test_factors_of_no_llama3_rule_run_as_stored(tmp_path):
    """Random factors in [1, 4]: they load, match transformers with its rotary buffers set to
    theta^(-2i/d) / factors, and refuse to be written where no Hugging Face config can hold them."""
    theta = 10000.0
    factors = np.random.default_rng(3).uniform(1.0, 4.0, HEAD_DIM // 2).astype(np.float32)
    model = tiny_llama(theta, None, max_positions=256)
    write_gguf(model, "llama", tmp_path / "plain.gguf", QTYPE)
    path = rewritten(tmp_path / "plain.gguf", tmp_path / "m.gguf", factors=factors)
    model.load_state_dict(reference_state(model, QTYPE), strict=False)
    base = theta ** -(np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    rotary = model.model.rotary_emb
    for buffer in (rotary.inv_freq, rotary.original_inv_freq):
        buffer.copy_(torch.from_numpy((base / factors.astype(np.float64)).astype(np.float32)))

    target = taps_jax.load_target(path)
    assert target.config.rope_scaling == RopeFactors(tuple(factors.tolist()), None)
    tokens = np.random.default_rng(4).integers(0, 100, (1, 128))
    want = reference_logits(model, tokens)
    err = np.abs(np.asarray(target.logits(tokens)) - want).max()
    moved = np.abs(plain_rope_logits(model, tokens, theta) - want).max()
    print(f"random factors: max |logit diff| {err:.2e} (the factors move logits by up to {moved:.2f})")
    assert err < 1e-3 and moved > 0.1

    with pytest.raises(ValueError, match=r"m\.gguf: .*follow no Llama-3 rope scaling.*use the GGUF file itself"):
        convert(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    from train.distill import make_drafter_config

    with pytest.raises(ValueError, match="follow no Llama-3 rope scaling"):
        make_drafter_config(target.config)


@pytest.fixture(scope="module")
def plain_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rope") / "plain.gguf"
    write_gguf(tiny_llama(10000.0, None, 256), "llama", path, QTYPE)
    return path


@pytest.mark.parametrize("factors, match", [
    (np.ones(5), r"has shape \[5\], expected \[8\]"),
    (np.ones(16), r"has shape \[16\], expected \[8\]"),
    ([1, 1, 2, 0, 4, 4, 4, 4], r"holds 0\.0 at frequency 3"),
    ([1, 1, -2, 4, 4, 4, 4, 4], r"holds -2\.0 at frequency 2"),
    ([1, 1, 2, 4, np.nan, 4, 4, 4], r"holds nan at frequency 4"),
    ([1, 1, 2, 4, 4, 4, 4, np.inf], r"holds inf at frequency 7"),
], ids=["short", "long", "zero", "negative", "nan", "inf"])
def test_a_bad_rope_freqs_is_one_line_naming_file_and_tensor(tmp_path, plain_file, factors, match):
    bad = rewritten(plain_file, tmp_path / "bad.gguf", factors=factors)
    with pytest.raises(ValueError, match=match) as e:
        taps_jax.load_target(bad)
    message = str(e.value)
    assert message.startswith(f"{bad}: tensor 'rope_freqs.weight'") and "\n" not in message, message


def test_rope_llama_cpp_would_not_run_is_refused(tmp_path, plain_file):
    linear = rewritten(plain_file, tmp_path / "linear.gguf",
                       meta=[("llama.rope.scaling.factor", 4.0, gguf.GGUFValueType.FLOAT32)])
    with pytest.raises(ValueError, match=r"linear\.gguf: metadata key llama\.rope\.scaling\.factor = 4\.0 asks for "
                                         r"linear rope scaling"):
        taps_jax.load_target(linear)
    qwen = tmp_path / "qwen2.gguf"
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, rope_theta=10000.0)
    write_gguf(transformers.AutoModelForCausalLM.from_config(config), "qwen2", tmp_path / "q.gguf", QTYPE)
    rewritten(tmp_path / "q.gguf", qwen, factors=np.full(8, 2.0))
    with pytest.raises(ValueError, match=r"qwen2\.gguf: tensor 'rope_freqs.weight' in a qwen2 file"):
        taps_jax.load_target(qwen)


def test_rope_factors_in_configs():
    """Per-frequency factors are hashable config data; the Llama-3 rule's own factors give its frequencies;
    the fit finds no Llama-3 rule where there is none."""
    scaling = RopeScaling(32.0, 1.0, 4.0, 16)
    base = 10000.0 ** -(np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    factors = base / rope_inv_freq(HEAD_DIM, 10000.0, scaling)
    rope = RopeFactors(list(factors), llama3_equivalent(factors, HEAD_DIM, 10000.0))
    assert rope.llama3 == scaling and isinstance(rope.factors, tuple)
    np.testing.assert_allclose(rope_inv_freq(HEAD_DIM, 10000.0, rope), rope_inv_freq(HEAD_DIM, 10000.0, scaling),
                               rtol=1e-6)
    a = taps_jax.ModelConfig(100, 32, 64, 1, 2, 1, HEAD_DIM, family="llama", rope_scaling=rope)
    b = taps_jax.ModelConfig(100, 32, 64, 1, 2, 1, HEAD_DIM, family="llama", rope_scaling=RopeFactors(factors, scaling))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(ValueError, match="8 rope factors, but head_dim 32 has 16 frequencies"):
        taps_jax.ModelConfig(100, 64, 64, 1, 2, 1, 32, family="llama", rope_scaling=rope)
    with pytest.raises(ValueError, match="rope factor 1 is 0.0"):
        RopeFactors((1.0, 0.0))
    assert llama3_equivalent(factors[::-1], HEAD_DIM, 10000.0) is None  # falling with wavelength
    assert llama3_equivalent(np.ones(8), HEAD_DIM, 10000.0) is None
    from train.distill import make_drafter_config

    drafter = make_drafter_config(a)  # trains with the rope its config.json records
    assert drafter.rope_scaling == scaling
