"""Time a 4-bit quantized matmul against the same weights dequantized to bf16, per batch size.

Why: distill's data generation (mlx-lm's batched generator, 256 rows a step) and its training
forward (8 x 1,024 tokens) run the 4-bit target at large M, where on the H200 they reached only
3,500 generated tokens/s and 71 ms per 8 k-token forward for Qwen2.5-Coder-0.5B, far from the
GPU's compute. If the quantized kernel is what is slow at large M, a dense bf16 copy of the same
weights (w = scale * q + bias, exactly the numbers the quantized kernel multiplies by) would
make the target's side of distill faster, while decoding keeps the 4-bit kernels that win at M = 1.

    python benchmarks/qmm_vs_dense.py [--m 1,8,256,8192] [--shapes 896x4864,4864x896,896x151936]

Each shape is (in, out) of a Linear layer: the defaults are Qwen2.5-Coder-0.5B's MLP and vocab.
With --model DIR (a quantized mlx-lm model) it also times the whole forward, the model as loaded
against its dequantized copy (`load_target(dequantize=True)`, what distill trains on), over
--batches BxL token blocks (no cache: B x L is the training step's shape; 256x1 is the matmul
part of a 256-row generation step).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dspark_lab


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):  # warm-up: kernel compilation on first use
        mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times)[len(times) // 2]


def compare(m: int, d_in: int, d_out: int, *, bits: int, group: int, repeats: int) -> dict:
    key = mx.random.key(0)
    w = (mx.random.normal((d_out, d_in), key=key) * 0.02).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    dense = mx.dequantize(wq, scales, biases, group_size=group, bits=bits)  # the same numbers, bf16
    x = mx.random.normal((m, d_in), key=mx.random.key(1)).astype(mx.bfloat16)
    mx.eval(wq, scales, biases, dense, x)
    q_ms = median_ms(lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits), repeats)
    d_ms = median_ms(lambda: x @ dense.T, repeats)
    flop = 2 * m * d_in * d_out
    return {"m": m, "in": d_in, "out": d_out, "quantized_ms": round(q_ms, 4), "dense_ms": round(d_ms, 4),
            "dense_speedup": round(q_ms / d_ms, 2), "quantized_tflops": round(flop / q_ms / 1e9, 2),
            "dense_tflops": round(flop / d_ms / 1e9, 2)}


def model_forward(path: str, batches: list[tuple[int, int]], repeats: int) -> list[dict]:
    from dspark_lab.engine.loading import load_target

    quantized = load_target(path)[0].model
    dense = load_target(path, dequantize=True)[0].model  # the copy distill trains on
    rows = []
    for b, n in batches:
        ids = mx.random.randint(0, 1000, (b, n), key=mx.random.key(2))
        q_ms = median_ms(lambda: quantized(ids), repeats)
        d_ms = median_ms(lambda: dense(ids), repeats)
        rows.append({"batch": b, "length": n, "quantized_ms": round(q_ms, 3), "dense_ms": round(d_ms, 3),
                     "dense_speedup": round(q_ms / d_ms, 2)})
        print(f"forward {b}x{n}: quantized {q_ms:8.2f} ms, dequantized bf16 {d_ms:8.2f} ms, dense {q_ms / d_ms:.2f}x", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,8,256,8192", help="comma-separated batch sizes (rows of x)")
    ap.add_argument("--shapes", default="896x4864,4864x896,896x151936", help="comma-separated INxOUT")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--model", default=None, help="also time this quantized model's forward, as loaded and dequantized")
    ap.add_argument("--batches", default="8x1024,256x1", help="comma-separated BxL token blocks for --model")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    rows = []
    for shape in a.shapes.split(","):
        d_in, d_out = (int(v) for v in shape.split("x"))
        for m in (int(v) for v in a.m.split(",")):
            r = compare(m, d_in, d_out, bits=a.bits, group=a.group, repeats=a.repeats)
            rows.append(r)
            print(f"M {m:>5}  {d_in:>5} -> {d_out:<6}  {a.bits}-bit {r['quantized_ms']:9.3f} ms ({r['quantized_tflops']:7.2f} TFLOP/s)"
                  f"   bf16 {r['dense_ms']:9.3f} ms ({r['dense_tflops']:7.2f} TFLOP/s)   dense {r['dense_speedup']:.2f}x", flush=True)
    forward = []
    if a.model:
        forward = model_forward(a.model, [tuple(int(v) for v in s.split("x")) for s in a.batches.split(",")], a.repeats)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mlx": mx.__version__, "device": str(mx.default_device()), "bits": a.bits, "group": a.group,
                       "rows": rows, "model": a.model, "forward": forward}, f, indent=1)


if __name__ == "__main__":
    main()
