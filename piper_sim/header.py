"""The plan header: what both back ends need about the run, as typed fields.

`PlanHeader` reads a plan's ``meta`` object (`piper_sim.plan.Plan.header`) under the same JSON
names the compiler writes (`piper_sim.compiler.compile_strategy`): the model and its source,
batch and sequence sizes, dtype, seed, stages and their pieces, the parallelism axes' settings
(``tensor_parallel``, ``context_parallel``, ``moe``), ZeRO and its buckets, recompute, the
training stack. A key a plan lacks reads as the field's default, as older plans were read; the
keys it was read from (and any this version does not know) are kept, so `PlanHeader.to_meta`
gives back the very object `from_meta` read. ``meta`` stays the plan's stored (hashed) form.

Standard library only, like `piper_sim.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class _Section:
    """A JSON object as typed fields. ``keys``: the keys it was read from, in order (None, when
    built in code: every field that is not None); ``extra``: keys no field names, as they were."""

    keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    NESTED: ClassVar[dict[str, type]] = {}  # JSON name -> the _Section subclass its object reads as

    @classmethod
    def _names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("keys", "extra")]

    @classmethod
    def _read(cls, name: str, value: Any) -> Any:
        nested = cls.NESTED.get(name)
        return nested.from_json(value) if nested is not None and isinstance(value, dict) else value

    @staticmethod
    def _write(name: str, value: Any) -> Any:
        return value.to_json() if isinstance(value, _Section) else value

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Any:
        names = set(cls._names())
        return cls(keys=tuple(d), extra={k: v for k, v in d.items() if k not in names},
                   **{k: cls._read(k, v) for k, v in d.items() if k in names})

    def to_json(self) -> dict[str, Any]:
        keys = self.keys if self.keys is not None else [n for n in self._names() if getattr(self, n) is not None] + list(self.extra)
        return {k: self.extra[k] if k in self.extra else self._write(k, getattr(self, k)) for k in keys}


@dataclass(frozen=True)
class TensorParallelHeader(_Section):
    """``meta.tensor_parallel``: the degree, sequence parallelism and, when ``shard_tensor``
    selected only some segments, which (``layers`` None: every unit is sharded)."""

    degree: int = 1
    sequence_parallel: bool = False
    layers: list[int] | None = None
    embedding: bool = True
    head: bool = True


@dataclass(frozen=True)
class ContextParallelHeader(_Section):
    """``meta.context_parallel``: the degree and the attention's style (``allgather``, ``ring``)."""

    degree: int = 1
    style: str = "allgather"


@dataclass(frozen=True)
class MoEHeader(_Section):
    """``meta.moe``: what the expert all-to-all traffic depends on."""

    top_k: int = 0
    n_experts: int = 0


@dataclass(frozen=True)
class PlanHeader(_Section):
    """A plan's run settings (``Plan.meta``), field by field under its JSON names. Fields a
    back end must have are None when a plan lacks them."""

    strategy: dict[str, Any] | None = None  # the strategy it was compiled from (its JSON)
    model: str | None = None
    model_spec: dict[str, Any] | None = None  # a model that is not the zoo's model of that name
    cluster: str | None = None
    schedule: str | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    microbatches: int | None = None
    micro_batch_size: int | None = None
    dtype: str | None = None
    zero: int = 0
    seed: int | None = None
    num_stages: int | None = None
    stage_units: list[list[str]] | None = None  # per stage, its units
    stage_parts: list[list[list[str]]] | None = None  # per stage, its pieces' segment names
    model_flops_per_step: float = 0.0
    tokens_per_step: int | None = None
    stack: dict[str, Any] | None = None  # the training stack (costmodel.stack), absent: the default
    user_model: dict[str, Any] | None = None  # a user's nn.Module: its source, units, stage boundaries
    context_parallel: ContextParallelHeader | None = None
    tensor_parallel: TensorParallelHeader | None = None
    moe: MoEHeader | None = None
    zero3_buckets: list[dict[str, list[list[str]]]] | None = None  # per stage, tag -> buckets' segments
    recompute: dict[int, str] | None = None  # stage -> "full" | "selective" | "op" | "every"
    # stage -> the policy's fields beyond its mode (method, num_layers, every, modules;
    # piper_sim.recompute), only where set
    recompute_policy: dict[int, dict[str, Any]] | None = None

    NESTED: ClassVar[dict[str, type]] = {"context_parallel": ContextParallelHeader,
                                         "tensor_parallel": TensorParallelHeader, "moe": MoEHeader}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> PlanHeader:
        return cls.from_json(meta)

    def to_meta(self) -> dict[str, Any]:
        return self.to_json()

    @classmethod
    def _read(cls, name: str, value: Any) -> Any:
        if name in ("recompute", "recompute_policy") and isinstance(value, dict):
            return {int(k): v for k, v in value.items()}
        return super()._read(name, value)

    @staticmethod
    def _write(name: str, value: Any) -> Any:
        if name in ("recompute", "recompute_policy") and isinstance(value, dict):
            return {str(k): v for k, v in value.items()}
        return _Section._write(name, value)

    @property
    def tp(self) -> TensorParallelHeader:
        """Tensor parallelism's settings (degree 1 when the plan has none)."""
        return self.tensor_parallel or TensorParallelHeader()

    @property
    def cp(self) -> ContextParallelHeader:
        """Context parallelism's settings (degree 1 when the plan has none)."""
        return self.context_parallel or ContextParallelHeader()
