"""Bring your own nn.Module: mark its units (after Piper's ``annotate``) and get a `UserModel`.

A user model is a chain of *units* (pipeline, recompute and ZeRO-3 boundaries): each maps
the previous unit's output tensor to the next, the last one's output goes to the loss::

    def my_model(width=64, depth=8):
        net = MyNet(width, depth)
        return annotate(net, units=["stem", "blocks.*", "head"], loss=F.cross_entropy,
                        example_batch=make_batch)

``units`` are module paths; ``*`` matches one path component (``blocks.*`` is every child of
``blocks``). ``example_batch(micro_batch, seq_len, device, dtype, seed)`` returns
``(inputs, targets)``; ``loss(output, targets)`` a scalar (a mean over the batch, so
micro-batches add up to the whole batch). `annotate` runs the model once on ``meta`` and
refuses, in one line naming the unit, a model whose forward is not its units in order.

Weights (`UserModel.build_units`) depend on the seed only, never on the pipeline split: with
``init_unit`` (e.g. `reset_parameters`, for units made of torch.nn layers) each rank
allocates and initialises just its own units; without it each rank calls the factory on the
CPU under the seed (the model's own init, whole model in CPU memory once) and keeps its units.

Strategies name a factory returning an annotated model: ``"model": "py:pkg.mod:fn"`` or
``"py:path/to/file.py:fn"``, or ``{"source": "py:...", "kwargs": {...}}``; the plan carries
the source and kwargs (``meta["user_model"]``) so every rank of ``piper-sim run`` rebuilds it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.util
import os
import re
import sys
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

from costmodel.dtypes import torch_dtype
from piper_sim.module_paths import AnnotationError, path_pattern  # noqa: F401 (AnnotationError: its home for users)

if TYPE_CHECKING:  # torch loads where a model is built or run, not for a built-in model's compile
    import torch
    import torch.nn as nn

    Batch = tuple[torch.Tensor, torch.Tensor]


def _stopped(e: BaseException) -> str:
    """How a user's code stopped, for a message: the exception, or the sys.exit() call."""
    if isinstance(e, SystemExit):
        code = "" if e.code is None else repr(e.code)
        return f"sys.exit({code}) called; model code must return or raise, not exit"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@contextlib.contextmanager
def user_code(what: str, hint: str = "", refused: str = "") -> Iterator[None]:
    """Run a user's model code (a ``py:`` import, a factory, forward on meta): an exception,
    ``sys.exit()`` or a KeyboardInterrupt in it becomes one `AnnotationError`,
    ``"{what} ({how it stopped}){hint}"`` (``what`` names the source, file:function); an
    AnnotationError it raises (`annotate` refusing) gets the prefix ``refused``."""
    try:
        yield
    except AnnotationError as e:
        if not refused:
            raise
        raise AnnotationError(f"{refused}{e}") from None
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - the user's code: say where
        raise AnnotationError(f"{what} ({_stopped(e)}){hint}") from None


