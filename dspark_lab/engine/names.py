"""Names for models and drafters as reports and the registry show them.

Trials store a model as given (a local path or a hub repo id). Reports show its last path
part; the registry keys a target by a quant-agnostic id, because a drafter trained on a model's
hidden states serves every quantization of that model.
"""

from __future__ import annotations

import re

# Quantization / packaging suffixes that do not change which model it is. Stripped repeatedly
# from the end: "Qwen3-8B-MLX-4bit" -> "qwen3-8b", and `fetch-model`'s folders
# ("qwen2.5-coder-0.5b-q4-bfloat16": bits, then the scales' dtype) -> "qwen2.5-coder-0.5b".
_QUANT_SUFFIX = re.compile(
    r"[-_.](mlx|gguf|\d+-?bits?|q\d+(_k)?(_[0-9a-z]+)?|bf16|bfloat16|fp16|f16|float16|fp32|f32|float32|fp8|int[48]|dwq|awq|gptq|mxfp4)$",
    re.IGNORECASE,
)


def short_name(model_id: str | None) -> str:
    """The last path part of a model or drafter id ("-" for none)."""
    if not model_id:
        return "-"
    return str(model_id).rstrip("/\\").replace("\\", "/").split("/")[-1] or str(model_id)


def target_key(model_id: str) -> str:
    """Quant-agnostic, lower-case model name: "mlx-community/Qwen3-8B-4bit" -> "qwen3-8b"."""
    name = short_name(model_id).lower()
    while True:
        stripped = _QUANT_SUFFIX.sub("", name)
        if stripped == name or not stripped:
            return name
        name = stripped


def matches(model_id: str | None, wanted: str) -> bool:
    """Whether a stored id is the model the user named: the same id, or the same last path part
    (case-insensitive), so `--pair Qwen3-8B-4bit` finds "/models/Qwen3-8B-4bit"."""
    if model_id is None:
        return False
    return model_id == wanted or short_name(model_id).lower() == short_name(wanted).lower()
