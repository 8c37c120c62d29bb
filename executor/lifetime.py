"""No orphans: workers die with their launcher, the launcher dies with ``piper-sim run``.

- ``piper-sim run`` starts torchrun with a parent-death signal (Linux ``PR_SET_PDEATHSIG``:
  SIGTERM when ``piper-sim run`` dies, even by SIGKILL), forwards SIGTERM, SIGINT and
  SIGHUP to it and waits for it to stop its workers (`run_launcher`).
- Each worker, first thing (`executor.__main__`, before torch loads), arms a parent-death
  signal and watches its parent (torchrun's agent): when the agent is gone (SIGKILLed,
  crashed) the worker is re-parented and leaves at once (`die_with_parent`). The agent
  ``python -m executor.launch`` exports its pid (:data:`AGENT_PID`), so a worker whose agent
  died while the worker was still starting leaves too, instead of taking the new parent for it.

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
# the environment variable naming the pid of the torchrun agent that starts the workers
AGENT_PID = "PIPER_AGENT_PID"
_watching = False


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def _agent() -> tuple[int, bool]:
    """(the agent's pid, whether it is gone already): the pid :data:`AGENT_PID` names, else
    the parent. A named agent that is not the parent but still runs is another run's (an
    inherited environment): then the parent is the agent."""
    named = os.environ.get(AGENT_PID, "")
    parent = os.getppid()
    if not named.isdigit() or int(named) == parent:
        return parent, False
    return (int(named), True) if not _alive(int(named)) else (parent, False)


def die_with_parent(interval_s: float = 0.5) -> None:
    """In a torchrun worker (call it before importing torch): leave as soon as the agent
    that started it is gone, or at once if it is gone already. The kernel sends SIGTERM
    when the parent dies (``PR_SET_PDEATHSIG``), and a thread checks the parent every
    ``interval_s`` and says so. Once per process."""
    global _watching
    if _watching:
        return
    _watching = True
    parent, gone = _agent()
    rank = os.environ.get("RANK", "?")

    def leave() -> None:
        print(f"piper-sim executor: rank {rank}: its launcher (pid {parent}) is gone; stopping",
              file=sys.stderr, flush=True)
        os._exit(1)

    if gone:
        leave()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                leave()

    threading.Thread(target=watch, name="piper-parent-watchdog", daemon=True).start()
    _set_parent_death_signal(signal.SIGTERM, parent)