@dataclass
class UserModel:
    """What profiling, the compiler and the executor know about an annotated model."""

    module: nn.Module
    units: list[str]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    example_batch: Callable[..., Batch]
    name: str
    source: str | None = None                       # "py:module:function" that rebuilds it
    kwargs: dict[str, Any] = field(default_factory=dict)
    factory: Callable[[], "UserModel"] | None = field(default=None, repr=False)
    init_unit: Callable[[nn.Module, str], None] | None = field(default=None, repr=False)
    # sharding annotations (piper_sim.user_tp): module path -> "colwise" | "rowwise", and whether
    # the code outside the column-to-row regions is per-token (sequence parallelism may split it)
    tp_plan: dict[str, str] = field(default_factory=dict)
    sequence_parallel: bool = False
    # what the compiler's transformer helpers read, so they need no special case
    is_moe: ClassVar[bool] = False
    hidden: ClassVar[int] = 0

    @property
    def n_layers(self) -> int:
        return len(self.units)

    def unit(self, name: str) -> nn.Module:
        return self.module.get_submodule(name)

    def unit_param_count(self, name: str) -> int:
        return sum(p.numel() for p in self.unit(name).parameters())

    def param_count(self) -> int:
        return sum(self.unit_param_count(u) for u in self.units)

    def meta_unit(self, name: str, dtype: torch.dtype) -> nn.Module:
        """The unit on ``meta`` in ``dtype`` (a copy; for profiling)."""
        return copy.deepcopy(self.unit(name)).to(device="meta", dtype=dtype)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "kwargs": self.kwargs, "units": list(self.units)}

    def build_units(self, names: list[str], device: torch.device | str = "cpu",
                    dtype: torch.dtype | str = "fp32", seed: int = 0) -> dict[str, nn.Module]:
        """The named units on ``device`` in ``dtype`` with weights that depend only on
        ``seed`` (and the unit's name), never on which other units are built: any pipeline
        split gets the same weights. With an ``init_unit`` (see `annotate`) each unit is
        allocated and initialised on its own in fp32 under a seed per unit (any model size);
        without, the factory builds the whole model on the CPU under ``seed`` (the model's
        own initialisation) and the units are taken from it."""
        unknown = [n for n in names if n not in self.units]
        if unknown:
            raise AnnotationError(f"unit(s) {unknown} are not units of {self.name} ({', '.join(self.units)})")
        dtype = torch_dtype(dtype)
        if self.init_unit is not None:
            return {n: self._init_copy(n, device, dtype, _unit_seed(seed, n)) for n in names}
        whole = self._seeded_module(seed)
        return {n: copy.deepcopy(whole.get_submodule(n)).to(device=device, dtype=dtype) for n in names}

    def _init_copy(self, name: str, device, dtype: torch.dtype, seed: int) -> nn.Module:
        import torch

        mod = copy.deepcopy(self.unit(name))._apply(
            lambda t: torch.empty(t.shape, dtype=torch.float32 if t.is_floating_point() else t.dtype, device="cpu"))
        with torch.random.fork_rng(devices=[]), torch.no_grad(), \
                user_code(f"model: {self.source or self.name}: init_unit of unit {name!r} failed"):
            torch.manual_seed(seed)
            self.init_unit(mod, name)  # type: ignore[misc]
        return mod.to(device=device, dtype=dtype)

    def _seeded_module(self, seed: int) -> nn.Module:
        import torch

        if self.factory is None:
            if _on_meta(self.module):
                raise AnnotationError(f"{self.name}: a model built on meta needs a factory or an init_unit to get "
                                      "real weights; pass a factory function or annotate(..., init_unit=...)")
            return self.module
        with torch.random.fork_rng(devices=[]), torch.device("cpu"), \
                user_code(f"model: {self.source or self.name} failed building weights on the CPU"):
            torch.manual_seed(seed)
            return self.factory().module

    def run(self, units: dict[str, nn.Module], x: torch.Tensor) -> torch.Tensor:
        """Apply ``units`` (all of them, as `build_units` gives them) in order."""
        for name in self.units:
            x = units[name](x)
        return x


def _on_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()])


def _unit_seed(seed: int, unit: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(unit.encode())) % 2**63


def reset_parameters(unit: nn.Module, name: str) -> None:
    """An ``init_unit`` for units built from torch.nn layers: every submodule that holds
    parameters or buffers runs its ``reset_parameters()`` (refused, naming it, where one
    has none or keeps buffers that method does not set)."""
    from torch.nn.modules.batchnorm import _NormBase

    for path, m in unit.named_modules():
        own = any(True for _ in m.parameters(recurse=False))
        buffers = any(True for _ in m.buffers(recurse=False))
        if not own and not buffers:
            continue
        if not hasattr(m, "reset_parameters") or (buffers and not isinstance(m, _NormBase)):
            where = f"{name}.{path}" if path else name
            raise AnnotationError(f"init_unit reset_parameters: module {where} ({type(m).__name__}) has state that "
                                  "reset_parameters() does not set; give annotate an init_unit of your own or none")
        m.reset_parameters()


# --------------------------------------------------------------------------- annotate


def expand_units(module: nn.Module, patterns: list[str]) -> list[str]:
    """Module paths matched by ``patterns`` (``*`` is one path component), pattern by
    pattern, each in module order."""
    if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise AnnotationError("units must be a non-empty list of module paths such as [\"stem\", \"blocks.*\", \"head\"]")
    names = [n for n, _ in module.named_modules() if n]
    out: list[str] = []
    for p in patterns:
        rx = path_pattern(p)
        hits = [n for n in names if rx.match(n)]
        if not hits:
            raise AnnotationError(f"units: pattern {p!r} matches no submodule of {type(module).__name__}; "
                                  f"top-level children are {[n for n in names if '.' not in n]}")
        out += [h for h in hits if h not in out]
    for a in out:
        for b in out:
            if b.startswith(a + "."):
                raise AnnotationError(f"units: unit {b!r} is inside unit {a!r}; list disjoint modules")
    return out


def _check_params(module: nn.Module, units: list[str]) -> None:
    for n, _ in list(module.named_parameters()) + list(module.named_buffers()):
        if not any(n.startswith(u + ".") for u in units):
            raise AnnotationError(f"units: parameter/buffer {n!r} belongs to no unit; add its module to the units "
                                  "(every weight must live in a unit)")


