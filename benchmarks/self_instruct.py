"""Have the target write requests of its own (code or math), for distill data of more kinds than a template makes.

`synthetic_prompts.py --kind code` crosses 64 classic tasks with 9 languages: 3,000 of its
requests are 64 tasks asked many ways, while the held-out code set asks for an LRU cache, a
TypeScript debounce, a Postgres report. Here the target itself, sampling, writes one request per
(topic, language, kind of request) drawn from the lists below, whose topics stay away from the
held-out set's subjects; its greedy answers to them are then the data (`distill --prompts FILE`,
or GEN_PROMPTS in h200_corpus_heads.sh).

    python benchmarks/self_instruct.py --model MODEL --kind code --n 3000 --out self_code.jsonl.gz [--style detailed]

`--style detailed` (code) asks for requests of several parts: two to four concrete requirements
and one more thing beside the code (example calls, the design explained, tests), in two to five
sentences. The default requests are mostly one short sentence, and the 1.5B's head drafts on
held-out ones like them at 3.0 and more, while on the built-in code set, whose requests are
longer and ask for more than the code, it stays near 2.55 (docs/performance.md, thirtieth round).

Every request is cleaned (a leading "Sure, here is a request:" line and wrapping quotes dropped),
and kept only if the target finished it within --max-tokens (a request cut off mid-sentence is
not one a user sends), it is 30-1,500 characters, not a duplicate and not a built-in prompt. With
`--target-weights auto` (distill's rule) a quantized target writes through its dequantized copy,
much faster at these batch sizes (docs/performance.md, tenth round). Meant for the GPU machine;
on a Linux CPU, `--dtype float32` with benchmarks/cpu_blas.sh preloaded writes a few dozen
requests in minutes (the thirty-second round). Nothing here may download a model.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Topics of everyday programming work. Left out on purpose: the subjects of the held-out code
# set's prompts (caches, debounce, rate limiters, worker pools, React components, Dockerfiles, git,
# regular expressions, linked lists, serialization, pytest, shell one-liners, SQL reports, date
# parsing), so that no request is steered toward a prompt the evaluation holds out.
CODE_TOPICS = [
    "a REST API client with retries", "a command-line tool with subcommands", "reading and writing CSV files",
    "JSON validation", "async I/O", "pagination of API results", "a state machine", "an event emitter",
    "dependency injection", "a plugin system", "error handling and custom exceptions", "logging configuration",
    "configuration files", "a priority queue", "a graph search", "dynamic programming", "string tokenizing",
    "a tiny expression interpreter", "a bank account class", "an inventory system", "a to-do list app",
    "a binary search tree", "matrix operations", "image processing on pixel arrays", "a game loop",
    "file system traversal", "hashing and checksums", "iterators and generators", "decorators or middleware",
    "closures", "generics", "interfaces or traits", "memory management", "concurrency bugs", "database migrations",
    "a web form handler", "websockets", "a URL shortener", "text statistics", "unicode handling", "bit manipulation",
    "sorting records by several keys", "time series resampling", "a retry decorator", "refactoring a long function",
    "speeding up a slow loop", "a tic-tac-toe engine", "a markdown-to-HTML converter", "a simple HTTP server",
    "a chess move validator", "a library checkout system", "a spreadsheet formula evaluator",
]
CODE_LANGS = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "C", "C++", "Java", "SQL", "bash"]
CODE_KINDS = [
    "ask for a function with a precise signature", "ask for a small class or module", "ask to fix a bug in a short snippet you include",
    "ask to explain a concept with an example", "ask to convert a short snippet you include to another language",
    "ask for a script that does a concrete job", "ask to optimize a short snippet you include", "ask for code and its tests",
]
# Left out on purpose: the subjects of the two evaluated math prompts that no training template
# mirrors (math-003 a polygon's angles, math-008 choosing a committee; MIRRORED_PROMPTS in
# synthetic_prompts.py), so that "math without a training twin" stays a measure of generalizing.
# Probability stays out too, though math-007 (dice) has the coin-flip template as its twin and so
# counts as mirrored: a new topic would change what every seed writes.
MATH_TOPICS = [
    "percentages and discounts", "ratios and proportions", "speed, distance and time", "circles",
    "simple and compound interest", "unit conversion", "linear equations",
    "systems of two equations", "quadratic equations", "arithmetic and geometric sequences", "averages",
    "work rates", "mixtures", "ages", "money and change", "fractions",
    "area and perimeter", "volume", "median and mode", "exponents", "derivatives", "integrals", "logarithms",
]
MATH_LEVELS = ["primary school", "middle school", "high school", "first-year university"]


# What a detailed request asks for beside the code itself (--style detailed).
CODE_EXTRAS = ["a few example calls with their output", "a short explanation of the design choices",
               "tests for the edge cases", "a note on the time and memory it takes", "comments on the tricky parts"]
STYLES = ("brief", "detailed")


def meta_prompt(kind: str, r: random.Random, style: str = "brief") -> str:
    """The request the target is asked to write, for one drawn topic. The brief code request's
    wording and draws are those of every earlier round, so a seed writes what it wrote then."""
    if kind == "code" and style == "detailed":
        return (f"Write one realistic, detailed request that a developer might send to an AI coding assistant. "
                f"Topic: {r.choice(CODE_TOPICS)}. Language: {r.choice(CODE_LANGS)}. The request should {r.choice(CODE_KINDS)}. "
                f"Give it two to four concrete requirements (names, inputs, edge cases, constraints) and ask for "
                f"{r.choice(CODE_EXTRAS)} as well. Two to five sentences. Reply with the request only, no preamble.")
    if kind == "code":
        return (f"Write one realistic request that a developer might send to an AI coding assistant. "
                f"Topic: {r.choice(CODE_TOPICS)}. Language: {r.choice(CODE_LANGS)}. The request should {r.choice(CODE_KINDS)}. "
                "Be specific (names, inputs, constraints). Reply with the request only, no preamble.")
    return (f"Write one {r.choice(MATH_LEVELS)} math word problem about {r.choice(MATH_TOPICS)}, with concrete numbers, "
            "that has one correct answer. Reply with the problem only, no preamble and no solution.")


def clean(text: str) -> str:
    """The request itself: without a leading 'Here is a request:' line, wrapping quotes or a
    'Request:' label."""
    text = text.strip()
    lines = text.splitlines()
    if len(lines) > 1 and lines[0].rstrip().endswith(":") and len(lines[0]) < 80:
        text = "\n".join(lines[1:]).strip()
    for label in ("Request:", "**Request:**", "Problem:", "**Problem:**"):
        if text.startswith(label):
            text = text[len(label):].strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    return text


def self_instruct(target, tokenizer, kind: str, n: int, *, seed: int = 0, temperature: float = 1.0,
                  batch: int = 1024, max_tokens: int = 160, exclude: set[str] = frozenset(), keep_unfinished: bool = False,
                  style: str = "brief", say=print) -> list[dict]:
    """Up to n prompt records ({"id", "domain", "messages"}) the target wrote, none in exclude, and
    (unless keep_unfinished) none it was still writing when max_tokens ran out."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    from dspark_lab.engine.text import encode_prompt

    if style not in STYLES:
        raise SystemExit(f"--style must be one of {', '.join(STYLES)}, got {style!r}")
    r = random.Random(seed)
    mx.random.seed(seed)
    sampler = make_sampler(temp=temperature, top_p=0.95)
    out, seen, asked, written, start = [], set(exclude), 0, 0, time.perf_counter()
    for _ in range(3 * (n // batch + 1)):  # rejections are few; this bounds a model that writes nothing usable
        if len(out) >= n:
            break
        metas = [meta_prompt(kind, r, style) for _ in range(batch)]
        encoded = [encode_prompt(tokenizer, [{"role": "user", "content": m}]) for m in metas]
        result = batch_generate(target.model, tokenizer, encoded, max_tokens=max_tokens, sampler=sampler, return_token_ids=True,
                                completion_batch_size=len(encoded), prefill_batch_size=min(len(encoded), 64))
        asked += len(encoded)
        written += sum(len(ids) for ids in result.token_ids)
        for text, ids in zip(result.texts, result.token_ids):
            if len(ids) >= max_tokens and not keep_unfinished:
                continue
            text = clean(text)
            if not 30 <= len(text) <= 1500 or text in seen or "<|" in text:
                continue
            seen.add(text)
            out.append({"id": f"self{kind}{'-detailed' if style == 'detailed' else ''}-{len(out) + 1:05d}", "domain": kind,
                        "messages": [{"role": "user", "content": text}]})
            if len(out) >= n:
                break
        seconds = time.perf_counter() - start
        say(f"{len(out)} of {n} requests kept from {asked} written ({written} tokens in {seconds:.0f} s, "
            f"{written / max(seconds, 1e-9):.0f} tokens/s)")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kind", choices=["code", "math"], required=True)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--out", type=Path, required=True, help="a prompt JSONL (.jsonl or .jsonl.gz)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=1024,
                    help="requests written at once; every batch waits for its longest, so more at once is faster "
                         "(in the eleventh round, 256 at once: 4,864 requests in 196 s on the H200, the load included)")
    ap.add_argument("--style", choices=STYLES, default="brief",
                    help="code requests: brief (one specific ask) or detailed (several requirements and more than the code)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--keep-unfinished", action="store_true", help="keep requests still being written at --max-tokens")
    ap.add_argument("--target-weights", default="auto", choices=["auto", "dequantized", "as-loaded"])
    ap.add_argument("--dtype", help="write with a dequantized copy in this dtype instead (on a Linux CPU: float32, with "
                                    "benchmarks/cpu_blas.sh preloaded, the only fast one); overrides --target-weights")
    a = ap.parse_args(argv)
    from dspark_lab.engine.loading import load_target
    from dspark_lab.lab.distill import training_copy

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from synthetic_prompts import builtin_texts, write_prompt_file

    if a.dtype:
        target, tokenizer = load_target(a.model, dtype=a.dtype, dequantize=True)
        why = f"a dequantized {a.dtype} copy (--dtype)"
    else:
        target, tokenizer = load_target(a.model)
        target, _, why = training_copy(a.model, target, a.target_weights)
    print(f"writing with {why}")
    rows = self_instruct(target, tokenizer, a.kind, a.n, seed=a.seed, temperature=a.temperature, batch=a.batch,
                         max_tokens=a.max_tokens, exclude=builtin_texts(a.kind), keep_unfinished=a.keep_unfinished, style=a.style)
    write_prompt_file(a.out, rows)
    print(f"{len(rows)} requests -> {a.out}")
    return rows


if __name__ == "__main__":
    main()
