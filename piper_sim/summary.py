"""Short text and HTML summaries of a plan or a result for notebooks (light: the plan module
imports it). ``repr`` is one line; ``_repr_html_`` a small two-column table."""

from __future__ import annotations

from html import escape
from typing import Iterable

from costmodel.memory import GiB


def one_line(name: str, facts: Iterable[tuple[str, str]]) -> str:
    """``Name(key value, key value, ...)`` from (key, value) facts; empty values left out."""
    return f"{name}(" + ", ".join(f"{k} {v}".strip() for k, v in facts if v != "") + ")"


def html_table(title: str, facts: Iterable[tuple[str, str]]) -> str:
    """A small HTML table (title, then one row per fact) that Jupyter shows for `_repr_html_`."""
    rows = "".join(f"<tr><th style='text-align:left'>{escape(k)}</th><td style='text-align:left'>{escape(v)}</td></tr>"
                   for k, v in facts if v != "")
    return f"<table><caption style='text-align:left'><b>{escape(title)}</b></caption>{rows}</table>"


def degrees(pp: int, dp: int, ep: int = 1, tp: int = 1, cp: int = 1, dp_shard: int = 0) -> str:
    """``pp2 dp8 ep4 tp2``: the parallel degrees above 1 (pp always)."""
    out = f"pp{pp}"
    for name, d in (("dp", dp), ("ep", ep), ("cp", cp), ("tp", tp)):
        if d > 1:
            out += f" {name}{d}"
    return out + (f" (shard {dp_shard})" if dp_shard else "")


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:,.1f} GiB"
