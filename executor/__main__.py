"""``torchrun --nproc-per-node N -m executor PLAN.json [options]``: one worker per rank.

Under torchrun the worker first makes sure it dies with its agent (`executor.lifetime`),
before torch loads (a second or more): an agent killed in that time must not leave it behind.
"""

import os
import sys

from executor.lifetime import die_with_parent

if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
    die_with_parent()

from executor.worker import main  # noqa: E402 - imports torch

sys.exit(main())
