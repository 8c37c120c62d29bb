"""No orphans: workers die with their launcher, the launcher dies with ``piper-sim run``.

- ``piper-sim run`` starts torchrun with a parent-death signal (Linux ``PR_SET_PDEATHSIG``:
  SIGTERM when ``piper-sim run`` dies, even by SIGKILL), forwards SIGTERM, SIGINT and
  SIGHUP to it and waits for it to stop its workers (`run_launcher`).
- Each worker watches its parent (torchrun's agent): when the agent is gone (SIGKILLed,
  crashed) the worker is re-parented and leaves at once (`die_with_parent`).

This module imports only the standard library.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int, parent: int) -> None:
    """In a child before exec: receive ``sig`` when the parent dies (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def exit_code(rc: int) -> int:
    """A child's return code as a shell exit status: 128 + N for a child killed by signal N."""
    return 128 - rc if rc < 0 else rc


def run_launcher(cmd: list[str], env: dict | None = None) -> int:
    """Run ``cmd`` (torchrun) to the end: it gets SIGTERM if this process dies, receives
    the termination signals this process receives, and is waited for. Returns its exit
    status (`exit_code`), or 128+N when this process was stopped by signal N."""
    parent = os.getpid()
    proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: _set_parent_death_signal(signal.SIGTERM, parent))
    got: list[int] = []

    def forward(signum, _frame):
        got.append(signum)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries wait() itself
                continue
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 + got[0] if got else exit_code(rc)


def die_with_parent(interval_s: float = 0.5) -> None:
    """In a torchrun worker: leave as soon as the agent that started it is gone."""
    parent = os.getppid()
    rank = os.environ.get("RANK", "?")

    def leave() -> None:
        print(f"piper-sim executor: rank {rank}: its launcher (pid {parent}) is gone; stopping",
              file=sys.stderr, flush=True)
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                leave()

    threading.Thread(target=watch, name="piper-parent-watchdog", daemon=True).start()
