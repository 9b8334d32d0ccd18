"""Strict 1:1 loading of DSpark heads, bound to their target.

Tensor names must match the declared architecture exactly: a mismatch lists the missing and
unexpected names (and wrong shapes), never a silent partial load. Drafters never import code:
an `auto_map` in a drafter config is ignored. Weights are quantized at load (4 bits by default).
A head saved quantized (config.json's "quantization" entry, mlx-lm's convention, as
`quantize_head_dir` writes it) loads as stored; asked for other bits, its stored values are
dequantized and, below 16 bits, quantized again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...errors import LoadError
from ..loading import read_json, resolve_model_path
from ..target import Target
from .dspark import DSparkDrafter, DSparkHead
from .dspark_config import is_dflash_head, parse_dspark_config, rename_tensor

DRAFTER_BITS = (4, 8, 16)
QUANT_GROUP = 64
STORED_BITS = (2, 3, 4, 5, 6, 8)  # what MLX's affine quantization stores
STORED_GROUPS = (32, 64, 128)
# Tensors some packagings ship that inference never reads.
TRAINING_ONLY = {"t2d"}
# What a DFlash head keeps in float at any bits: DFlash 2's convolutions and candidate selector,
# small and precision-bound.
DFLASH_FLOAT = ("_conv", "candidate_selector")


def read_safetensors(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"no *.safetensors weights in drafter directory {str(path)!r}.")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def head_modes(ref: str | os.PathLike) -> tuple[str, ...]:
    """The decoding modes a head runs in: ("dflash",) for a plain DFlash / DFlash 2 head,
    ("dspark", "dspark-pipe") for a DSpark head (one of DFlash lineage with a Markov head
    included, as load_dspark takes it). A head that cannot be read here (a repo id not in the
    local cache) gets all three, and whoever loads it says which it skips. Reads config.json and
    the tensor names only (MLX loads tensors lazily)."""
    try:
        _, cfg, raw = read_head(ref)
    except (LoadError, OSError, ValueError):
        return ("dspark", "dspark-pipe", "dflash")
    return ("dflash",) if is_dflash_head(cfg, set(raw)) else ("dspark", "dspark-pipe")


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


def _quantizable(path: str, m: nn.Module, group_size: int, keep_float: tuple[str, ...]) -> bool:
    """A Linear/Embedding whose input width the group size divides, not under a `keep_float` prefix."""
    if any(part in path for part in keep_float):
        return False
    return isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % group_size == 0 and m.weight.shape[0] > 1


def quantize_head(head: nn.Module, bits: int, keep_float: tuple[str, ...] = (), group_size: int = QUANT_GROUP) -> None:
    """Quantize every Linear/Embedding whose input width the group size divides, except
    modules under the `keep_float` path prefixes."""
    if bits == 16:
        return
    nn.quantize(head, group_size=group_size, bits=bits,
                class_predicate=lambda path, m: _quantizable(path, m, group_size, keep_float))


def stored_quantization(cfg_json: dict, names: set[str]) -> tuple[int, int] | None:
    """(group_size, bits) of a head saved quantized, or None for float weights."""
    q = cfg_json.get("quantization")
    scaled = any(n.endswith(".scales") for n in names)
    if q is not None and not scaled:
        return None  # the tensors are float whatever the config says: quantized at load like any float head
    if q is None:
        if scaled:
            raise LoadError('the drafter\'s tensors are quantized (*.scales) but its config.json has no "quantization" entry '
                            'saying how; add one, e.g. "quantization": {"group_size": 64, "bits": 4}.')
        return None
    if not isinstance(q, dict) or q.get("bits") not in STORED_BITS or q.get("group_size") not in STORED_GROUPS:
        raise LoadError(f'the drafter\'s config.json has an unusable "quantization" entry {q!r}: expected '
                        f'{{"group_size": one of {STORED_GROUPS}, "bits": one of {STORED_BITS}}}.')
    return int(q["group_size"]), int(q["bits"])


def load_into(head: nn.Module, weights: dict[str, mx.array], stored: tuple[int, int] | None, bits: int,
              keep_float: tuple[str, ...] = ()) -> None:
    """Load `weights` into `head` strictly, in the layout they were stored in (quantized exactly
    where the checkpoint has scales), then bring the head to `bits`: float weights are quantized to
    them; a head stored quantized keeps its stored values at `bits` or more (more bits cannot give
    back what storing took: a 3-bit head loads as 3 bits at the default 4), is quantized again
    below them, and becomes float at 16."""
    if stored is not None:
        group, stored_bits = stored
        nn.quantize(head, group_size=group, bits=stored_bits, class_predicate=lambda path, m: f"{path}.scales" in weights)
    check_names(head, weights)
    head.load_weights(list(weights.items()), strict=True)
    if stored is None:
        quantize_head(head, bits, keep_float)
    elif bits == 16 or bits < stored[1]:
        from mlx_lm.utils import dequantize_model

        dequantize_model(head)  # the stored values, as float weights
        quantize_head(head, bits, keep_float)


def native_weights(raw: dict[str, mx.array]) -> dict[str, mx.array]:
    """A DSpark checkpoint's tensors under the native names, without training-only ones."""
    weights = {rename_tensor(k): v for k, v in raw.items() if k not in TRAINING_ONLY}
    if "d2t" in weights:
        weights["d2t"] = weights["d2t"].astype(mx.int32)
    return weights


