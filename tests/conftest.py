"""Shared fixtures: tiny random models of real mlx-lm families, saved in Hugging Face layout
with a trained BPE tokenizer and loaded through the real loaders, once per test session."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in the tests may reach the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from dspark_lab import greedy_generate, load_target  # noqa: E402
from dspark_lab.tiny import build_tiny_dspark, build_tiny_model  # noqa: E402

FAMILIES = ["qwen3", "qwen2", "llama"]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {fam: build_tiny_model(root / fam, fam, seed=i) for i, fam in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def tiny_bf16_dir(tiny_dirs, tmp_path_factory):
    """The tiny qwen3 model with its float weights stored as bfloat16, as most released models are."""
    import shutil

    import mlx.core as mx

    out = tmp_path_factory.mktemp("tiny-bf16") / "qwen3-bf16"
    shutil.copytree(tiny_dirs["qwen3"], out)
    for f in out.glob("*.safetensors"):
        weights = mx.load(str(f))
        mx.save_safetensors(str(f), {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
                                     for k, v in weights.items()})
    return out


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    return {fam: load_target(path) for fam, path in tiny_dirs.items()}


@pytest.fixture(scope="session")
def qwen3(tiny_models):
    return tiny_models["qwen3"]


# Prompts for lossless checks: plain text, code, chat, and repetitive ones where lookup
# really finds matches in the prompt.
PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "What is 12 plus 30?",
    "Hello, how are you today?",
    "Please write a short poem about the sea.",
    "import numpy as np",
    "class Stack:",
    "Solve for x: 2x + 6 = 10",
    "for i in range(10):\n    print(i * i)",
    "The sea is wide and blue",
    "x = np.arange(10)",
    "If x = 3 and y = 4",
    "A speculative decoder drafts several tokens",
    "self.items.append(item)",
    "the the the the the the the the",
    "a b c a b c a b c a b c a b c",
    "print(x)\nprint(x)\nprint(x)\nprint(x)\n",
    "def f(x): return x\ndef f(x): return x\ndef f(x): return x\n",
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3",
    "Hello hello hello hello hello hello",
    "return a, b = b, a + b; return a, b = b, a + b;",
    "The answer is 42. The answer is 42. The answer is",
]
REPETITIVE = PROMPTS[14:]


ALPHA = 1e-3  # false-alarm rate of each statistical test


def assert_same_token_distribution(plain: list[list[int]], spec: list[list[int]], positions) -> None:
    """Chi-square homogeneity at ALPHA, position by position: the tokens speculative sampling
    produced (`spec`) follow the distribution of plain sampling from the target (`plain`)."""
    import numpy as np
    from scipy import stats

    for pos in positions:
        cats = sorted({t[pos] for t in plain + spec})
        table = np.array([[sum(t[pos] == c for t in plain) for c in cats], [sum(t[pos] == c for t in spec) for c in cats]])
        table = table[:, table.sum(axis=0) > 0]
        if table.shape[1] > 1:
            assert stats.chi2_contingency(table).pvalue > ALPHA, (pos, table)


# --- DSpark heads for the qwen3 tiny target (test_dspark, test_pipeline) ----------------------

@pytest.fixture(scope="session")
def heads(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    t = tiny_dirs["qwen3"]
    vocab = json.loads((t / "config.json").read_text())["vocab_size"]
    return {
        "qwen3": build_tiny_dspark(root / "q", t, backbone="qwen3"),
        "gemma4": build_tiny_dspark(root / "g", t, backbone="gemma4"),
        # A head whose Markov term favours repeating the last token: on a looping target its
        # drafts are accepted at every depth, so partial accepts are exercised.
        "repeat": build_tiny_dspark(root / "r", t, markov_rank=vocab, repeat_bias=20.0),
    }


@pytest.fixture(scope="session")
def greedy_refs(qwen3):
    target, tok = qwen3
    return {p: greedy_generate(target, tok, p, max_new_tokens=24).token_ids for p in PROMPTS}
