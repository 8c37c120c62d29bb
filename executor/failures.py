"""Which rank caused a failed run: each failing worker leaves a record, the launcher reads them.

torchrun's own failure timestamps are whole seconds (its error files say no more), so on
their own they cannot order ranks that fail within one second. ``python -m executor.launch``
makes a folder and names it in :data:`FAILURE_DIR`; a worker that fails writes
``rank{R}.json`` there (`record`): when it failed (``time.time()``), its torchrun attempt,
and the ranks its heartbeat diagnosis names (hung, or stopped beating). The launcher names
(`cause`) a rank the diagnoses name, else the rank that failed first: the one that raised,
since its peers fail only once it is gone.

This module imports only the standard library.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

FAILURE_DIR = "PIPER_FAILURE_DIR"


def record(rank: int, culprits: list[tuple[int, str, str]], at: float | None = None) -> None:
    """Leave this rank's failure record in :data:`FAILURE_DIR` (nothing without one, and
    never an error: the failure itself is being reported)."""
    folder = os.environ.get(FAILURE_DIR)
    if not folder:
        return
    data = {"rank": rank, "time": time.time() if at is None else at,
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "culprits": [[r, how] for r, how, _ in culprits]}
    try:
        tmp = Path(folder) / f".rank{rank}.json.tmp"
        tmp.write_text(json.dumps(data))
        tmp.replace(Path(folder) / f"rank{rank}.json")
    except OSError:
        pass


def read(folder: str) -> list[dict]:
    """The records of the last torchrun attempt in ``folder`` (unreadable ones left out)."""
    out = []
    for f in Path(folder).glob("rank*.json"):
        try:
            d = json.loads(f.read_text())
            out.append({"rank": int(d["rank"]), "time": float(d["time"]), "attempt": int(d["attempt"]),
                        "culprits": [(int(r), str(how)) for r, how in d["culprits"]]})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    last = max((d["attempt"] for d in out), default=0)
    return [d for d in out if d["attempt"] == last]


def cause(records: list[dict]) -> tuple[int, str] | None:
    """(rank, ``"hung"``/``"stopped"``/``"raised"``): the rank most diagnoses name (the lowest
    on a tie), else the rank whose failure came first; None without records."""
    named = Counter(r for d in records for r, _ in d["culprits"])
    if named:
        rank = min(named, key=lambda r: (-named[r], r))
        how = next(h for d in records for r, h in d["culprits"] if r == rank)
        return rank, how
    if records:
        return min(records, key=lambda d: (d["time"], d["rank"]))["rank"], "raised"
    return None