def dflash_weights(raw: dict[str, mx.array]) -> dict[str, mx.array]:
    """A DFlash checkpoint's tensors under the head's names (z-lab's ship under `model.`)."""
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in raw.items()}


def read_head(ref: str | os.PathLike, bits: int = 16, window: int = 1) -> tuple[Path, dict, dict[str, mx.array]]:
    """Check the options (a loader's; the defaults pass), then the head's directory, config.json and tensors."""
    if bits not in DRAFTER_BITS:
        raise LoadError(f"drafter bits must be one of {', '.join(map(str, DRAFTER_BITS))} (16 keeps float weights), got {bits}.")
    if window < 1:
        raise LoadError(f"drafter window must be >= 1 position, got {window}.")
    path = resolve_model_path(ref, what="drafter")
    if not (path / "config.json").exists():
        raise LoadError(f"no config.json in drafter directory {str(path)!r}.")
    return path, read_json(path / "config.json"), read_safetensors(path)


def stack_head_projections(head: nn.Module) -> int:
    """Each head layer's q/k/v and gate/up projections as one product each (engine/fused.py, as
    the target's): a pipelined round is bound by the kernels it launches, and a 2-layer head's
    draft and context append launch about 8 products fewer a round. Each output column is the same
    dot product, so MLX's CPU kernels give the same drafts bit for bit (tests); a GPU library may
    split a wider product's sums differently, which can change a draft, never an output (the
    target verifies every draft). Returns how many groups were stacked."""
    from ..fused import fuse_projections

    return sum(fuse_projections(layer) for layer in head.layers)


def load_dflash(ref: str | os.PathLike, target: Target, *, bits: int = 4, window: int = 4096, stack_projections: bool = True):
    """Load a DFlash or DFlash 2 head for `target` (strict names, 4-bit backbone by default;
    the convolutions and the selector stay in float, as they are small and precision-bound).
    `stack_projections`: see stack_head_projections."""
    from .dflash import DFlashDrafter, DFlashHead, parse_dflash_config

    _, cfg_json, raw = read_head(ref, bits, window)
    weights = dflash_weights(raw)
    config = parse_dflash_config(cfg_json, set(weights))
    target.check_taps(config.target_layer_ids)
    if config.backbone.vocab_size != target.vocab_size:
        raise LoadError(f"drafter vocabulary ({config.backbone.vocab_size}) differs from the target's ({target.vocab_size}): this head was trained for another model.")
    if config.backbone.hidden_size != target.hidden_size:
        raise LoadError(f"the DFlash head's hidden size ({config.backbone.hidden_size}) differs from the target's ({target.hidden_size}); it cannot use the target's embeddings and lm_head.")
    head = DFlashHead(config, target.hidden_size)
    load_into(head, weights, stored_quantization(cfg_json, set(weights)), bits, keep_float=DFLASH_FLOAT)
    mx.eval(head.parameters())
    if stack_projections:
        stack_head_projections(head)
    target.probe(config.target_layer_ids)
    return DFlashDrafter(head, target.embed, target.head_logits, window=window, name=str(ref))


def load_dspark(
    ref: str | os.PathLike,
    target: Target,
    *,
    bits: int = 4,
    window: int = 4096,
    stack_projections: bool = True,
) -> DSparkDrafter:
    """Load a DSpark head (any recognized packaging) for `target`. `stack_projections` (default
    on): each layer's sibling projections as one product (stack_head_projections)."""
    _, cfg_json, raw = read_head(ref, bits, window)
    weights = native_weights(raw)
    config = parse_dspark_config(cfg_json, set(raw))

    target.check_taps(config.target_layer_ids)
    if config.vocab_size != target.vocab_size:
        raise LoadError(f"drafter vocabulary ({config.vocab_size}) differs from the target's ({target.vocab_size}): this head was trained for another model.")
    if not config.has_lm_head and config.draft_vocab_size:
        raise LoadError("the drafter has a reduced draft vocabulary but no lm_head of its own; the target's lm_head cannot produce draft-vocab logits.")
    if not config.has_lm_head and config.hidden_size != target.hidden_size:
        raise LoadError(f"the drafter has no lm_head and its hidden size ({config.hidden_size}) differs from the target's ({target.hidden_size}); the target's lm_head cannot be bound.")

    head = DSparkHead(config, target.hidden_size)
    load_into(head, weights, stored_quantization(cfg_json, set(weights)), bits)
    mx.eval(head.parameters())
    if stack_projections:
        stack_head_projections(head)
    embed = head.embed_tokens if config.has_embed_tokens else target.embed
    lm_head = head.lm_head if config.has_lm_head else target.head_logits
    target.probe(config.target_layer_ids)
    return DSparkDrafter(head, embed, lm_head, window=window, name=str(ref))


