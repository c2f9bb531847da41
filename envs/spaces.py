"""``AnyText``: a gymnasium space of arbitrary strings, for text observations and actions.

gymnasium's ``spaces.Text`` only contains strings over a fixed character set (alphanumerics by default), so a model
reply with a space, a brace or an emoji would not be "in" it and ``check_env`` would reject text envs. ``AnyText``
contains every ``str`` up to ``max_length`` characters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

# What sample() draws from: enough variety (markup, JSON punctuation, non-ASCII) to exercise a text env's parser.
_SAMPLE_ALPHABET = list("abcxyz XYZ019 \n\t{}[]\":,<>/_-.'\\é€中😀")


class AnyText(spaces.Space[str]):
    """Any Python string of at most ``max_length`` characters."""

    def __init__(self, max_length: int = 1_000_000, seed: int | np.random.Generator | None = None) -> None:
        if max_length <= 0:
            raise ValueError(f"AnyText max_length must be > 0, got {max_length!r}")
        self.max_length = max_length
        super().__init__(shape=None, dtype=None, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """A random short string (up to 64 characters) drawn from a mixed alphabet; masks are not supported."""
        if mask is not None or probability is not None:
            raise ValueError("AnyText.sample does not support mask or probability")
        length = int(self.np_random.integers(0, min(64, self.max_length) + 1))
        return "".join(self.np_random.choice(_SAMPLE_ALPHABET, size=length))

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"AnyText(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnyText) and other.max_length == self.max_length
