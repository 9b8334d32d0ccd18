"""One exception type for every problem a user can fix, and one warning type for advice.

The CLI prints these as a single clear message (no traceback); the Python API raises them so
callers can catch one type. Each message names the problem and, where there is one, the fix.
"""


class DsparkError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""


class LoadError(DsparkError):
    """A model or drafter could not be loaded as asked."""


class PlainIsFaster(LoadError):
    """The registry measured every speculative arm of this model slower than plain decoding on this
    machine: `generate --mode auto` decodes plainly."""


class InputError(DsparkError, ValueError):
    """A generation argument (prompt, length, sampling parameter) is out of range."""


class AdviceWarning(UserWarning):
    """Advice about a run that goes on: the CLI prints it as one `note:` line."""


class SlowDtypeWarning(AdviceWarning):
    """A model loaded in half precision where MLX computes it slowly (its CPU backend); the
    message says how to cast it."""


class MeasuredVersionWarning(AdviceWarning):
    """The registry's measurement of a pair was made with other weights of the drafter than the
    ones loaded (a head continued and stored again at the same path): its speedup may not hold."""
