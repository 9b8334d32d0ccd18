"""dspark-lab: lossless speculative decoding on MLX, and a lab that measures when it pays."""

__version__ = "0.1.0"

from .engine import (  # noqa: E402
    GenResult, PairConfig, SamplingParams, Target, dflash_generate, draft_model_generate, greedy_generate, load_dflash_pair,
    load_draft_pair, load_pair, load_target, lookup_generate, speculative_generate,
)
from .errors import AdviceWarning, DsparkError, InputError, LoadError, MeasuredVersionWarning, SlowDtypeWarning  # noqa: E402

__all__ = [
    "AdviceWarning", "DsparkError", "GenResult", "InputError", "LoadError", "MeasuredVersionWarning", "SamplingParams", "SlowDtypeWarning",
    "Target",
    "PairConfig", "dflash_generate", "draft_model_generate", "greedy_generate", "load_dflash_pair", "load_draft_pair", "load_pair",
    "load_target", "lookup_generate", "speculative_generate",
]