def check_chain(model: UserModel, micro_batch: int = 2, seq_len: int = 16) -> None:
    """Run the model once on ``meta`` and check that its forward is its units in order,
    each taking the previous unit's output (the first the batch's inputs), the last
    giving the model's output, and that the loss of it is a scalar."""
    import torch

    module = model.module if _on_meta(model.module) else copy.deepcopy(model.module).to("meta")
    units = model.units
    calls: list[tuple[int, tuple, dict, Any]] = []
    handles = []
    for i, name in enumerate(units):
        def hook(_m, args, kwargs, out, i=i):
            calls.append((i, args, kwargs, out))
        handles.append(module.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
    try:
        with user_code(f"{model.name}: forward on meta failed",
                       "; the model and example_batch must run on the meta device"):
            x, targets = model.example_batch(micro_batch, seq_len, "meta", torch.float32, 0)
            out = module(x)
    finally:
        for h in handles:
            h.remove()
    seen = [i for i, *_ in calls]
    for i, name in enumerate(units):
        if seen.count(i) != 1:
            raise AnnotationError(f"unit {name!r} runs {seen.count(i)} times in forward; every unit must run "
                                  "exactly once")
    prev, prev_name = x, "the batch inputs"
    for k, (i, args, kwargs, y) in enumerate(calls):
        name = units[i]
        if i != k:
            raise AnnotationError(f"unit {name!r} runs at position {k} of forward but is listed at {i}; "
                                  "list the units in the order forward runs them")
        if len(args) != 1 or kwargs or args[0] is not prev:
            raise AnnotationError(f"unit {name!r} does not take {prev_name} as its only input (forward changes "
                                  "it in between or passes more arguments); move that code into a unit")
        if not isinstance(y, torch.Tensor):
            raise AnnotationError(f"unit {name!r} returns {type(y).__name__}, not one tensor; units hand one "
                                  "tensor to the next")
        prev, prev_name = y, f"unit {name!r}'s output"
    if out is not prev:
        raise AnnotationError(f"{model.name}: forward returns something other than unit {units[-1]!r}'s output; "
                              "move the code after it into that unit")
    with user_code(f"{model.name}: loss(output, targets) on meta failed"):
        loss = model.loss(out, targets)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise AnnotationError(f"{model.name}: loss(output, targets) must return a scalar tensor")


def annotate(module: nn.Module, units: list[str], loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             example_batch: Callable[..., Batch], name: str | None = None,
             init_unit: Callable[[nn.Module, str], None] | None = None,
             tensor_parallel: dict[str, str] | None = None, sequence_parallel: bool = False) -> UserModel:
    """Mark ``module``'s units (module paths, ``*`` one component) and check them on meta.
    ``init_unit(unit_module, unit_name)`` initialises one unit's freshly allocated weights
    in place (e.g. `reset_parameters`), so ranks build their units alone; without it every
    rank builds the whole model with the factory and keeps its units.

    Sharding annotations (`piper_sim.user_tp`), as a torchtitan ``parallelize`` plan writes
    torch's styles: ``tensor_parallel={"blocks.*.attn.wq": "colwise", "blocks.*.attn.wo":
    "rowwise", ...}`` (``nn.Linear``: colwise splits the output features, rowwise the input
    features and sums the outputs; ``nn.Embedding``: rowwise splits the vocabulary);
    ``sequence_parallel=True`` says the code outside the column-to-row regions is per token
    along dim 1 of the batch and of every unit's output, so sequence parallelism may split it."""
    import torch.nn as nn

    if not isinstance(module, nn.Module):
        raise AnnotationError(f"annotate: expected an nn.Module, got {type(module).__name__}")
    if not callable(loss) or not callable(example_batch):
        raise AnnotationError("annotate: loss and example_batch must be callables")
    names = expand_units(module, units)
    _check_params(module, names)
    tp_plan: dict[str, str] = {}
    if tensor_parallel is not None:
        from piper_sim.user_tp import expand_tp_plan

        tp_plan = expand_tp_plan(module, names, tensor_parallel)
    if sequence_parallel and not tp_plan:
        raise AnnotationError("annotate: sequence_parallel=True needs tensor_parallel annotations")
    if init_unit is not None and not callable(init_unit):
        raise AnnotationError("annotate: init_unit must be a callable (unit_module, unit_name) or None")
    model = UserModel(module=module, units=names, loss=loss, example_batch=example_batch,
                      name=name or type(module).__name__, init_unit=init_unit, tp_plan=tp_plan,
                      sequence_parallel=bool(sequence_parallel))
    check_chain(model)
    return model


# --------------------------------------------------------------------------- sources


def is_user_source(model: Any) -> bool:
    """Whether a strategy's ``model`` names a user model (``py:...`` or a source object)."""
    return isinstance(model, dict) or (isinstance(model, str) and model.startswith("py:"))


_FILE_MODULES: dict[str, str] = {}  # module name -> the file a "py:path.py:fn" source loaded it from


def _import_factory(source: str) -> Callable[..., Any]:
    body = source[3:]
    where, _, fn = body.rpartition(":")
    if not where or not fn:
        raise AnnotationError(f"model: source {source!r} must be py:module:function or py:path/file.py:function")
    if where.endswith(".py") and not os.path.isfile(where):
        raise AnnotationError(f"model: file {where} of source {source!r} not found")
    with user_code(f"model: cannot import {where} of source {source!r}"):
        if where.endswith(".py"):
            key = "piper_user_model_" + re.sub(r"\W", "_", os.path.abspath(where))
            spec = importlib.util.spec_from_file_location(key, where)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[key], _FILE_MODULES[key] = mod, where  # dataclasses & co look their module up
            spec.loader.exec_module(mod)  # type: ignore[union-attr]
        else:
            mod = importlib.import_module(where)
    factory = getattr(mod, fn, None)
    if not callable(factory):
        raise AnnotationError(f"model: {where} has no function {fn!r} (source {source!r})")
    return factory


def _call_factory(factory: Callable[..., Any], kwargs: dict[str, Any], what: str) -> UserModel:
    import torch

    with torch.device("meta"), user_code(f"model: {what} failed", refused=f"model: {what}: "):
        got = factory(**kwargs)
    if not isinstance(got, UserModel):
        raise AnnotationError(f"model: {what} returned {type(got).__name__}; return piper_sim.annotate.annotate(...)")
    return got


def load_user_model(source: str, kwargs: dict[str, Any] | None = None) -> UserModel:
    """Import a ``py:`` factory and build its model on meta (weights come from `build_units`)."""
    kwargs = dict(kwargs or {})
    factory = _import_factory(source)
    model = _call_factory(factory, kwargs, source)
    model.source, model.kwargs = source, kwargs
    model.factory = functools.partial(factory, **kwargs)
    return model


def source_of(obj: Any) -> str | None:
    """``py:module:qualname`` when ``obj`` is importable by that path (a module-level
    function outside ``__main__``), else None."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in qual or "." in qual:
        return None
    if mod in _FILE_MODULES:
        return f"py:{_FILE_MODULES[mod]}:{qual}"
    try:
        return f"py:{mod}:{qual}" if getattr(importlib.import_module(mod), qual, None) is obj else None
    except ImportError:
        return None


def resolve_user_model(model: Any, obj: Any = None) -> UserModel | None:
    """The `UserModel` of a strategy's ``model`` field or of an object passed to
    ``piper_sim.compile(..., model=...)`` (a `UserModel` or a factory returning one);
    None for a built-in model name."""
    if obj is not None:
        if isinstance(obj, UserModel):
            return obj
        if callable(obj):
            src = source_of(obj)
            if src is not None:
                return load_user_model(src)
            got = _call_factory(obj, {}, getattr(obj, "__name__", "model factory"))
            got.factory = got.factory or obj
            return got
        raise AnnotationError(f"model: expected an annotated model or a factory, got {type(obj).__name__}")
    if not is_user_source(model):
        return None
    if isinstance(model, dict):
        return load_user_model(model["source"], model.get("kwargs"))
    return load_user_model(model)


def check_user_setup(model: UserModel, ep: int, tp: int, recompute: dict[int, str], sp: bool = False,
                     seq_len: int = 0) -> str | None:
    """Why a resolved setup cannot run a user model, or None."""
    if ep > 1:
        return f"expert_parallel: user model {model.name} has no expert blocks; remove the directive"
    if tp > 1 and not model.tp_plan:
        return (f"tensor_parallel: user model {model.name} has no sharding annotations (annotate(..., "
                "tensor_parallel={path: \"colwise\" | \"rowwise\"})); add them or remove the directive")
    if tp > 1:
        from piper_sim.user_tp import sharded_dim

        for path, style in model.tp_plan.items():
            what, n = sharded_dim(style, model.module.get_submodule(path))
            if n % tp:
                return f"tensor_parallel: degree {tp} does not divide {path}'s {what} {n} ({style}); change the degree"
        if sp and not model.sequence_parallel:
            return (f"tensor_parallel: user model {model.name} does not allow sequence_parallel (annotate(..., "
                    "sequence_parallel=True) says its code outside the sharded linears is per token); set it false")
        if sp and seq_len % tp:
            return (f"tensor_parallel: sequence_parallel splits seq_len {seq_len} over degree {tp}; make seq_len a "
                    f"multiple of {tp} or set sequence_parallel false")
    if "selective" in recompute.values():
        return (f"recompute: mode selective recomputes attention cores, which user model {model.name} does not "
                "mark; use mode full")
    return None
