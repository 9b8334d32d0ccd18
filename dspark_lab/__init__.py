"""dspark-lab: lossless speculative decoding on MLX, and a lab that measures when it pays."""

__version__ = "0.1.0"

from .engine import GenResult, SamplingParams, Target, greedy_generate, load_target, lookup_generate  # noqa: E402
from .errors import DsparkError, InputError, LoadError  # noqa: E402

__all__ = [
    "DsparkError", "GenResult", "InputError", "LoadError", "SamplingParams", "Target",
    "greedy_generate", "load_target", "lookup_generate",
]
