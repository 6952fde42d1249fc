"""The argparse type of the command-line tools' numbers: one rule for what a number option accepts (finite, on
the right side of its bound; 0 never stands for a default), one message naming what it needs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number_arg(
    kind: type = float, low: float = 0, strict: bool = True, words: tuple[str, ...] = ()
) -> Callable[[str], float | str]:
    """An argparse type: a `kind` (int or float) above `low` (`strict`) or at least `low`, finite, or one of
    `words` as given (e.g. 'auto'); argparse puts the option's name before the message."""
    what = "an integer" if kind is int else "a finite number"
    need = f"{what} {'>' if strict else '>='} {low:g}" + "".join(f" or {w!r}" for w in words)

    def parse(text: str) -> float | str:
        if text in words:
            return text
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not (value > low if strict else value >= low):
            raise argparse.ArgumentTypeError(f"must be {need}, got {text!r}")
        return value

    return parse
