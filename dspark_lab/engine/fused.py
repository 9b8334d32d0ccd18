"""Sibling projections as one product: a layer's query, key and value projections, and its MLP's
gate and up projections, each computed by one matmul over their weights stacked.

Why: on a GPU a small model's decoding step is bound by how many operations it launches, not by
the bytes they read (an H100 launched a quantized product in about 7.5 us whatever its size below
the vocabulary, docs/performance.md, forty-first round). Qwen2's attention spends six operations
on q, k and v (three products, three bias adds); stacked, two. The 0.5B's 24 layers then launch
about 120 fewer a step, in plain decoding and in every verify alike.

How, without rewriting any model family: the model's own attention and MLP code still calls
`self.q_proj(x)`, `self.k_proj(x)`, `self.v_proj(x)`. After `fuse_projections`, the module holds
the stacked layer (`qkv_proj`, `gate_up_proj`: an ordinary Linear or QuantizedLinear, so routing
its rows and counting its bytes work as for any layer), and each sibling is a `FusedPart` that
holds no weights: the first sibling called on an input computes the stacked product once and
splits it (views, no copies); its siblings called on the same input take their part. A sibling
called on another input computes the product again, so no call order is assumed.

Exactness: each output column is the same dot product of the same weights, so on MLX's kernels,
which reduce each column on its own, the outputs are the unfused ones bit for bit (checked in
tests on the CPU, and on the GPU by `benchmarks/greedy_step.py --unfused` before it times anything).
Quantized siblings stack only when they share bits, group size and mode; anything else is left as
it is.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

# (stacked layer's name, siblings in order): the names mlx-lm's model files give them.
GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
_STACKABLE = (nn.Linear, nn.QuantizedLinear)


class _Stacked:
    """One stacked product shared by its siblings: computed once per input, handed out in parts.
    Not a Module (nor a dict): a Module's dict-valued attributes become its children, and this is
    not one."""

    def __init__(self, owner: nn.Module, name: str, sizes: list[int]):
        self.owner, self.name = owner, name
        self.splits = list(itertools.accumulate(sizes))[:-1]
        self.input: mx.array | None = None
        self.parts: list = []

    def part(self, x: mx.array, index: int) -> mx.array:
        if x is not self.input or self.parts[index] is None:
            # The stacked layer is looked up on its owner at each product, so routing it (a
            # class change in place) or replacing it is seen here.
            self.input, self.parts = x, mx.split(self.owner[self.name](x), self.splits, axis=-1)
        out, self.parts[index] = self.parts[index], None
        if all(p is None for p in self.parts):
            self.input, self.parts = None, []  # every sibling served: hold no arrays between calls
        return out


class FusedPart(nn.Module):
    """A projection whose weights live in a stacked layer: its call returns its columns of the
    stacked product of the same input."""

    def __init__(self, stacked: _Stacked, index: int, output_dims: int):
        super().__init__()
        self._stacked, self.index, self.output_dims = stacked, index, output_dims

    def __call__(self, x: mx.array) -> mx.array:
        return self._stacked.part(x, self.index)

    def _extra_repr(self) -> str:
        return f"part {self.index} of {self._stacked.name}, {self.output_dims} outputs"


def _signature(layer: nn.Module):
    """What two layers must share to stack along their outputs: class, input size, the arrays they
    hold and (quantized) how the weights are packed."""
    if type(layer) not in _STACKABLE:
        return None
    arrays = tuple(sorted(k for k, v in layer.items() if isinstance(v, mx.array)))
    inputs = layer.weight.shape[1:]
    packing = (layer.bits, layer.group_size, getattr(layer, "mode", "affine")) if isinstance(layer, nn.QuantizedLinear) else None
    return type(layer), arrays, inputs, layer.weight.dtype, packing


def _stack(layers: list[nn.Module]) -> nn.Module:
    """A layer of the same class whose outputs are the layers' outputs in order."""
    first = layers[0]
    stacked = type(first).__new__(type(first))
    stacked.__dict__.update(first.__dict__)  # bits, group_size, mode, frozen keys, training flag
    for key, value in first.items():
        if isinstance(value, mx.array):
            dict.__setitem__(stacked, key, mx.concatenate([layer[key] for layer in layers], axis=0))
    return stacked


def fuse_projections(model: nn.Module) -> int:
    """Stack every module's q/k/v and gate/up projections into one layer each (see the module
    docstring). Returns how many groups were stacked; a group whose layers differ in class,
    packing or input size, or that is already stacked, is left alone."""
    fused = 0
    for _, module in model.named_modules():
        for stacked_name, names in GROUPS:
            layers = [module.get(n) for n in names]
            if stacked_name in module or any(not isinstance(layer, nn.Module) for layer in layers):
                continue
            signatures = {_signature(layer) for layer in layers}
            if len(signatures) != 1 or None in signatures:
                continue
            sizes = [int(layer.weight.shape[0]) for layer in layers]
            module[stacked_name] = _stack(layers)
            # Made now, group by group: the siblings' own arrays are freed as each is, so stacking
            # a model needs one group's weights more memory at a time, not a copy of them all.
            mx.eval(module[stacked_name].parameters())
            shared = _Stacked(module, stacked_name, sizes)
            for index, (name, size) in enumerate(zip(names, sizes)):
                module[name] = FusedPart(shared, index, size)
            fused += 1
    return fused


def is_fused(model: nn.Module) -> bool:
    return any(isinstance(m, FusedPart) for _, m in model.named_modules())


def _unstack(stacked: nn.Module, sizes: list[int]) -> list[nn.Module]:
    """The layers `_stack` stacked, as rows of its arrays (slices along the first axis: views of
    the same memory once evaluated, no copy). Of the plain class, whatever routing put on it."""
    plain = next(c for c in type(stacked).__mro__ if c in _STACKABLE)
    layers, start = [], 0
    for size in sizes:
        layer = plain.__new__(plain)
        layer.__dict__.update(stacked.__dict__)
        for key, value in stacked.items():
            if isinstance(value, mx.array):
                dict.__setitem__(layer, key, value[start:start + size])
        layers.append(layer)
        start += size
    return layers


@contextmanager
def as_stored(model: nn.Module):
    """Within: the model's projections as separate layers again, as mlx-lm loads them (each its
    own product; their weights views of the stacked ones), so a reference that stands for mlx-lm
    (engine/reference.py) runs mlx-lm's model as its users run it. Stacked again on exit."""
    swaps = []
    for _, module in model.named_modules():
        for stacked_name, names in GROUPS:
            parts = [module.get(n) for n in names]
            if stacked_name not in module or not all(isinstance(p, FusedPart) for p in parts):
                continue
            stacked = module[stacked_name]
            swaps.append((module, stacked_name, names, stacked, parts))
            del module[stacked_name]
            for name, layer in zip(names, _unstack(stacked, [p.output_dims for p in parts])):
                module[name] = layer
    try:
        yield model
    finally:
        for module, stacked_name, names, stacked, parts in swaps:
            module[stacked_name] = stacked
            for name, part in zip(names, parts):
                module[name] = part
