"""The speculative engine: targets, taps, drafters, the verify loop and sampling.

The engine never imports the lab; the lab measures the engine."""

from .generate import GenResult, greedy_generate, lookup_generate, speculative_loop
from .loading import load_target
from .reference import mlx_lm_generate
from .sampling import SamplingParams
from .speculative import (
    PairConfig, dflash_generate, draft_model_generate, load_dflash_pair, load_draft_pair, load_pair, speculative_generate,
)
from .target import Target

__all__ = ["GenResult", "PairConfig", "SamplingParams", "Target", "dflash_generate", "draft_model_generate", "greedy_generate", "load_dflash_pair",
           "load_draft_pair", "load_pair", "load_target", "lookup_generate", "mlx_lm_generate", "speculative_generate", "speculative_loop"]
