"""``python -m executor.launch [torchrun options] -m executor PLAN.json ...``: torchrun, quiet.

What ``piper-sim run`` starts. The same as ``python -m torch.distributed.run`` with the same
options, except that unless ``PIPER_VERBOSE=1`` (``piper-sim run -v``) torchrun's own
warnings and its failure report (a ~45-line ``ChildFailedError`` traceback) are left out:
each failing rank has printed its one line already, and this adds one line naming the
rank that caused the failure (`first_failure`: killed, hung or the first to raise, from the
records the workers leave, `executor.failures`). Exit status (documented for ``piper-sim run``):

- 0: every rank finished;
- 1: a rank failed (its message and this summary line are on stderr);
- 128+N: stopped by signal N (SIGTERM, SIGINT, SIGHUP), after stopping the workers.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile

from executor.failures import FAILURE_DIR, cause, read
from executor.lifetime import AGENT_PID

RANK_FAILED = 1
# signals torchrun itself sends to stop the other workers, not a cause of failure
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def first_failure(failures: dict, records: list[dict] | None = None) -> tuple[int, str]:
    """(rank, what it did) to name: a rank killed by a signal torchrun does not send (SIGKILL
    from the OOM killer, SIGSEGV, SIGABRT...), since its peers fail only because it vanished;
    else the rank the workers' failure records blame (`executor.failures.cause`: a rank the
    heartbeat diagnoses name, else the first to fail, to the microsecond); else the earliest
    of torchrun's failures (whole-second timestamps; ties: the lowest rank)."""
    killed = [r for r, f in failures.items() if f.exitcode < 0 and -f.exitcode not in STOP_SIGNALS]
    if killed:
        return min(killed), f"was killed by {signal.Signals(-failures[min(killed)].exitcode).name}"
    blamed = cause(records or [])
    if blamed is not None and blamed[1] != "raised":
        how = "hung" if blamed[1] == "hung" else "stopped (no heartbeat)"
        return blamed[0], f"{how} (the diagnosis above names it)"
    rank = blamed[0] if blamed is not None and blamed[0] in failures else \
        min(failures, key=lambda r: (failures[r].timestamp, r))
    code = failures[rank].exitcode
    return rank, f"failed first ({f'stopped by {signal.Signals(-code).name}' if code < 0 else f'exit code {code}'}; " \
                 "its message is above)"


def main(argv: list[str] | None = None) -> int:
    verbose = os.environ.get("PIPER_VERBOSE") == "1"
    os.environ[AGENT_PID] = str(os.getpid())  # a worker whose agent dies while it starts leaves
    with tempfile.TemporaryDirectory(prefix="piper-failures-") as folder:
        os.environ[FAILURE_DIR] = folder
        return _torchrun(argv if argv is not None else sys.argv[1:], verbose, folder)


def _torchrun(argv: list[str], verbose: bool, folder: str) -> int:
    """torchrun's main with ``argv``; its failures summed up in one line (see the module doc)."""
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not verbose:  # torchrun's loggers (banner, warnings, its own failure lines)
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
                logger.setLevel(logging.CRITICAL)

    try:
        run.main(argv)
    except ChildFailedError as e:
        if verbose:
            raise
        rank, how = first_failure(e.failures, read(folder))
        print(f"piper-sim run: rank {rank} {how}; piper-sim run -v shows torchrun's report",
              file=sys.stderr, flush=True)
        return RANK_FAILED
    except SignalException as e:
        if verbose:
            raise
        print(f"piper-sim run: stopped by {signal.Signals(e.sigval).name}; the workers were stopped",
              file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
