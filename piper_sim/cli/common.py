"""The options every ``piper-sim`` subcommand takes, before or after its name.

``-v/--verbose`` (more log output: debug), ``-q/--quiet`` (less log output and no progress
bars; ``-qq``: errors only) and ``--no-progress`` (no bars, logging unchanged) mean the
same everywhere. `add_common_options` adds them to every registered subparser (also the
ones registered later by other modules), skipping an option a subcommand defines itself;
`merge_common` folds the counts given after the subcommand into the global ones.
"""

from __future__ import annotations

import argparse

# (option strings, argparse keywords); the sub_* dests are merged by `merge_common`
COMMON_OPTIONS: tuple[tuple[tuple[str, ...], dict], ...] = (
    (("-v", "--verbose"), dict(dest="sub_verbose", action="count",
                               help="more log output on stderr (-v: debug); `piper-sim run -v` also shows "
                                    "torchrun's own warnings and failure report")),
    (("-q", "--quiet"), dict(dest="sub_quiet", action="count",
                             help="less output: warnings and errors only and no progress bars (-qq: errors only)")),
    (("--no-progress",), dict(dest="sub_no_progress", action="store_true", help="no progress bars")),
)


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """Add `COMMON_OPTIONS` (default SUPPRESS: absent unless given) to ``parser``, leaving out
    any option string it already has."""
    for flags, kw in COMMON_OPTIONS:
        free = [f for f in flags if f not in parser._option_string_actions]
        if free:
            parser.add_argument(*free, default=argparse.SUPPRESS, **kw)


def add_to_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """`add_common_options` on every subcommand registered so far."""
    for parser in dict.fromkeys(subparsers.choices.values()):  # an alias maps to the same parser
        add_common_options(parser)


def merge_common(args: argparse.Namespace) -> argparse.Namespace:
    """Fold the options given after the subcommand into ``verbose``, ``log_quiet`` and
    ``no_progress`` (given before and after, they add up)."""
    args.verbose = getattr(args, "verbose", 0) + vars(args).pop("sub_verbose", 0)
    args.log_quiet = getattr(args, "log_quiet", 0) + vars(args).pop("sub_quiet", 0)
    args.no_progress = bool(getattr(args, "no_progress", False) or vars(args).pop("sub_no_progress", False))
    return args


def progress_enabled(args: argparse.Namespace) -> bool:
    """Whether a command draws progress bars: not with ``-q`` or ``--no-progress`` (and the bars
    themselves stay off when stderr is not a terminal: `piper_sim.progress`)."""
    return not (getattr(args, "no_progress", False) or getattr(args, "log_quiet", 0)
                or getattr(args, "quiet", False))
