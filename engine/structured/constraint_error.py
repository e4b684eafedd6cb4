"""ConstraintError: what is wrong with a constraint, found by compiling it (INVALID_ARGUMENT)."""

from __future__ import annotations


class ConstraintError(ValueError):
    """The constraint itself is wrong: its message names the field (INVALID_ARGUMENT)."""
