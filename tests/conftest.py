"""Test-session settings: piper-sim's on-disk caches go to a temporary folder, not the user's."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

if not os.environ.get("PIPER_SIM_CACHE_DIR"):  # subprocesses (CLI, torchrun ranks) inherit it
    os.environ["PIPER_SIM_CACHE_DIR"] = tempfile.mkdtemp(prefix="piper-sim-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PIPER_SIM_CACHE_DIR"], True)
