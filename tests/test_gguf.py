"""GGUF targets: random llama / qwen2 / qwen3 models written with llama.cpp's conventions load with the
logits of the Hugging Face model holding the same (dequantized) tensors; convert; bad files."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_helpers import reference_state, write_gguf  # noqa: E402

import taps_jax  # noqa: E402
from taps_jax.checkpoints.gguf import GGUFFile, read_header  # noqa: E402
from taps_jax.convert import convert  # noqa: E402

SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def hf_model(family: str):
    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2}[family])
    if family == "llama":  # Llama-3 rope scaling, untied head
        config = transformers.LlamaConfig(**SIZES, rope_theta=10000.0, tie_word_embeddings=False,
                                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})
    elif family == "qwen2":  # q/k/v biases, tied head
        config = transformers.Qwen2Config(**SIZES, rope_theta=10000.0, tie_word_embeddings=True)
    else:  # head_dim 32 != hidden / heads = 16
        config = transformers.Qwen3Config(**SIZES, head_dim=32, rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mis-mapped one shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


TOKENS = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 96))  # long enough for rope scaling to show


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gguf_matches_hf_on_the_same_tensors(tmp_path, family, qtype):
    model = hf_model(family)
    path = tmp_path / f"{family}-{qtype}.gguf"
    write_gguf(model, family, path, qtype)
    model.load_state_dict(reference_state(model, qtype))  # what the file holds, dequantized
    target = taps_jax.load_target(path)
    assert target.config.family == family and target.config.tie_embeddings == (family == "qwen2")
    if family == "llama":
        s = target.config.rope_scaling  # rope_freqs runs as stored; its Llama-3 equivalent is the config's own
        assert isinstance(s, taps_jax.RopeFactors) and s.llama3 == taps_jax.RopeScaling(8.0, 1.0, 4.0, 64)
    if family == "qwen3":
        assert target.config.head_dim == 32
    with torch.no_grad():
        want = model(torch.from_numpy(TOKENS)).logits.numpy()
    got = np.asarray(target.logits(TOKENS))
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
    prompt = TOKENS[0, :8]
    with torch.no_grad():
        ref = model.generate(torch.from_numpy(prompt[None]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                             pad_token_id=0)[0, 8:].tolist()
    assert target.generate([prompt.tolist()], 16, stop_at_eos=False).tokens[0] == ref


def test_convert_writes_a_hf_dir_with_the_same_logits(tmp_path):
    model = hf_model("llama")
    path = tmp_path / "m.gguf"
    write_gguf(model, "llama", path, "Q8_0")
    out = convert(path, tmp_path / "hf")
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    got = np.asarray(taps_jax.load_target(out).logits(TOKENS))
    np.testing.assert_allclose(got, np.asarray(taps_jax.load_target(path).logits(TOKENS)), atol=1e-5, rtol=0)
    # and transformers reads the converted dir as the same model (rope scaling included)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.from_numpy(TOKENS)).logits.numpy(), got, atol=1e-3, rtol=0)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty directory"):
        convert(path, tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


# --- bad files: one line naming the file and the reason, before any weight is read -----------------


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    write_gguf(hf_model("qwen2"), "qwen2", path, "Q8_0")
    return path


def _edited(tmp_path, good_file, edit, name="bad.gguf"):
    data = bytearray(good_file.read_bytes())
    data = edit(data)
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("case, edit, match", [
    ("truncated", lambda d: d[: len(d) // 2], "truncated"),
    ("magic", lambda d: b"GGUX" + d[4:], "wrong magic"),
    ("empty", lambda d: b"", "too short"),
    ("header cut", lambda d: d[:40], "truncated"),
    ("version", lambda d: d[:4] + struct.pack("<I", 7) + d[8:], "version 7"),
    ("kv count", lambda d: d[:16] + struct.pack("<Q", 1 << 40) + d[24:], "more than the file can hold"),
])
def test_bad_files_fail_with_one_line(tmp_path, good_file, case, edit, match):
    bad = _edited(tmp_path, good_file, edit)
    with pytest.raises(ValueError, match=match) as e:
        taps_jax.load_target(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_a_header_claiming_more_data_than_the_file_holds(tmp_path, good_file):
    _, infos = read_header(good_file)
    last = max(infos, key=lambda i: i.offset)
    # Cut the file inside the last tensor: the header is whole, its data is not.
    bad = _edited(tmp_path, good_file, lambda d: d[: last.offset + last.nbytes // 2])
    with pytest.raises(ValueError, match=f"tensor '{last.name}'.*runs past the end"):
        taps_jax.load_target(bad)


def test_unsupported_architecture_and_tensor_type(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="architecture 'gemma' is not supported"):
        taps_jax.load_target(tmp_path / "gemma.gguf")
    # A float64 matrix: a type the gguf package cannot dequantize.
    model = hf_model("qwen2")
    path = tmp_path / "f64.gguf"
    write_gguf(model, "qwen2", path, "F16")
    data = GGUFFile(path)
    name = "blk.0.ffn_up.weight"
    assert name in data.infos
    w = gguf.GGUFWriter(str(tmp_path / "f64b.gguf"), "qwen2")
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                "attention.head_count", "attention.head_count_kv"):
        w.add_uint32(f"qwen2.{key}", int(data.get(f"qwen2.{key}")))
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-5)
    for tname in data.infos:
        value = data.read(tname)
        w.add_tensor(tname, value.astype(np.float64) if tname == name else value.astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=f"tensor '{name}' has type F64, which the gguf package cannot dequantize"):
        taps_jax.load_target(tmp_path / "f64b.gguf")


def test_a_tokenizer_we_cannot_build(tmp_path):
    model = hf_model("qwen2")
    path = tmp_path / "m.gguf"
    write_gguf(model, "qwen2", path, "F16")
    data = GGUFFile(path)
    for kind, pre, match in (("llama", "default", "tokenizer model 'llama' is not supported"),
                             ("gpt2", "made-up-pre", "pre-tokenizer 'made-up-pre' is not supported")):
        out = tmp_path / f"tok-{kind}.gguf"
        w = gguf.GGUFWriter(str(out), "qwen2")
        for key, value in data.meta.items():
            if key.startswith("qwen2.") and isinstance(value, int):
                w.add_uint32(key, value)
        w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-5)
        w.add_tokenizer_model(kind)
        w.add_tokenizer_pre(pre)
        w.add_token_list([f"t{i}" for i in range(SIZES["vocab_size"])])
        w.add_token_merges(["t 0"])
        for tname in data.infos:
            w.add_tensor(tname, data.read(tname))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        with pytest.raises(ValueError, match=match):
            taps_jax.load_target(out)


def test_cli_reports_a_bad_file_in_one_line(tmp_path, good_file):
    bad = _edited(tmp_path, good_file, lambda d: d[: len(d) // 3])
    r = subprocess.run([sys.executable, "-m", "decode.cli", "--target", str(bad), "--policy", "ar", "--prompt", "x"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "truncated" in lines[0], r.stderr


def test_gguf_loads_sharded_onto_a_mesh(tmp_path):
    """As the safetensors loader: each parameter assembled from its devices' slices, the same values."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from taps_jax import sharding

    model = hf_model("llama")
    path = tmp_path / "m.gguf"
    write_gguf(model, "llama", path, "Q8_0")
    mesh = sharding.make_mesh(2, 2)
    plain, sharded = taps_jax.load_target(path), taps_jax.load_target(path, mesh=mesh)
    q = sharded.params["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.sharding == NamedSharding(mesh, P(None, "model"))
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompt = TOKENS[0, :8].tolist()
    assert sharded.generate([prompt], 8, stop_at_eos=False).tokens == plain.generate([prompt], 8, stop_at_eos=False).tokens
