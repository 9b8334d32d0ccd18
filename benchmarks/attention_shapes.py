"""Does attention with several queries pay a kernel compile for every new KV length?

    python benchmarks/attention_shapes.py

Times attention at query widths 1..8 over consecutive KV lengths, twice: a first pass (each
length new) and a second pass (each length seen before). A first pass far slower than the
second means a kernel is compiled per KV length, so a decode loop whose cache grows to a new
length every round pays a compile every round. Variants: mx.fast.scaled_dot_product_attention
("fast"), the same over keys padded to a 256 bucket with an array mask ("fast-bucketed"), and
plain matmul + softmax + matmul ("matmul").
"""

import time

import mlx.core as mx

HEADS, KV_HEADS, D = 32, 8, 128


def timed(fn):
    t = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - t) * 1000


def matmul_attention(q, k, v, scale, mask):
    B, H, W, d = q.shape
    rep = H // k.shape[1]
    qg = (q * scale).reshape(B, k.shape[1], rep * W, d)
    s = qg @ k.swapaxes(-1, -2)
    if mask is not None:
        s = mx.where(mx.tile(mask, (rep, 1)), s, -mx.inf)
    p = mx.softmax(s.astype(mx.float32), axis=-1).astype(q.dtype)
    return (p @ v).reshape(B, H, W, d)


def run(variant, width, L, dt):
    q = mx.random.normal((1, HEADS, width, D)).astype(dt)
    k = mx.random.normal((1, KV_HEADS, L, D)).astype(dt)
    v = mx.random.normal((1, KV_HEADS, L, D)).astype(dt)
    causal = mx.arange(L)[None] <= (L - width + mx.arange(width))[:, None]
    if variant == "fast-bucketed":
        P = (L + 255) // 256 * 256
        pad = mx.zeros((1, KV_HEADS, P - L, D), dt)
        k, v = mx.concatenate([k, pad], axis=2), mx.concatenate([v, pad], axis=2)
        mask = mx.concatenate([causal, mx.zeros((width, P - L), mx.bool_)], axis=1)
        mx.eval(q, k, v, mask)
        return timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask))
    mx.eval(q, k, v, causal)
    if variant == "matmul":
        return timed(lambda: matmul_attention(q, k, v, D**-0.5, causal))
    return timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal" if width > 1 else None))


def main() -> None:
    dt = mx.bfloat16
    for variant in ("fast", "fast-bucketed", "matmul"):
        for width in (1, 4, 8):
            passes = []
            for _ in range(2):
                passes.append([run(variant, width, L, dt) for L in range(300, 316)])
            first, second = passes
            print(f"{variant:13} width {width}: first pass median {sorted(first)[8]:7.2f} ms (max {max(first):7.2f}); "
                  f"second pass median {sorted(second)[8]:6.3f} ms")


if __name__ == "__main__":
    main()
