"""Strict 1:1 loading of DSpark heads, bound to their target.

Tensor names must match the declared architecture exactly: a mismatch lists the missing and
unexpected names (and wrong shapes), never a silent partial load. Drafters never import code:
an `auto_map` in a drafter config is ignored. Weights are quantized at load (4 bits by default).
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...errors import LoadError
from ..loading import read_json, resolve_model_path
from ..target import Target
from .dspark import DSparkDrafter, DSparkHead
from .dspark_config import parse_dspark_config, rename_tensor

DRAFTER_BITS = (4, 8, 16)
QUANT_GROUP = 64
# Tensors some packagings ship that inference never reads.
TRAINING_ONLY = {"t2d"}


def read_safetensors(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"no *.safetensors weights in drafter directory {str(path)!r}.")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def check_names(head: nn.Module, weights: dict[str, mx.array]) -> None:
    expected = {k: v.shape for k, v in tree_flatten(head.parameters())}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(f"{k} {tuple(weights[k].shape)} (expected {tuple(expected[k])})"
                   for k in set(expected) & set(weights) if tuple(weights[k].shape) != tuple(expected[k]))
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing: {', '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}")
        if unexpected:
            parts.append(f"unexpected: {', '.join(unexpected[:12])}{' ...' if len(unexpected) > 12 else ''}")
        if wrong:
            parts.append(f"wrong shape: {', '.join(wrong[:6])}")
        raise LoadError("the drafter's tensors do not match its declared architecture (" + "; ".join(parts) + ").")


def quantize_head(head: nn.Module, bits: int, keep_float: tuple[str, ...] = ()) -> None:
    """Quantize every Linear/Embedding whose input width the group size divides, except
    modules under the `keep_float` path prefixes."""
    if bits == 16:
        return

    def eligible(path: str, m: nn.Module) -> bool:
        if any(part in path for part in keep_float):
            return False
        return isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % QUANT_GROUP == 0 and m.weight.shape[0] > 1

    nn.quantize(head, group_size=QUANT_GROUP, bits=bits, class_predicate=eligible)


def read_head(ref: str | os.PathLike, bits: int, window: int) -> tuple[Path, dict, dict[str, mx.array]]:
    """Check the options, then the head's directory, config.json and tensors."""
    if bits not in DRAFTER_BITS:
        raise LoadError(f"drafter bits must be one of {', '.join(map(str, DRAFTER_BITS))} (16 keeps float weights), got {bits}.")
    if window < 1:
        raise LoadError(f"drafter window must be >= 1 position, got {window}.")
    path = resolve_model_path(ref, what="drafter")
    if not (path / "config.json").exists():
        raise LoadError(f"no config.json in drafter directory {str(path)!r}.")
    return path, read_json(path / "config.json"), read_safetensors(path)


def load_dflash(ref: str | os.PathLike, target: Target, *, bits: int = 4, window: int = 4096):
    """Load a DFlash or DFlash 2 head for `target` (strict names, 4-bit backbone by default;
    the convolutions and the selector stay in float, as they are small and precision-bound)."""
    from .dflash import DFlashDrafter, DFlashHead, parse_dflash_config

    _, cfg_json, raw = read_head(ref, bits, window)
    weights = {k[len("model."):] if k.startswith("model.") else k: v for k, v in raw.items()}
    config = parse_dflash_config(cfg_json, set(weights))
    target.check_taps(config.target_layer_ids)
    if config.backbone.vocab_size != target.vocab_size:
        raise LoadError(f"drafter vocabulary ({config.backbone.vocab_size}) differs from the target's ({target.vocab_size}): this head was trained for another model.")
    if config.backbone.hidden_size != target.hidden_size:
        raise LoadError(f"the DFlash head's hidden size ({config.backbone.hidden_size}) differs from the target's ({target.hidden_size}); it cannot use the target's embeddings and lm_head.")
    head = DFlashHead(config, target.hidden_size)
    check_names(head, weights)
    head.load_weights(list(weights.items()), strict=True)
    quantize_head(head, bits, keep_float=("_conv", "candidate_selector"))
    mx.eval(head.parameters())
    target.probe(config.target_layer_ids)
    return DFlashDrafter(head, target.embed, target.head_logits, window=window, name=str(ref))


def load_dspark(
    ref: str | os.PathLike,
    target: Target,
    *,
    bits: int = 4,
    window: int = 4096,
) -> DSparkDrafter:
    """Load a DSpark head (any recognized packaging) for `target`."""
    _, cfg_json, raw = read_head(ref, bits, window)
    weights = {rename_tensor(k): v for k, v in raw.items() if k not in TRAINING_ONLY}
    config = parse_dspark_config(cfg_json, set(raw))

    target.check_taps(config.target_layer_ids)
    if config.vocab_size != target.vocab_size:
        raise LoadError(f"drafter vocabulary ({config.vocab_size}) differs from the target's ({target.vocab_size}): this head was trained for another model.")
    if not config.has_lm_head and config.draft_vocab_size:
        raise LoadError("the drafter has a reduced draft vocabulary but no lm_head of its own; the target's lm_head cannot produce draft-vocab logits.")
    if not config.has_lm_head and config.hidden_size != target.hidden_size:
        raise LoadError(f"the drafter has no lm_head and its hidden size ({config.hidden_size}) differs from the target's ({target.hidden_size}); the target's lm_head cannot be bound.")

    head = DSparkHead(config, target.hidden_size)
    if "d2t" in weights:
        weights["d2t"] = weights["d2t"].astype(mx.int32)
    check_names(head, weights)
    head.load_weights(list(weights.items()), strict=True)
    quantize_head(head, bits)
    mx.eval(head.parameters())
    embed = head.embed_tokens if config.has_embed_tokens else target.embed
    lm_head = head.lm_head if config.has_lm_head else target.head_logits
    target.probe(config.target_layer_ids)
    return DSparkDrafter(head, embed, lm_head, window=window, name=str(ref))
