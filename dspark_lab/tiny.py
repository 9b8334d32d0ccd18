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
                     init_scale: float = 1.0, **overrides) -> Path:
    """Write a random `family` model with a trained tokenizer to `out_dir`; returns the path.

    `init_scale` multiplies every weight matrix: a larger scale gives peakier logits, so greedy
    decoding settles into repeating patterns the way real models do on copy-heavy text."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import _get_classes

    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose from {', '.join(FAMILY_CONFIGS)}")
    out = Path(out_dir)
    tokenizer = build_tokenizer(out)
    config = dict(FAMILY_CONFIGS[family], num_hidden_layers=num_layers, vocab_size=len(tokenizer),
                  eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    config.update(overrides)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    if init_scale != 1.0:
        model.update(tree_map(lambda p: p * init_scale if p.ndim == 2 else p, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    return out
