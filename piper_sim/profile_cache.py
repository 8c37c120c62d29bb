"""On-disk cache of meta-device profiles, so a repeated compile runs no torch dispatch.

Profiling a segment runs the real torch module on ``meta`` tensors. The first such dispatch in
a process also imports ``torch._dynamo`` and sympy (about 1 s, more than a small compile's own
work): torch's Python reference kernels used for meta (``aten.arange``, ``aten.cat``, ...) and
every ``TorchDispatchMode.__torch_dispatch__`` are wrapped in ``torch._disable_dynamo``, whose
first call imports dynamo. That cannot be avoided without patching torch, so results are cached:

    @functools.lru_cache(maxsize=256)
    @on_disk
    def profile_kind(cfg, kind, micro_batch, seq_len, dtype): ...

The key is the function, its arguments (dataclasses such as ModelConfig field by field, torch
dtypes by name, ``torch.bfloat16`` spelled as ``"bf16"``, plain numbers and strings; a call with
anything else is not cached), the installed torch version (read from ``torch/version.py``, so a
hit imports no torch), the piper-sim version and a digest of the library's source files (an
edited model or profiler never reads an old entry). Entries are pickles in ``cache_dir()/profiles``
(`piper_sim.files.cache_dir`: $PIPER_SIM_CACHE_DIR, else $XDG_CACHE_HOME/piper-sim, else
~/.cache/piper-sim), written atomically; an unreadable, corrupt or mismatched entry is ignored
and rewritten; an unwritable cache folder only costs the speed-up. ``PIPER_SIM_PROFILE_CACHE=0``
turns the cache off. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import pickle
import re
import sys
from typing import Any, Callable, TypeVar

from costmodel.dtypes import dtype_name
from piper_sim.files import atomic_write, cache_dir

log = logging.getLogger(__name__)
OFF_ENV = "PIPER_SIM_PROFILE_CACHE"
_LIBRARY = os.path.dirname(os.path.abspath(__file__))
F = TypeVar("F", bound=Callable[..., Any])


class _Uncacheable(TypeError):
    """An argument the key cannot spell stably."""


def profile_dir() -> str:
    return os.path.join(cache_dir(), "profiles")


def enabled() -> bool:
    return os.environ.get(OFF_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of the library's own source files (piper_sim/*.py, not the command line)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(_LIBRARY)):
        if name.endswith(".py"):
            with open(os.path.join(_LIBRARY, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def torch_version() -> str | None:
    """The installed torch's ``__version__``, read from ``torch/version.py`` without importing
    torch (1 ms; ``importlib.metadata`` alone takes 40); None when torch is not installed."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.__version__
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        found = None
    if found is None:  # an unusual layout: import it after all
        import torch

        return torch.__version__
    return found.group(1)


def _spell(value: Any) -> Any:
    """A JSON-able spelling of an argument that is the same in every process."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_spell(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[_spell(k), _spell(v)] for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"dataclass": type(value).__qualname__,
                **{f.name: _spell(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return dtype_name(value)  # as the name the compiler passes: one entry for both
    raise _Uncacheable(type(value).__name__)


def key_text(fn: Callable, args: tuple, kwargs: dict) -> str:
    """The cache key of a call, readable (it is also stored in the entry and compared on load)."""
    from piper_sim import __version__

    return json.dumps({"fn": f"{fn.__module__}.{fn.__qualname__}", "args": _spell(list(args)),
                       "kwargs": _spell(sorted(kwargs.items())), "torch": torch_version(),
                       "piper_sim": __version__, "code": code_digest()}, sort_keys=True)


def entry_path(fn: Callable, key: str) -> str:
    return os.path.join(profile_dir(), f"{fn.__name__}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pkl")


def _load(path: str, key: str) -> tuple[bool, Any]:
    try:
        with open(path, "rb") as f:
            stored_key, value = pickle.load(f)
    except FileNotFoundError:
        return False, None
    except Exception as e:  # a truncated, corrupt or foreign file: measure again and overwrite it
        log.debug("ignoring profile cache entry %s: %s", path, e)
        return False, None
    return (True, value) if stored_key == key else (False, None)


def _store(path: str, key: str, value: Any) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_write(path, "wb") as f:
            pickle.dump((key, value), f, protocol=pickle.HIGHEST_PROTOCOL)
    except (OSError, pickle.PicklingError) as e:  # a read-only home, a full disk: only slower
        log.debug("profile cache entry %s not written: %s", path, e)


def on_disk(fn: F) -> F:
    """Cache `fn`'s results on disk (see the module docstring)."""

    @functools.wraps(fn)
    def cached(*args, **kwargs):
        if not enabled():
            return fn(*args, **kwargs)
        try:
            key = key_text(fn, args, kwargs)
        except _Uncacheable:
            return fn(*args, **kwargs)
        path = entry_path(fn, key)
        hit, value = _load(path, key)
        if hit:
            return value
        value = fn(*args, **kwargs)
        _store(path, key, value)
        return value

    return cached  # type: ignore[return-value]
