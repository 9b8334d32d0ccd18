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


def quantize_head(head: DSparkHead, bits: int) -> None:
    """Quantize every Linear/Embedding whose input width the group size divides."""
    if bits == 16:
        return

    def eligible(_path: str, m: nn.Module) -> bool:
        return isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % QUANT_GROUP == 0 and m.weight.shape[0] > 1

    nn.quantize(head, group_size=QUANT_GROUP, bits=bits, class_predicate=eligible)


def load_dspark(
    ref: str | os.PathLike,
    target: Target,
    *,
    bits: int = 4,
    window: int = 4096,
) -> DSparkDrafter:
    """Load a DSpark head (any recognized packaging) for `target`."""
    if bits not in DRAFTER_BITS:
        raise LoadError(f"drafter bits must be one of {', '.join(map(str, DRAFTER_BITS))} (16 keeps float weights), got {bits}.")
    if window < 1:
        raise LoadError(f"drafter window must be >= 1 position, got {window}.")
    path = resolve_model_path(ref, what="drafter")
    if not (path / "config.json").exists():
        raise LoadError(f"no config.json in drafter directory {str(path)!r}.")
    cfg_json = read_json(path / "config.json")
    raw = read_safetensors(path)
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
