"""Module-path patterns of annotations and the error of an annotation that does not hold
(shared by `piper_sim.annotate` and `piper_sim.user_tp`)."""

from __future__ import annotations

import re


class AnnotationError(ValueError):
    """A model whose annotation does not hold; one line naming the unit and the fix."""


def path_pattern(path: str) -> re.Pattern:
    """A module path with ``*`` for one path component, as a full-match pattern."""
    return re.compile("".join("[^.]+" if c == "*" else re.escape(c) for c in path) + r"\Z")
