"""mlx-lm's own decoder on the same model, timed and stopped the way ours are: the reference our
greedy decoding is held to (issue #10: our greedy at least 1.0x `mlx_lm.generate`).

It runs `mlx_lm.generate.stream_generate` on the target's own module (same weights, same
process, its own cache and prefill; each projection its own layer again, as mlx-lm loads the
model, where the engine stacks them: engine/fused.py), greedy, and returns a GenResult like greedy_generate's:
decode tok/s from the first token on, EOS and the length limit handled by the same TextStream.
"""

from __future__ import annotations

from typing import Sequence

from .fused import as_stored
from .generate import GenResult, _Clock, check_max_new_tokens
from .target import Target
from .text import TextStream, encode_prompt


def mlx_lm_generate(
    target: Target,
    tokenizer,
    prompt: str | Sequence[int] | list[dict],
    *,
    max_new_tokens: int = 256,
    apply_chat_template: bool = True,
) -> GenResult:
    """Greedy decoding by mlx-lm's stream_generate (its default sampler is argmax)."""
    from mlx_lm.generate import stream_generate

    check_max_new_tokens(max_new_tokens)
    prompt_ids = encode_prompt(tokenizer, prompt, apply_chat_template=apply_chat_template)
    stream = TextStream(tokenizer, None, None)
    clock = _Clock()
    steps = 0
    with as_stored(target.model):  # mlx-lm's layers as it loads them: no stacked projections
        for resp in stream_generate(target.model, tokenizer, prompt_ids, max_tokens=max_new_tokens):
            clock.first_token()
            steps += 1
            if stream.add([resp.token]):
                break
        else:
            stream.finish("length")
    rounds = max(steps - 1, 0)  # mlx-lm's forwards after its prefill, one token each
    return clock.result(stream, prompt_tokens=len(prompt_ids), rounds=rounds, forwards=steps,
                        accepts=[1] * rounds, drafts=[0] * rounds, mode="mlx-lm")
