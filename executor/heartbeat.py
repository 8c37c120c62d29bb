"""Heartbeats: name the rank that stopped, not the rank left waiting for it.

Every rank runs a thread that, once a second, publishes to the process group's key-value
store (c10d) what its issuing loop is doing: the step, the instruction on its stack (or
the last one issued), when it last made progress, and whether it is waiting on
communication (blocked in the runtime's wait or in a torch.distributed call) or not. It
reads the runtime's state and the main thread's stack; the runtime does not know about it.

When a rank gives up (no progress for ``--timeout``), `culprits` reads every rank's beat
and names the ranks that stopped on their own: a rank whose beats stopped (killed) or
that has made no progress for a while without waiting on anyone (hung in compute or
elsewhere). Clocks are compared across ranks: on several nodes, keep them in sync (NTP).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch.distributed as dist

KEY = "piper/heartbeat/{}"
# the Runtime methods a main-thread frame is read by (tests/test_lifetime.py checks they exist):
# blocked waiting for a completion, and the methods whose local ``ins`` is the instruction at hand
WAITING_IN = ("wait_any",)
INSTRUCTION_IN = ("issue", "_inject", "completed")
_current: "Heartbeat | None" = None


class Heartbeat:
    def __init__(self, rt, interval_s: float = 1.0):
        self.rt, self.interval_s = rt, interval_s
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.main = threading.main_thread().ident
        self.last, self.progress_t = None, time.time()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="piper-heartbeat", daemon=True)

    def _now_doing(self) -> tuple[str, bool]:
        """(instruction on the main thread's stack or the last issued, waiting on communication)."""
        frame = sys._current_frames().get(self.main)
        op, waiting = "", False
        while frame is not None:
            code = frame.f_code
            if code.co_name in WAITING_IN or "torch/distributed" in code.co_filename.replace("\\", "/"):
                waiting = True
            ins = frame.f_locals.get("ins") if code.co_name in INSTRUCTION_IN else None
            if ins is not None and not op:
                op = getattr(ins, "id", "")
            frame = frame.f_back
        if not op:
            times = getattr(self.rt, "times", {})
            op = next(reversed(times), "") if times else ""
        return op, waiting

    def beat(self) -> None:
        step, done = getattr(self.rt, "step_index", -1), len(getattr(self.rt, "done", ()))
        now = time.time()
        if (step, done) != self.last:
            self.last, self.progress_t = (step, done), now
        op, waiting = self._now_doing()
        self.store.set(KEY.format(self.rank), json.dumps(
            {"step": step, "op": op, "waiting": waiting, "progress_t": self.progress_t, "beat_t": now}))

    def _run(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the store is gone at teardown: stop beating
                return

    def culprits(self, stalled_s: float) -> list[tuple[int, str, str]]:
        """(rank, ``"hung"`` or ``"stopped"``, a clause saying where) of each rank that stopped
        on its own; [] when none is known."""
        now, found = time.time(), []
        beats = {}
        for r in range(self.world):
            try:  # check first: get() would wait for a rank that never beat
                if r != self.rank and self.store.check([KEY.format(r)]):
                    beats[r] = json.loads(self.store.get(KEY.format(r)))
            except Exception:  # noqa: BLE001 - the store is gone
                return []
        for r, b in sorted(beats.items()):
            where = f"step {b['step']}, {b['op'] or 'no instruction yet'}"
            if now - b["beat_t"] > 3 * self.interval_s + 1:
                found.append((r, "stopped", f"rank {r} stopped {now - b['beat_t']:.0f} s ago (no heartbeat; "
                                            f"killed?) at {where}"))
            elif not b["waiting"] and now - b["progress_t"] >= stalled_s:
                found.append((r, "hung", f"rank {r} is stuck at {where} for {now - b['progress_t']:.0f} s "
                                         "without waiting on communication (hung)"))
        return found


def start(rt) -> None:
    """Start this rank's heartbeat (once per process; later plans reuse it)."""
    global _current
    if _current is None:
        try:
            _current = Heartbeat(rt)
        except Exception:  # noqa: BLE001 - no c10d store: run without heartbeats
            return
        _current.beat()
        _current.thread.start()
    _current.rt = rt


def culprits(stalled_s: float) -> list[tuple[int, str, str]]:
    """The ranks that stopped on their own (`Heartbeat.culprits`); [] without heartbeats."""
    return _current.culprits(stalled_s) if _current is not None else []
