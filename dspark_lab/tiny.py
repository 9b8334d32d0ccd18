"""Tiny random models in Hugging Face layout, for the demo and the tests.

A byte-level BPE tokenizer is trained (with `tokenizers`) on a small built-in corpus and saved
with a ChatML chat template; a model of a real mlx-lm family (qwen3, qwen2, llama, ...) is built
with random weights and saved as config.json + model.safetensors. The result loads through the
same loaders as a real checkpoint, so whatever runs on it runs on real models too.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

_CORPUS = """
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop()

for i in range(10):
    print(i * i)

The quick brown fox jumps over the lazy dog. A speculative decoder drafts several tokens and the
model verifies them in one forward pass, so the output is identical to plain decoding, only faster.
What is 12 plus 30? The answer is 42. If x = 3 and y = 4, then x * x + y * y = 25.
Solve for x: 2x + 6 = 10, so x = 2. The sum of the first ten numbers is 55.
Hello, how are you today? I am fine, thank you. Please write a short poem about the sea.
The sea is wide and blue, the waves come in and out, and the wind sings over the water.
import numpy as np
x = np.arange(10)
print(x.sum(), x.mean())
"""

# Small but real shapes: 2 layers, GQA, enough heads to exercise every code path.
FAMILY_CONFIGS: dict[str, dict] = {
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=True, max_position_embeddings=4096),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, max_position_embeddings=4096),
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, max_position_embeddings=4096),
    # Targets whose caches do not simply trim (issue #8): gated-delta linear attention with a
    # conv window, Mamba-2, short convolutions, and sliding-window attention in rotating caches.
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
                       num_experts_per_tok=1, decoder_sparse_step=1, shared_expert_intermediate_size=128,
                       mlp_only_layers=[0, 1, 2, 3], moe_intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                       partial_rotary_factor=0.5, max_position_embeddings=4096, full_attention_interval=2,
                       tie_word_embeddings=False),
    "nemotron_h": dict(model_type="nemotron_h", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, attention_bias=False, mamba_num_heads=4, mamba_head_dim=16,
                       mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False,
                       layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, max_position_embeddings=4096,
                       hybrid_override_pattern=["M", "*", "M", "-"], tie_word_embeddings=False),
    "lfm2": dict(model_type="lfm2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=4096, norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64,
                 block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=128,
                 full_attn_idxs=[1], rope_theta=10000.0, tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                        rope_local_base_freq=10000.0, query_pre_attn_scalar=16, sliding_window=8,
                        sliding_window_pattern=2, max_position_embeddings=4096),
}
# The families whose every layer caches plainly (trim-only rollback).
PLAIN_FAMILIES = ("qwen3", "qwen2", "llama")

# Multimodal families built from mlx-vlm's model classes (tiny vision towers included, as the
# classes need them): a text_config for the language model plus a vision_config. `text`
# gets num_hidden_layers and vocab_size filled in by build_tiny_model.
_GEMMA4_ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"}}
VLM_FAMILY_CONFIGS: dict[str, dict] = {
    # Gemma 4: sliding window 8 (it wraps) and global layers with their own head_dim and KV heads,
    # the last half of the layers sharing KV with earlier ones, per-layer input embeddings,
    # final logit softcap, tied head.
    "gemma4": dict(
        model_type="gemma4", audio_config=None, tie_word_embeddings=True,
        text=dict(model_type="gemma4_text", hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                  global_head_dim=32, num_key_value_heads=2, num_global_key_value_heads=1, num_kv_shared_layers=2,
                  hidden_size_per_layer_input=16, sliding_window=8, sliding_window_pattern=2, final_logit_softcapping=30.0,
                  rms_norm_eps=1e-6, max_position_embeddings=4096, use_double_wide_mlp=False, rope_parameters=_GEMMA4_ROPE),
        vision_config=dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=16, global_head_dim=16, patch_size=4,
                           position_embedding_size=64, pooling_kernel_size=2),
    ),
    # Gemma 3 (vision): sliding window 8 every other layer, separate lm_head.
    "gemma3": dict(
        model_type="gemma3",
        text=dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, query_pre_attn_scalar=16, sliding_window=8,
                  sliding_window_pattern=2, mm_tokens_per_image=4, max_position_embeddings=4096),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, patch_size=4, image_size=16),
    ),
}


def build_tokenizer(out_dir: Path, vocab_size: int = 384):
    """Train a byte-level BPE on the built-in corpus and save it with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(out_dir: str | Path, family: str = "qwen3", *, num_layers: int = 2, seed: int = 0,
                     init_scale: float = 1.0, tokenizer_from: str | Path | None = None, tokenizer_vocab: int = 384,
                     quantize_bits: int | None = None, **overrides) -> Path:
    """Write a random `family` model with a trained tokenizer to `out_dir`; returns the path.

    `init_scale` multiplies every weight matrix: a larger scale gives peakier logits, so greedy
    decoding settles into repeating patterns the way real models do on copy-heavy text.
    `tokenizer_from` copies another tiny model's tokenizer instead of training one (a draft
    model must share its target's); `tokenizer_vocab` sizes a trained one. `quantize_bits`
    saves it quantized (group 32) the way mlx-lm saves a quantized model, config entry included."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    if family in VLM_FAMILY_CONFIGS:
        return _build_tiny_vlm(out_dir, family, num_layers=num_layers, seed=seed, init_scale=init_scale, **overrides)
    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose from {', '.join([*FAMILY_CONFIGS, *VLM_FAMILY_CONFIGS])}")
    out = Path(out_dir)
    if tokenizer_from is not None:
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_from))
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out))
    else:
        tokenizer = build_tokenizer(out, vocab_size=tokenizer_vocab)
    config = dict(FAMILY_CONFIGS[family], num_hidden_layers=num_layers, vocab_size=len(tokenizer),
                  eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    config.update(overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    if init_scale != 1.0:
        model.update(tree_map(lambda p: p * init_scale if p.ndim == 2 else p, model.parameters()))
    if quantize_bits is not None:
        import mlx.nn as nn

        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
        nn.quantize(model, group_size=32, bits=quantize_bits)
    weights = dict(tree_flatten(model.parameters()))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    return out


def _build_tiny_vlm(out_dir: str | Path, family: str, *, num_layers: int, seed: int, init_scale: float, **overrides) -> Path:
    """A multimodal `family` model (mlx-vlm's classes, needs mlx-vlm) in HF layout: config.json
    with text_config and vision_config, one model.safetensors with the vision tower too.
    `overrides` go into text_config."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    out = Path(out_dir)
    tokenizer = build_tokenizer(out)
    V = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    spec = dict(VLM_FAMILY_CONFIGS[family])
    text = dict(spec.pop("text"), num_hidden_layers=num_layers, vocab_size=V, **overrides)
    if family == "gemma4":
        text["vocab_size_per_layer_input"] = V
        # Spelled out (sliding, full, ...; the last full), so transformers and mlx-vlm read the same layout.
        text.setdefault("layer_types", ["sliding_attention", "full_attention"] * (num_layers // 2) + ["full_attention"] * (num_layers % 2))
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")  # image/audio placeholders: a special token plain text never holds
    config = dict(spec, text_config=text, vocab_size=V, hidden_size=text["hidden_size"], eos_token_id=eos,
                  image_token_id=mask_id, image_token_index=mask_id, audio_token_id=mask_id, boi_token_id=mask_id,
                  eoi_token_id=mask_id, boa_token_id=mask_id, eoa_token_id=mask_id)
    arch, _ = get_model_and_args(config)
    model_config = update_module_configs(arch.ModelConfig.from_dict(config), arch, config, ["text", "vision", "audio"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    if init_scale != 1.0:
        model.update(tree_map(lambda p: p * init_scale if p.ndim == 2 else p, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out


def text_config(config: dict) -> dict:
    """The language model's fields of a (possibly multimodal) config.json."""
    return {**config, **(config.get("text_config") or {})}


DSPARK_LAYOUTS = ("native", "speculators", "specforge", "dflash-causal", "lfm2")


def build_tiny_dspark(out_dir: str | Path, target_dir: str | Path, *, layout: str = "native", backbone: str = "qwen3",
                      num_layers: int = 1, block_size: int = 5, markov_rank: int = 16, confidence: bool = True,
                      draft_vocab: int | None = None, repeat_bias: float = 0.0, seed: int = 0) -> Path:
    """Write a random DSpark head for the tiny target at `target_dir`, in one of the published
    layouts, so the loader is tested on real files.

    `repeat_bias` > 0 makes the Markov head favour repeating the previous token (it needs
    markov_rank == vocab size): on a target that loops, such drafts really get accepted, so
    partial accepts at every position are exercised."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .engine.drafters.dspark import DSparkHead
    from .engine.drafters.dspark_config import DSparkConfig

    tcfg = text_config(json.loads((Path(target_dir) / "config.json").read_text()))
    H, V = tcfg["hidden_size"], tcfg["vocab_size"]
    taps = [0, tcfg["num_hidden_layers"] - 1] if tcfg["num_hidden_layers"] > 1 else [0]
    mask_id = V - 1
    gemma = backbone == "gemma4"
    own_outputs = layout in ("native", "speculators")
    cfg = DSparkConfig(
        hidden_size=H, vocab_size=V, num_hidden_layers=num_layers, intermediate_size=2 * H, num_attention_heads=4,
        block_size=block_size, mask_token_id=mask_id, target_layer_ids=taps, backbone=backbone, packaging=layout,
        num_key_value_heads=1 if gemma else 2, head_dim=32 if gemma else 16, rope_theta=10000.0,
        partial_rotary_factor=0.25 if gemma else 1.0, attention_k_eq_v=gemma, markov_rank=markov_rank,
        enable_confidence_head=confidence, final_logit_softcapping=30.0 if gemma else None,
        draft_vocab_size=draft_vocab, logits_start=0, causal=layout == "dflash-causal",
        sliding_window=8 if layout == "dflash-causal" else None, attention_sink=layout == "dflash-causal",
        has_embed_tokens=own_outputs, has_lm_head=own_outputs, rope_interleaved=layout == "lfm2",
    )
    mx.random.seed(seed)
    head = DSparkHead(cfg, H)
    weights = dict(tree_flatten(head.parameters()))
    if repeat_bias and markov_rank == V:
        weights["markov_head.markov_w1.weight"] = mx.eye(V) * repeat_bias
        weights["markov_head.markov_w2.weight"] = mx.eye(V)[: cfg.out_vocab]
    if draft_vocab:
        # Draft ids 0..draft_vocab-1 map to the target's first ids: offsets of 0.
        weights["d2t"] = mx.zeros((draft_vocab,), dtype=mx.int64)
        weights["t2d"] = mx.arange(V) < draft_vocab
    backbone_fields = dict(
        model_type="gemma4_text" if gemma else "qwen3", hidden_size=H, vocab_size=V, num_hidden_layers=num_layers,
        intermediate_size=2 * H, num_attention_heads=4, num_key_value_heads=cfg.kv_heads, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False,
    )
    if gemma:
        backbone_fields.update(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                               final_logit_softcapping=30.0,
                               rope_parameters={"full_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25}})
    dspark_fields = dict(block_size=block_size, mask_token_id=mask_id, target_layer_ids=taps, markov_rank=markov_rank,
                         enable_confidence_head=confidence, confidence_head_with_markov=True)
    if layout == "native":
        config = {**backbone_fields, **dspark_fields, "architectures": ["Gemma4DSparkModel" if gemma else "Qwen3DSparkModel"],
                  "auto_map": {"AutoModel": "modeling_dspark.DSpark"}}  # must be ignored, never obeyed
    elif layout == "speculators":
        config = {"speculators_model_type": "dspark", "transformer_layer_config": backbone_fields,
                  "speculators_config": {"algorithm": "dspark", "proposal_methods": [{"speculative_tokens": block_size}]},
                  "aux_hidden_state_layer_ids": taps, **{k: v for k, v in dspark_fields.items() if k != "target_layer_ids"},
                  "vocab_size": V}
        if draft_vocab:
            config["draft_vocab_size"] = draft_vocab
    elif layout == "specforge":
        config = {**backbone_fields, "architectures": ["DSparkDraftModel"], "block_size": block_size,
                  "dflash_config": {"projector_type": "dspark", **{k: v for k, v in dspark_fields.items() if k != "block_size"}}}
        weights = {("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v for k, v in weights.items()}
    elif layout == "dflash-causal":
        config = {**backbone_fields, **dspark_fields, "architectures": ["DFlashDraftModel"], "dflash_query_causal": True,
                  "sliding_window": 8, "attention_sink_bias": True, "has_lm_head": False}
    elif layout == "lfm2":
        config = {**backbone_fields, "model_type": "lfm2", "architectures": ["Lfm2DSparkDraftModel"], "block_size": block_size,
                  "rope_is_neox_style": False, "markov_rank": markov_rank, "enable_confidence_head": confidence,
                  "dflash_config": {"target_layer_ids": taps, "mask_token_id": mask_id, "num_target_layers": tcfg["num_hidden_layers"]}}
    else:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(DSPARK_LAYOUTS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_tiny_dflash(out_dir: str | Path, target_dir: str | Path, *, version: int = 1, num_layers: int = 2,
                      block_size: int = 5, sliding_window: int = 6, nested_block_size: bool = False, seed: int = 0) -> Path:
    """Write a random DFlash (version 1: one full and one sliding layer) or DFlash 2 (all sliding,
    bidirectional, with convolutions and the candidate selector) head for the tiny target."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .engine.drafters.dflash import DFlashHead, parse_dflash_config

    tcfg = text_config(json.loads((Path(target_dir) / "config.json").read_text()))
    H, V, n_t = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["num_hidden_layers"]
    dflash = {"mask_token_id": V - 1, "target_layer_ids": [0, n_t - 1] if n_t > 1 else [0]}
    config = {"architectures": ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"], "model_type": "qwen3",
              "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},  # never obeyed
              "hidden_size": H, "vocab_size": V, "num_hidden_layers": num_layers, "intermediate_size": 2 * H,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "num_target_layers": n_t, "sliding_window": sliding_window, "dflash_config": dflash}
    if version == 2:
        config["layer_types"] = ["sliding_attention"] * num_layers
        config["is_causal"] = False
        dflash.update(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=4, output_multiplier=0.5,
                      final_logit_softcapping=20.0)
    else:
        config["layer_types"] = (["full_attention", "sliding_attention"] * num_layers)[:num_layers]
    if nested_block_size:
        dflash["block_size"] = block_size
    else:
        config["block_size"] = block_size
    mx.random.seed(seed)
    head = DFlashHead(parse_dflash_config(config, set()), H)
    weights = dict(tree_flatten(head.parameters()))
    if version == 2:
        # Random but non-trivial convolutions and codebooks, so every DFlash 2 path matters.
        for k in list(weights):
            if k.endswith(("base_kernel", "predecessor_codebook", "successor_codebook")):
                weights[k] = mx.random.normal(weights[k].shape) * 0.5
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
