"""GGUF import: tiny random models written as llama.cpp would write them, imported back.

For each architecture we build an mlx-lm model from random weights in Hugging Face naming, write
the same weights into a GGUF with llama.cpp's names and transforms (rotary permutation for llama,
`1 + w` norms for Gemma 3), import it, and compare logits with the original model. Offline.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import re

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from dspark_lab.engine.gguf_import import SUPPORTED_ARCHITECTURES, import_gguf
from dspark_lab.errors import LoadError

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROBES = ["Hello world 12345", "the quick brown fox, 2024!", "<|im_start|>user\nhi there<|im_end|>"]
TOKENS_IN = [3, 17, 42, 99, 5, 250, 8, 77, 120, 64, 1, 200]

# Each architecture's pre-tokenizer name and the `tokenizers` pre-tokenizer it stands for.
PRE = {
    "llama": ("smollm", [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]),
    "qwen2": ("qwen2", [
        pre_tokenizers.Split(
            Regex(
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            ),
            behavior="isolated",
        ),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]),
    "gemma3": ("gpt2", [pre_tokenizers.ByteLevel(add_prefix_space=False)]),
}


# ---------------------------------------------------------------------------------------------
# Building blocks


@pytest.fixture(scope="module")
def bpe():
    """A tiny byte-level BPE vocabulary: (tokens in id order, merges)."""
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, hello there, the world is wide",
        "numbers like 12345 and 2024 are split digit by digit",
    ] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges


def reference_tokenizer(tokens, merges, arch):
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(PRE[arch][1])
    tok.add_special_tokens(SPECIALS)
    return tok


def hf_config(arch, vocab_size, tied):
    config = {
        "model_type": {"gemma3": "gemma3_text"}.get(arch, arch),
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "max_position_embeddings": 256,
        "tie_word_embeddings": tied,
    }
    if arch == "gemma3":
        config.update(
            head_dim=32,
            query_pre_attn_scalar=32,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            sliding_window=4,  # shorter than the test input, so the window matters
            sliding_window_pattern=2,  # layer 0 sliding, layer 1 global
            rms_norm_eps=1e-6,
        )
    return config


def random_model(config, seed):
    """An mlx-lm model with every parameter random (norms and biases included)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {
        k: rng.normal(0, 0.2 if v.ndim == 1 else 0.08, v.shape).astype(np.float32)
        for k, v in tree_flatten(model.parameters())
    }
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    weights = model.sanitize(weights)  # Gemma 3 learns it is tied from the missing lm_head
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return model, weights


def to_gguf_name(name):
    """Hugging Face -> llama.cpp tensor name (the inverse of what the importer does)."""
    table = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }
    glob = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, _, kind = name.rpartition(".")
    if stem in glob:
        return f"{glob[stem]}.{kind}"
    layer, sub = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem).groups()
    return f"blk.{layer}.{table[sub]}.{kind}"


def llamacpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch, config, weights, tokens, merges, quantize=()):
    """Write `weights` (HF names) as llama.cpp would. Tensors whose GGUF name is in `quantize`
    are stored as Q8_0; returns the weights as the file holds them (after the lossy round trip)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "llama":
        w.add_rope_dimension_count(HIDDEN // HEADS)
    if arch == "gemma3":
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
        w.add_sliding_window(config["sliding_window"])
        w.add_sliding_window_pattern(config["sliding_window_pattern"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE[arch][0])
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    stored = {}
    for name, value in weights.items():
        gname = to_gguf_name(name)
        v = value
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            v = llamacpp_permute(v, HEADS if "q_proj" in name else KV_HEADS)
        if arch == "gemma3" and name.endswith("norm.weight"):
            v = v + 1.0
        if gname in quantize:
            q = gguf.quants.quantize(v, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            # The model the file describes is the dequantized one: undo the transforms on it.
            v = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                n = HEADS if "q_proj" in name else KV_HEADS
                v = v.reshape(n, v.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(v.shape)
            if arch == "gemma3" and name.endswith("norm.weight"):
                v = v - 1.0
        else:
            w.add_tensor(gname, v.astype(np.float32))
            v = value
        stored[name] = v
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def logits_of(model, tokens=TOKENS_IN):
    out = model(mx.array(tokens)[None]).astype(mx.float32)
    mx.eval(out)
    return np.array(out)


# Per-architecture cases: (tied embeddings, tensors stored as Q8_0).
CASES = {
    "llama": (True, ()),
    "qwen2": (False, ()),
    "gemma3": (True, ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight")),
}


@pytest.fixture(scope="module")
def imported(bpe, tmp_path_factory):
    """arch -> (reference model, GGUF path, imported dir); built once per module."""
    tokens, merges = bpe
    out = {}
    for seed, arch in enumerate(SUPPORTED_ARCHITECTURES):
        tied, quantize = CASES[arch]
        config = hf_config(arch, len(tokens), tied)
        model, weights = random_model(config, seed)
        path = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
        stored = write_gguf(path, arch, config, weights, tokens, merges, quantize)
        if quantize:  # the reference must hold what the file holds
            model.load_weights([(k, mx.array(v)) for k, v in stored.items()])
        dest = import_gguf(path, path.parent / "mlx", dtype="float32")
        out[arch] = (model, path, dest)
    return out


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_logits_match_reference(imported, arch):
    reference, _, dest = imported[arch]
    model, _ = load(str(dest))
    got, want = logits_of(model), logits_of(reference)
    # float32 end to end: only summation order differs.
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_config(imported, arch):
    _, _, dest = imported[arch]
    config = json.loads((dest / "config.json").read_text())
    tied, _ = CASES[arch]
    assert config["tie_word_embeddings"] is tied
    assert config["model_type"] == {"gemma3": "gemma3_text"}.get(arch, arch)
    assert config["num_key_value_heads"] == KV_HEADS
    assert config["eos_token_id"] == 2  # <|im_end|>, index 2 in the BPE fixture
    gen = json.loads((dest / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    if arch == "gemma3":
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
        assert config["head_dim"] == 32


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_tokenizer_round_trip(imported, bpe, arch):
    _, _, dest = imported[arch]
    reference = reference_tokenizer(*bpe, arch)
    _, tok = load(str(dest))
    for text in PROBES:
        ids = reference.encode(text).ids
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text
    assert tok.eos_token_id == 2
    assert tok.chat_template == CHAT_TEMPLATE
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_digits_split_one_by_one(imported):
    """The smollm pre-tokenizer: a digit never merges with its neighbours."""
    _, _, dest = imported["llama"]
    _, tok = load(str(dest))
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == list("12345")


@pytest.mark.parametrize("bits,min_cosine", [(8, 0.999), (4, 0.95)])
def test_quantized_import(imported, bits, min_cosine):
    _, path, float_dir = imported["qwen2"]
    dest = import_gguf(path, path.parent / f"q{bits}", q_bits=bits, dtype="float32")
    config = json.loads((dest / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
    model, _ = load(str(dest))
    assert "QuantizedLinear" in type(model.layers[0].self_attn.q_proj).__name__
    float_model, _ = load(str(float_dir))
    got, want = logits_of(model), logits_of(float_model)
    # Cosine similarity of all logits; measured ~0.99995 (8-bit) and ~0.99 (4-bit) here.
    cosine = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
    print(f"{bits}-bit cosine {cosine:.5f}")
    assert cosine > min_cosine


def test_default_dtype_is_float16(imported, tmp_path):
    _, path, _ = imported["llama"]
    dest = import_gguf(path, tmp_path / "f16")
    weights = mx.load(str(dest / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {mx.float16}
    assert "lm_head.weight" not in weights  # tied: the importer must not write it


# ---------------------------------------------------------------------------------------------
# Errors


def test_missing_file(tmp_path):
    with pytest.raises(LoadError, match=r"GGUF file not found: .*nope\.gguf"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a gguf")
    with pytest.raises(LoadError, match=r"is not a GGUF file"):
        import_gguf(bad, tmp_path / "out")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LoadError, match=r"Unsupported GGUF architecture 'mamba'.*llama, qwen2, gemma3"):
        import_gguf(path, tmp_path / "out")


@pytest.mark.parametrize("q_bits", [3, 16, "4"])
def test_bad_q_bits(tmp_path, q_bits):
    with pytest.raises(LoadError, match=r"q_bits must be None, 4 or 8"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "out", q_bits=q_bits)


def test_output_dir_not_empty(imported, tmp_path):
    _, path, _ = imported["llama"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(LoadError, match=r"already exists and is not empty"):
        import_gguf(path, out)
    assert (out / "keep.txt").read_text() == "mine"


def test_truncated_file(imported, tmp_path):
    _, path, _ = imported["llama"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(LoadError, match=r"could not be read as GGUF"):
        import_gguf(cut, tmp_path / "out")
