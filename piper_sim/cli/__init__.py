"""The app layer: the ``piper-sim`` command line and what only it runs.

`main` (the console script ``piper_sim.cli:main``; ``python -m piper_sim`` and
``python -m piper_sim.cli`` too) parses the subcommands of `piper_sim.cli.commands`; each
subcommand lives in its own module: `simulate`, `explore`, `run` (the torchrun launcher;
what the workers share is `executor.options`), `calibrate` (runs `calibration.microbench`),
`demo`, `validation` (simulated vs measured reports, for ``piper-sim validate`` and
notebooks). Modules here may import every layer below; nothing below imports them.
"""

from piper_sim.cli.commands import build_parser, main, setup_logging
from piper_sim.pipelining import compute_order  # kept importable here, where it used to live

__all__ = ["build_parser", "compute_order", "main", "setup_logging"]
