"""One exception type for every problem a user can fix, and one warning for advice.

The CLI prints these as a single clear message (no traceback); the Python API raises them so
callers can catch one type. Each message names the problem and, where there is one, the fix.
"""


class DsparkError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""


class LoadError(DsparkError):
    """A model or drafter could not be loaded as asked."""


class InputError(DsparkError, ValueError):
    """A generation argument (prompt, length, sampling parameter) is out of range."""


class SlowDtypeWarning(UserWarning):
    """A model loaded in half precision where MLX computes it slowly (its CPU backend); the
    message says how to cast it. The CLI prints it as one `note:` line."""
