"""Plans stay byte-identical: a matrix of strategies, each plan's content hash against a golden file.

The golden file ``tests/data/plan_hashes.json`` was recorded before the package was re-floored into
layers. After a deliberate plan format change regenerate it with

    python tests/test_plan_hashes.py --update        # or: PIPER_SIM_UPDATE_HASHES=1 pytest tests/test_plan_hashes.py
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "plan_hashes.json")
UPDATE_ENV = "PIPER_SIM_UPDATE_HASHES"
HOW_TO_UPDATE = (f"if the plan format changed on purpose, regenerate the golden file with "
                 f"`python tests/test_plan_hashes.py --update` (or {UPDATE_ENV}=1 pytest tests/test_plan_hashes.py)")


def _strategy(model: str = "gpt-tiny", pp: int = 2, sched: str = "1f1b", dp: int = 1, zero: int = 0, m: int = 4,
              ep: int = 0, tp: int = 0, sp: bool = False, v: int | None = None, recompute: str | None = None,
              seq: int = 32) -> dict[str, Any]:
    d: list[dict[str, Any]] = [{"op": "pipeline", "degree": pp, **({"stages_per_rank": v} if v else {})},
                               {"op": "schedule", "name": sched}]
    if dp > 1 or zero:
        d.append({"op": "data_parallel", "degree": dp, "zero": zero})
    if ep:
        d.append({"op": "expert_parallel", "degree": ep})
    if tp:
        d.append({"op": "tensor_parallel", "degree": tp, "sequence_parallel": sp})
    if recompute:
        d.append({"op": "recompute", "mode": recompute})
    world = pp * dp * max(tp, 1)
    return {"model": model, "cluster": f"cpu:{world}", "global_batch": dp * m, "seq_len": seq, "microbatches": m,
            "directives": d}


MATRIX: dict[str, dict[str, Any]] = {
    "gpt-gpipe-pp2": _strategy(sched="gpipe"),
    "gpt-1f1b-pp4-m8": _strategy(pp=4, m=8),
    "gpt-interleaved-pp2-v2": _strategy(sched="interleaved_1f1b", v=2),
    "gpt-zb1p-pp2": _strategy(sched="zb1p"),
    "gpt-zbv-pp2": _strategy(sched="zbv", v=2),
    "gpt-dualpipe-pp2": _strategy(sched="dualpipe"),
    "gpt-dualpipev-pp2": _strategy(sched="dualpipev", v=2),
    **{f"gpt-1f1b-pp2-dp2-zero{z}": _strategy(dp=2, zero=z) for z in (0, 1, 2, 3)},
    "gpt-recompute-full": _strategy(recompute="full"),
    "gpt-recompute-selective-zb1p": _strategy(sched="zb1p", recompute="selective"),
    "gpt-tp2-pp2": _strategy(tp=2),
    "gpt-tp2-sp-dp2-zero1": _strategy(pp=1, dp=2, zero=1, tp=2, sp=True),
    "moe-ep2-pp1-dp2": _strategy("moe-tiny", pp=1, dp=2, ep=2, m=2),
    "moe-ep2-pp2-dp2-zero1": _strategy("moe-tiny", dp=2, zero=1, ep=2),
    "moe-ep2-dualpipev-recompute": _strategy("moe-tiny", sched="dualpipev", v=2, dp=2, zero=1, ep=2,
                                             recompute="selective"),
}


def plan_hashes() -> dict[str, str]:
    """The content hash of every plan of the matrix."""
    from piper_sim.compiler import compile_strategy

    return {name: compile_strategy(s).plan.content_hash() for name, s in MATRIX.items()}


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def write_golden() -> None:
    from piper_sim.files import write_text

    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    data = {"torch": _torch_version(), "hashes": plan_hashes()}
    write_text(GOLDEN, json.dumps(data, indent=1, sort_keys=True) + "\n")


def _golden() -> dict[str, Any]:
    with open(GOLDEN) as f:
        return json.load(f)


def test_golden_file_covers_the_matrix():
    assert sorted(_golden()["hashes"]) == sorted(MATRIX), HOW_TO_UPDATE


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_plan_hash_unchanged(name):
    if os.environ.get(UPDATE_ENV):
        pytest.skip(f"{UPDATE_ENV} set: the golden file is rewritten by the session fixture")
    golden = _golden()
    if golden["torch"] != _torch_version():  # profiled kernel costs differ between torch versions
        pytest.skip(f"hashes recorded with torch {golden['torch']}; {HOW_TO_UPDATE}")
    from piper_sim.compiler import compile_strategy

    got = compile_strategy(MATRIX[name]).plan.content_hash()
    assert got == golden["hashes"][name], f"plan {name!r} changed: {got} != {golden['hashes'][name]}; {HOW_TO_UPDATE}"


@pytest.fixture(scope="session", autouse=True)
def _update_golden_when_asked():
    if os.environ.get(UPDATE_ENV):
        write_golden()
    yield


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/test_plan_hashes.py --update   (rewrites tests/data/plan_hashes.json)")
    write_golden()
    print(f"wrote {GOLDEN}")
