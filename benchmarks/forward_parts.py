"""Where a verify forward's per-row cost goes: its products, its attention, the rest, by width.

    python benchmarks/forward_parts.py --model DIR [--widths 1,2,4,8,16] [--prefill 200] [--repeats 30] [--json F]

The thirty-seventh round found a 4-bit Qwen 0.5B forward costing 3.1 ms at 2 rows and 4.5 at 8
on an H100; the thirty-eighth found MLX's 4-bit products no dearer at 8 rows than at 2 (its
tensor-core kernel takes over from 8), so the rows are paid elsewhere. After a prefill of
--prefill tokens, at each width this times, each evaluated alone (median of --repeats after
warm-up, milliseconds):
  forward       the compiled forward_at the pipelined loops run (array offset, a boolean mask
                over the whole bucketed buffer);
  products      every quantized layer's product at the width, once each, in one evaluation;
  attention     the layers' attention as the compiled forward calls it: scaled_dot_product_attention
                over the whole buffer with the boolean mask, once a layer;
  attention (sliced, causal)  the same over the buffer sliced to the filled length with the
                "causal" mask (what a plain forward with a host offset runs);
  rest          forward minus products minus attention: norms, rope, the cache writes, elementwise.
  norms, rope, cache writes, elementwise  the rest's parts, each alone, as many as the forward
                has: the layer's own norm module twice a layer and once more at the end; its rope
                module on the queries and keys at the array offset; ArrayOffsetKV's writes of the
                rows' keys and values into the whole buffers; a SwiGLU product and two residual adds
                a layer (plain MLX operations; a model without these modules skips that part).
  forward (additive mask), attention (additive mask)  the same two with the mask handed over as
                an additive one in the model's dtype (0 where visible, -inf elsewhere): MLX's
                CUDA attention turns a boolean mask into that itself on every call (its source),
                where the compiled forward could build it in one fused kernel. The two forwards'
                logits are compared (largest difference printed; a mask's form changes no sum).
  attention (matmuls)  the same attention as plain MLX operations (scores, mask, softmax,
                values: two matrix products a layer), as a compiled forward could write it if
                MLX's fused kernel for a few rows over a masked buffer is what costs; its largest
                difference from MLX's fused result is printed beside it.
  attention (rows kernel)  engine/attention_kernel.py's kernel: no mask, each row sees the
                positions up to its own (on a CPU its float32 reference stands in); its largest
                differences from MLX's fused result and from the float32 reference beside it.
Nothing is asserted: the table says which part grows with the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from dspark_lab.engine import load_target  # noqa: E402
from dspark_lab.engine import attention_kernel  # noqa: E402
from dspark_lab.engine.compiled import ArrayOffsetKV, OffsetForward  # noqa: E402
from dspark_lab.engine.kernels import cuda_available  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_round_parts import timed  # noqa: E402  (median seconds of a call evaluated alone, after warm-up)


def timed_ms(fn, repeats: int) -> float:
    return timed(fn, repeats) * 1e3


class AdditiveMaskKV(ArrayOffsetKV):
    """ArrayOffsetKV whose mask is additive, in the buffer's dtype."""

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        visible = super().make_mask(N, return_array, window_size)
        dtype = self.keys.dtype
        return mx.where(visible, mx.array(0, dtype), mx.array(-float("inf"), dtype))


def additive_mask_forward(target) -> OffsetForward:
    """A compiled forward_at whose traced caches hand attention an additive mask."""
    import dspark_lab.engine.compiled as compiled

    fwd = OffsetForward(target, compile=True)
    plain = fwd.run

    def run(*args, **kwargs):
        compiled.ArrayOffsetKV = AdditiveMaskKV  # traced once per shape, so only tracing needs it
        try:
            return plain(*args, **kwargs)
        finally:
            compiled.ArrayOffsetKV = ArrayOffsetKV
    fwd.run = run
    return fwd


