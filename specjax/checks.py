"""The checks of user input that every part of the library shares, each with one message form that
names the argument, the value and what is allowed ("max_batch must be an integer >= 1, got 0").

`name` is how the message calls the argument: "max_new_tokens", "NGram k", "speculative_config:
'num_speculative_tokens'". Numpy integers count as integers (a prompt's length read from an array);
booleans do not (True is an int to Python, never a count to a user).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def is_int(value) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number (Python's or numpy's int or float), not a bool."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int, when it is an integer in [low, high] (either bound may be None); else a
    ValueError: "{name} must be an integer in {low}..{high}" (or ">= {low}", "<= {high}")."""
    if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        if low is not None and high is not None:
            allowed = f"an integer in {low}..{high}"
        elif low is not None:
            allowed = f"an integer >= {low}"
        elif high is not None:
            allowed = f"an integer <= {high}"
        else:
            allowed = "an integer"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def check_bool(name: str, value) -> bool:
    """`value` when it is True or False; else a ValueError naming it."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value, allowed: Iterable):
    """`value` when it is one of `allowed`; else a ValueError listing them."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
    return value
