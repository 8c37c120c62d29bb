"""``python -m piper_sim SUBCOMMAND ...``: the same as the ``piper-sim`` command."""

import sys

from piper_sim.cli.commands import main

sys.exit(main())