def rest_parts(target, w: int, offset: mx.array, cache: list, key, dtype, repeats: int = 30) -> dict[str, float]:
    """The forward's work besides products and attention, each kind timed alone (milliseconds)."""
    cfg, layers = target.config, target.num_layers
    heads, head_dim = cfg["num_attention_heads"], target.head_dim
    kv_heads = cfg.get("num_key_value_heads", heads)
    first = target.layers[0]
    attn = getattr(first, "self_attn", None)
    norm, rope = getattr(first, "input_layernorm", None), getattr(attn, "rope", None)
    hidden = mx.random.normal((1, w, cfg["hidden_size"]), key=key).astype(dtype)
    out = {}
    if norm is not None:
        out["norms"] = timed_ms(lambda: [norm(hidden) for _ in range(2 * layers + 1)], repeats)
    if rope is not None:
        q = mx.random.normal((1, heads, w, head_dim), key=key).astype(dtype)
        k = mx.random.normal((1, kv_heads, w, head_dim), key=key).astype(dtype)
        out["rope"] = timed_ms(lambda: [r for _ in range(layers) for r in (rope(q, offset=offset), rope(k, offset=offset))], repeats)
        keys, values = cache[0].keys, cache[0].values
        out["cache writes"] = timed_ms(lambda: [a for _ in range(layers)
                                                for a in ArrayOffsetKV(keys, values, offset).update_and_fetch(k, k)], repeats)
    inter = cfg.get("intermediate_size")
    if inter:
        gate = mx.random.normal((1, w, inter), key=key).astype(dtype)
        out["elementwise"] = timed_ms(lambda: [r for _ in range(layers)
                                               for r in (nn.silu(gate) * gate, hidden + hidden, hidden + hidden)], repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--prefill", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtype", default=None, help="load the target in this precision (float32 on a CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    target, _ = load_target(args.model, dtype=args.dtype)
    cfg = target.config
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim, layers = target.head_dim, target.num_layers
    # Token ids within the vocabulary (a tiny test model has a few hundred): one past it reads
    # whatever memory lies beyond the embedding table, NaN at times.
    ids = mx.array([(i * 7919 + 100) % target.vocab_size for i in range(args.prefill)], dtype=mx.uint32)
    cache = target.make_cache()
    target.forward(ids, cache, last_only=True)
    bound = args.prefill + 64
    for c in cache:
        c.ensure(bound)
    offset = mx.array(args.prefill, dtype=mx.int32)
    buffer = cache[0].keys.shape[2]
    dtype = cache[0].keys.dtype
    # Every product of the forward; a tied embedding's only as the vocabulary projection.
    products = [m for _, m in target.model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    if "lm_head" not in target.model:
        products.append(target._embed)
    print(f"{args.model}: {layers} layers, {heads} heads / {kv_heads} kv, head dim {head_dim}, "
          f"buffer {buffer} positions ({args.prefill} filled), {len(products)} products", flush=True)
    report = {"model": args.model, "prefill": args.prefill, "buffer": buffer, "widths": {}}
    key = mx.random.key(0)
    additive = additive_mask_forward(target)
    rows_attention = attention_kernel.rows_attention() if cuda_available() else attention_kernel.reference_rows_attention
    for w in (int(x) for x in args.widths.split(",") if x.strip()):
        feed = ids[:w]

        def forward():
            return target.forward_at(feed, cache, offset, capacity=bound).logits

        quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)
        xs = {id(m): mx.random.normal((1, w, m.weight.shape[1] * (32 // m.bits if isinstance(m, quantized) else 1)),
                                      key=key).astype(dtype) for m in products}

        def all_products():
            return [m.as_linear(xs[id(m)]) if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)) else m(xs[id(m)])
                    for m in products]

        q = mx.random.normal((1, heads, w, head_dim), key=key).astype(dtype)
        keys, values = cache[0].keys, cache[0].values
        mask = (mx.arange(buffer)[None] <= offset + mx.arange(w)[:, None])
        filled = args.prefill + w

        def attention_masked():
            return [mx.fast.scaled_dot_product_attention(q, keys, values, scale=head_dim ** -0.5, mask=mask) for _ in range(layers)]

        add_mask = mx.where(mask, mx.array(0, dtype), mx.array(-float("inf"), dtype))

        def attention_additive():
            return [mx.fast.scaled_dot_product_attention(q, keys, values, scale=head_dim ** -0.5, mask=add_mask) for _ in range(layers)]

        groups = heads // kv_heads

        def attention_matmuls():
            out = []
            for _ in range(layers):
                qg = (q * head_dim ** -0.5).reshape(1, kv_heads, groups, w, head_dim)
                scores = qg @ keys[:, :, None].swapaxes(-1, -2)
                scores = mx.where(mask, scores, mx.array(-float("inf"), scores.dtype))
                weights = mx.softmax(scores, axis=-1, precise=True)
                out.append((weights @ values[:, :, None]).reshape(1, heads, w, head_dim))
            return out

        def attention_kernel_rows():
            return [rows_attention(q, keys, values, offset, head_dim ** -0.5) for _ in range(layers)]

        def forward_additive():
            for c in cache:
                c.ensure(bound)
            return additive.run(feed, cache, offset)[0]

        def attention_sliced():
            k, v = keys[:, :, :filled], values[:, :, :filled]
            return [mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim ** -0.5, mask="causal") for _ in range(layers)]

        parts = {"forward": timed_ms(forward, args.repeats), "products": timed_ms(all_products, args.repeats),
                 "attention": timed_ms(attention_masked, args.repeats),
                 "attention (sliced, causal)": timed_ms(attention_sliced, args.repeats)}
        parts["rest"] = parts["forward"] - parts["products"] - parts["attention"]
        parts.update(rest_parts(target, w, offset, cache, key, dtype, args.repeats))
        parts["forward (additive mask)"] = timed_ms(forward_additive, args.repeats)
        parts["attention (additive mask)"] = timed_ms(attention_additive, args.repeats)
        parts["attention (matmuls)"] = timed_ms(attention_matmuls, args.repeats)
        fused, plain = attention_masked()[0], attention_matmuls()[0]
        parts["largest difference (matmuls)"] = mx.abs(fused.astype(mx.float32) - plain.astype(mx.float32)).max().item()
        why_not = attention_kernel.supports(q, keys, values)
        if why_not is None:
            parts["attention (rows kernel)"] = timed_ms(attention_kernel_rows, args.repeats)
            ours = attention_kernel_rows()[0].astype(mx.float32)
            ref = attention_kernel.reference_rows_attention(q, keys, values, offset, head_dim ** -0.5).astype(mx.float32)
            parts["largest difference (rows kernel)"] = mx.abs(ours - fused.astype(mx.float32)).max().item()
            parts["largest difference (rows kernel, float32 reference)"] = mx.abs(ours - ref).max().item()
        else:
            print(f"width {w}: no rows kernel ({why_not})", flush=True)
        a, b = forward(), forward_additive()
        parts["largest logit difference (additive mask)"] = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
        report["widths"][w] = parts
        print(f"width {w:2d}: " + ", ".join(f"{k} {v:.3f}" + ("" if k.startswith("largest") else " ms") for k, v in parts.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
