"""Pipeline layouts as real runs write them: the ``pipeline`` directive's ``layout`` string.

The string is Megatron-Core's ``--pipeline-model-parallel-layout`` (class
``PipelineParallelLayerLayout``, ``parse_str_to_list`` and ``validate_layer_layout`` in
megatron/core/transformer/pipeline_parallel_layer_layout.py; docs "Custom Pipeline Model
Parallel Layout"): stages separated by ``|``, in model order, each a run of layer letters:
``E`` the embedding, ``t`` one transformer (decoder) layer, ``L`` the loss (with the head:
final norm, output layer), ``m`` a multi-token-prediction layer. ``x*n`` repeats a letter,
``(...)*n`` a group (no nesting), commas are cosmetic. ``"E|t*4|t*4|L"`` is an
embedding-only first stage, two stages of four layers and a head-only last stage;
``"Et*3|(tt|)*29,m|L"`` is Megatron's DeepSeek-V3 PP16 VPP2 example. As in Megatron, the
stage count is ``pp × v`` (``v`` the stages per rank) and stage ``s`` runs on rank ``s mod pp``
(loop placement), the embedding is the first letter and the loss the last, each once.

piper-sim keeps the embedding on the first stage and the head on the last, so the layout
reads into layers per stage (`layout_layers`); MTP modules (``m``, a model's ``mtp_layers``)
sit with the loss in the last stage, after its layers (Megatron's own restriction is looser: a
standalone MTP stage before the loss is refused here), and stages holding nothing are refused
(an empty stage would only forward its input).
"""

from __future__ import annotations

import re

from piper_sim.checks import MAX_LAYERS, StrategyError

_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_LETTER = re.compile(r"(.)\*(\d+)")
LETTERS = {"E": "embedding", "t": "transformer layer", "L": "loss (head)", "m": "MTP layer"}
MAX_LETTERS = 4 * MAX_LAYERS  # what a layout may unroll to (a 1e9 repeat is refused, not built)


def parse_layout(text: str, where: str) -> list[str]:
    """The layout's stages, each a string of layer letters (``"E|t*2|tL"`` -> ``["E", "tt", "tL"]``)."""
    if not isinstance(text, str) or not text.strip():
        raise StrategyError(f"{where} field 'layout' must be a Megatron layout string like \"E|t*4|t*4|L\" "
                            f"(got {text!r})")
    s = text.replace(",", "").replace(" ", "")
    for pattern in (_GROUP, _LETTER):
        total = [len(s)]

        def unroll(m: re.Match) -> str:
            total[0] += len(m.group(1)) * int(m.group(2)) - len(m.group(0))
            if total[0] > MAX_LETTERS:  # checked before the string is built
                raise StrategyError(f"{where} field 'layout' unrolls to more than {MAX_LETTERS:,} letters "
                                    f"(at {m.group(0)!r}); piper_sim.checks.MAX_LAYERS is {MAX_LAYERS:,}")
            return m.group(1) * int(m.group(2))
        s = pattern.sub(unroll, s)
    bad = sorted(set(s) - set(LETTERS) - {"|"})
    if bad:
        raise StrategyError(f"{where} field 'layout' has letter(s) {''.join(bad)!r} in {text!r}; use E (embedding), "
                            "t (transformer layer), L (loss and head), '|' between stages, x*n and (...)*n to repeat")
    return s.split("|")


def layout_layers(text: str, where: str) -> list[int]:
    """Transformer layers per stage of a layout string, checked as Megatron's
    ``validate_layer_layout`` checks it (plus: MTP only in the last stage, no stage holding nothing)."""
    stages = parse_layout(text, where)
    flat = "".join(stages)
    last = stages[-1]
    if "m" in flat and ("m" in "".join(stages[:-1]) or "t" in last[last.index("m"):]):
        raise StrategyError(f"{where} field 'layout': MTP modules ('m') must sit in the last stage, after its "
                            f"layers and before the loss (got {text!r}), e.g. \"...|tmL\"")
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise StrategyError(f"{where} field 'layout' must start with the embedding E, once, in the first stage "
                            f"(got {text!r})")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise StrategyError(f"{where} field 'layout' must end with the loss L, once, in the last stage "
                            f"(got {text!r})")
    empty = [i for i, st in enumerate(stages) if not st]
    if empty:
        raise StrategyError(f"{where} field 'layout': stage(s) {empty} hold nothing; give every stage the embedding, "
                            "a layer or the loss")
    return [st.count("t") for st in stages]


def stages_of(counts: list[int], pp: int, requested: int | None, where: str) -> int:
    """Stages per rank a layout of ``len(counts)`` stages implies on ``pp`` ranks."""
    n = len(counts)
    if n % pp:
        raise StrategyError(f"{where} field 'layout' has {n} stages, not a multiple of the degree {pp} "
                            "(Megatron: pp × virtual stages)")
    if requested is not None and requested != n // pp:
        raise StrategyError(f"{where} field 'layout' has {n} stages = {pp} × {n // pp}, but stages_per_rank is "
                            f"{requested}; drop stages_per_rank or make them agree")
    return n // pp


def layout_mtp_layers(text: str, where: str) -> int:
    """How many multi-token-prediction modules (``m``) a layout places."""
    return "".join(parse_layout(text, where)).count("m")
