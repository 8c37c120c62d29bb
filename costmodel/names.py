"""One-line messages for a name that is not one of the known ones, with a "did you mean"
(`difflib`): every config reader (model files, HF configs, strategies, stacks, clusters)
words its unknown keys this way. Standard library only."""

from __future__ import annotations

import difflib
from typing import Any, Iterable


def did_you_mean(name: Any, known: Iterable[str]) -> str:
    """The known name closest to ``name`` (a typo such as ``hiden`` -> ``hidden``), or ''."""
    if not isinstance(name, str):
        return ""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6) \
        or difflib.get_close_matches(name.lower().replace("-", "_"), known, n=1, cutoff=0.6)
    return close[0] if close else ""


def unknown_name(what: str, name: Any, known: Iterable[str], label: str = "known") -> str:
    """``unknown key 'hiden'; did you mean 'hidden'? (known: ...)``: one line."""
    known = list(dict.fromkeys(known))
    guess = did_you_mean(name, known)
    hint = f"; did you mean {guess!r}?" if guess else ""
    return f"unknown {what} {name!r}{hint} ({label}: {', '.join(known)})"


def unknown_names(what: str, names: Iterable[Any], known: Iterable[str], label: str = "allowed") -> str:
    """One or more unknown names (sorted), with the guesses found:
    ``unknown field(s) bucket, zer0; did you mean 'bucket_mb' for 'bucket', 'zero' for 'zer0'? (allowed: ...)``
    (a single name reads as `unknown_name`'s message, without the quotes)."""
    names, known = sorted(names, key=str), list(dict.fromkeys(known))
    guesses = [(n, g) for n in names if (g := did_you_mean(n, known))]
    if len(names) == 1 and guesses:
        hint = f"; did you mean {guesses[0][1]!r}?"
    elif guesses:
        hint = "; did you mean " + ", ".join(f"{g!r} for {n!r}" for n, g in guesses) + "?"
    else:
        hint = ""
    return f"unknown {what}(s) {', '.join(map(str, names))}{hint} ({label}: {', '.join(known)})"
