"""The on-disk profile cache: a second profile dispatches no torch op; bad entries are ignored."""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from piper_sim import memory, profile_cache, profiling
from piper_sim.compiler import compile_strategy
from piper_sim.models import ZOO, get_config

_fresh = itertools.count()


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under it (profiling's own recorder dispatches to it)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder, and empty in-memory caches before and after."""
    monkeypatch.setenv("PIPER_SIM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(profile_cache.OFF_ENV, raising=False)
    forget()
    yield tmp_path / "profiles"
    forget()


def forget() -> None:
    """What a new process would have: no in-memory profiles."""
    profiling.profile_kind.cache_clear()
    profiling._profile_model.cache_clear()
    memory._layer_measure.cache_clear()


def tiny(model: str = "gpt-tiny"):
    """A config no other test has profiled in this process (a fresh name)."""
    return dataclasses.replace(get_config(model), name=f"{model}-cache-{next(_fresh)}")


def profile(cfg, micro_batch=2, seq=16, dtype=torch.float32):
    segments = profiling.profile_model(cfg, micro_batch, seq, dtype)
    return segments, memory.model_memory(cfg, segments, micro_batch, seq, dtype)


def counted(fn):
    with OpCounter() as counter:
        out = fn()
    return out, counter.ops


@pytest.mark.parametrize("model", ["gpt-tiny", "moe-tiny"])
def test_a_second_profile_reads_the_disk_and_dispatches_nothing(cache, model):
    cfg = tiny(model)
    first, ops = counted(lambda: profile(cfg))
    assert ops > 0  # the first profile runs the modules on meta
    kinds = {"gpt-tiny": 3, "moe-tiny": 4}[model]  # embed, head, dense | moe_pre + moe_experts
    files = sorted(os.listdir(cache))
    assert sum(f.startswith("profile_kind-") for f in files) == kinds
    assert any(f.startswith("_layer_measure-") for f in files)
    forget()
    again, ops = counted(lambda: profile(cfg))
    assert ops == 0 and again == first


def test_every_key_field_gets_its_own_entry(cache):
    cfg = tiny()
    profile(cfg)
    n = len(os.listdir(cache))
    for other in (dict(micro_batch=4), dict(seq=32), dict(dtype=torch.bfloat16)):
        profile(cfg, **other)
        assert len(os.listdir(cache)) > n, other
        n = len(os.listdir(cache))
    profile(dataclasses.replace(cfg, n_heads=2, n_kv_heads=2))  # a changed config field
    assert len(os.listdir(cache)) > n


@pytest.mark.parametrize("damage", [b"", b"not a pickle", pickle.dumps(("another key", "stale value"))],
                         ids=["empty", "garbage", "foreign-key"])
def test_a_corrupt_entry_is_ignored_and_rewritten(cache, damage):
    cfg = tiny()
    first, _ = profile(cfg)
    for name in os.listdir(cache):
        (cache / name).write_bytes(damage)
    forget()
    again, ops = counted(lambda: profile(cfg)[0])
    assert ops > 0 and again == first  # measured again
    forget()
    third, ops = counted(lambda: profile(cfg)[0])
    assert ops == 0 and third == first  # and the rewritten entries read back


def test_switched_off_or_unwritable_cache_still_profiles(cache, monkeypatch, tmp_path):
    monkeypatch.setenv(profile_cache.OFF_ENV, "0")
    first, _ = profile(tiny())
    assert not cache.exists()
    monkeypatch.delenv(profile_cache.OFF_ENV)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PIPER_SIM_CACHE_DIR", str(blocker))  # cache folder under a regular file
    forget()
    assert profile(tiny())[0]


def test_arguments_without_a_stable_spelling_are_not_cached(cache):
    calls = []

    @profile_cache.on_disk
    def double(x):
        calls.append(x)
        return 2 * x if isinstance(x, int) else x

    assert double(21) == 42 and double(21) == 42 and calls == [21]  # the second call reads the disk
    marker = object()  # its repr differs from process to process: called through, never stored
    assert double(marker) is marker and double(marker) is marker and calls == [21, marker, marker]
    assert len(os.listdir(cache)) == 1
    with pytest.raises(profile_cache._Uncacheable):
        profile_cache.key_text(double, (marker,), {})


def test_cached_plans_are_byte_identical(cache, monkeypatch):
    s = {"model": "moe-tiny", "cluster": "cpu:4", "global_batch": 8, "seq_len": 32, "microbatches": 4,
         "directives": [{"op": "pipeline", "degree": 2}, {"op": "schedule", "name": "zb1p"},
                        {"op": "expert_parallel", "degree": 2}, {"op": "recompute", "mode": "selective"}]}
    cfg = tiny("moe-tiny")
    monkeypatch.setitem(ZOO, cfg.name, cfg)
    s["model"] = cfg.name
    monkeypatch.setenv(profile_cache.OFF_ENV, "0")
    expected = compile_strategy(s).plan.content_hash()
    monkeypatch.delenv(profile_cache.OFF_ENV)
    forget()
    assert compile_strategy(s).plan.content_hash() == expected  # written
    forget()
    assert compile_strategy(s).plan.content_hash() == expected  # read


def test_a_dtype_by_name_reads_the_entry_a_torch_dtype_wrote(cache):
    """The compiler passes dtypes by name ("bf16"), so a cache hit needs no torch.dtype; older
    callers pass torch.bfloat16: both spell one key, and the second call dispatches nothing."""
    cfg = tiny()
    first = profile(cfg, dtype=torch.bfloat16)
    n = len(os.listdir(cache))
    forget()
    again, ops = counted(lambda: profile(cfg, dtype="bf16"))
    assert ops == 0 and again == first and len(os.listdir(cache)) == n
    assert profile_cache.key_text(profiling.profile_kind, (cfg, "dense", 2, 16, torch.float32), {}) == \
        profile_cache.key_text(profiling.profile_kind, (cfg, "dense", 2, 16, "fp32"), {})
