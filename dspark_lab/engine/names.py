"""Names for models and drafters as reports and the registry show them.

Trials store a model as given (a local path or a hub repo id), or, for a sweep's precision other
than as-loaded, with its label: MODEL@q8, MODEL@dequantized, MODEL@rows-kernel, MODEL@unfused. Reports show its last path part; the
registry keys a target by a quant-agnostic id, because a drafter trained on a model's hidden
states serves every quantization of that model, and keeps a precision's label on it, because
that precision's speedup was measured against its own baseline.
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


# A sweep's precisions (lab.sweep): the model as given, or its layers stored another way on load,
# or as stored with their products routed through engine/rows_kernel.py's kernel (ROWS_KERNEL),
# or as stored with each projection its own product (UNFUSED: load_target's default stacks a
# layer's q/k/v and gate/up projections into one product each, engine/fused.py).
AS_LOADED, DEQUANTIZED, ROWS_KERNEL, UNFUSED = "as-loaded", "dequantized", "rows-kernel", "unfused"
NAMED_PRECISIONS = (DEQUANTIZED, ROWS_KERNEL, UNFUSED)  # the labels that are words, not weight bits


def split_variant(model_id: str) -> tuple[str, str]:
    """(model, label) of a trial's model id, the label as-loaded, dequantized, rows-kernel, unfused or qN.
    An id whose text after its last @ is no such label is a model as given (a path may hold an @)."""
    path, _, label = model_id.rpartition("@")
    if path and (label in NAMED_PRECISIONS or (label[:1] == "q" and label[1:].isdigit())):
        return path, label
    return model_id, AS_LOADED


def plain_decoding_model(model_id: str) -> str:
    """The model whose plain decoding a `model_id` stands for: for MODEL@rows-kernel, MODEL; every
    other model, itself. Plain decoding never routes its products through the rows kernel (the CLI
    routes a target only for a speculative loop, and load_pair's registry reading does the same),
    and at one row a routed layer runs its own product, so a routed copy's plain decoding is its
    model's. The summary divides a routed arm's speed by MODEL's baseline from the same run
    (db.queries), and a sweep's routed copy takes the baseline step MODEL's took (lab.sweep): in one
    of the forty-third round's sweeps on an H100 (docs/performance.md) the routed copy's own probe
    chose the plain step where MODEL's chose the compiled one, its baseline ran 0.79-0.87x MODEL's,
    and the routed entries' speedups were inflated."""
    path, label = split_variant(model_id)
    return path if label == ROWS_KERNEL else model_id


def short_name(model_id: str | None) -> str:
    """The last path part of a model or drafter id ("-" for none)."""
    if not model_id:
        return "-"
    return str(model_id).rstrip("/\\").replace("\\", "/").split("/")[-1] or str(model_id)


def target_key(model_id: str) -> str:
    """Quant-agnostic, lower-case model name: "mlx-community/Qwen3-8B-4bit" -> "qwen3-8b"; a sweep's
    precision keeps its label: "/m/qwen2.5-coder-1.5b-q4-bfloat16@q8" -> "qwen2.5-coder-1.5b@q8"."""
    model, label = split_variant(str(model_id))
    name = short_name(model).lower()
    while True:
        stripped = _QUANT_SUFFIX.sub("", name)
        if stripped == name or not stripped:
            break
        name = stripped
    return name if label == AS_LOADED else f"{name}@{label}"


def matches(model_id: str | None, wanted: str) -> bool:
    """Whether a stored id is the model the user named: the same id, or the same last path part
    (case-insensitive), so `--pair Qwen3-8B-4bit` finds "/models/Qwen3-8B-4bit"."""
    if model_id is None:
        return False
    return model_id == wanted or short_name(model_id).lower() == short_name(wanted).lower()