def _target_hidden(path: Path, weights: dict[str, mx.array], taps: list[int]) -> int:
    """The target's hidden size, read off the fusing projection (quantizing needs no target)."""
    fc = weights.get("fc.weight")
    if fc is None:
        raise LoadError(f"the head in {str(path)!r} has no fc.weight: not a DSpark or DFlash head this can quantize.")
    return fc.shape[1] // len(taps)


def float_head(path: Path, cfg_json: dict, raw: dict[str, mx.array]) -> tuple[str, nn.Module, dict[str, mx.array], tuple[str, ...]]:
    """The head's kind, its module (DSpark or DFlash) shaped for its float tensors, the tensors
    under the names its loader reads, and the modules its loader keeps in float: what quantizing
    it exactly as loading would needs."""
    if is_dflash_head(cfg_json, set(raw)):
        from .dflash import DFlashHead, parse_dflash_config

        weights = dflash_weights(raw)
        config = parse_dflash_config(cfg_json, set(weights))
        return "DFlash", DFlashHead(config, _target_hidden(path, weights, config.target_layer_ids)), weights, DFLASH_FLOAT
    weights = native_weights(raw)
    config = parse_dspark_config(cfg_json, set(raw))
    return "DSpark", DSparkHead(config, _target_hidden(path, weights, config.target_layer_ids)), weights, ()


def quantize_head_dir(src: str | os.PathLike, dst: str | os.PathLike, bits: int = 4,
                      group_size: int = QUANT_GROUP) -> tuple[int, int]:
    """Write the DSpark or DFlash head at `src` to `dst` with its weights quantized (`bits`, groups
    of `group_size`, where loading quantizes them), config.json saying so, and its model card
    (README.md) with a line saying how: a head small enough to commit, which `load_dspark` /
    `load_dflash` load as stored and `distill --init` continues from (DSpark). Nothing else of a
    distill folder (its data, log and checkpoint) is copied. Returns the weight bytes before and after."""
    if bits not in STORED_BITS or group_size not in STORED_GROUPS:
        raise LoadError(f"a head is stored at one of {', '.join(map(str, STORED_BITS))} bits in groups of one of "
                        f"{', '.join(map(str, STORED_GROUPS))} weights, got {bits} bits in groups of {group_size}.")
    path, cfg_json, raw = read_head(src)
    if stored_quantization(cfg_json, set(raw)) is not None:
        raise LoadError(f"the head in {str(path)!r} is stored quantized already; quantize its float original.")
    out = Path(dst)
    if out.resolve() == path.resolve():
        raise LoadError("write the quantized head to another directory: the float original is what later training continues best from.")
    kind, head, weights, keep_float = float_head(path, cfg_json, raw)
    load_into(head, weights, None, 16)
    left = [(name, m.weight.shape[-1]) for name, m in head.named_modules()
            if _quantizable(name, m, QUANT_GROUP, keep_float) and not _quantizable(name, m, group_size, keep_float)]
    if left:  # a layer the default group quantizes, left float by this one: bigger, not smaller
        name, width = left[0]
        raise LoadError(f"groups of {group_size} weights do not divide the input width of {name} ({width}), which would stay "
                        f"float ({len(left)} layer(s) in all); use a group size that divides the head's widths (32 or 64).")
    quantize_head(head, bits, keep_float, group_size)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(head.parameters())), metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps({**cfg_json, "quantization": {"group_size": group_size, "bits": bits}}, indent=2))
    before, after = sum(f.stat().st_size for f in path.glob("*.safetensors")), (out / "model.safetensors").stat().st_size
    card = (path / "README.md").read_text() if (path / "README.md").exists() else f"# {kind} head from {path}\n"
    (out / "README.md").write_text(card.rstrip("\n") + f"\n\nStored quantized by `dspark-lab quantize-head`: {bits} bits, group size "
                                   f"{group_size}, weights {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB.\n")
    return before, after
