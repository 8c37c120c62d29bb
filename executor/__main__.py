"""``torchrun --nproc-per-node N -m executor PLAN.json [options]``: one worker per rank."""

import sys

from executor.worker import main

sys.exit(main())
