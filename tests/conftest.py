"""Test-session settings: piper-sim's on-disk caches go to a temporary folder, not the user's;
the `tty_stderr` fixture (progress bars are drawn only on a terminal)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

if not os.environ.get("PIPER_SIM_CACHE_DIR"):  # subprocesses (CLI, torchrun ranks) inherit it
    os.environ["PIPER_SIM_CACHE_DIR"] = tempfile.mkdtemp(prefix="piper-sim-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PIPER_SIM_CACHE_DIR"], True)


class Terminal:
    """A real pseudo-terminal of 100 columns (a fresh one has 0: no room for a progress bar):
    `attach` makes it sys.stderr (in the test body: pytest's capture resets sys.stderr after
    the fixtures ran), `read` closes it and returns everything written to it."""

    def __init__(self, monkeypatch):
        import fcntl
        import pty
        import struct
        import termios

        self.monkeypatch = monkeypatch
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        self.tty = open(slave, "w", closefd=True)

    def attach(self) -> "Terminal":
        import sys

        self.monkeypatch.setattr(sys, "stderr", self.tty)
        return self

    def read(self) -> str:
        self.tty.close()
        chunks = []
        while True:
            try:
                data = os.read(self.master, 1 << 16)
            except OSError:  # EIO: the slave side is closed and everything was read
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks).decode(errors="replace")


@pytest.fixture
def tty_stderr(monkeypatch):
    """A `Terminal` to attach as sys.stderr (progress bars are drawn only on a terminal)."""
    term = Terminal(monkeypatch)
    yield term
    monkeypatch.undo()
    if not term.tty.closed:
        term.tty.close()
    os.close(term.master)
