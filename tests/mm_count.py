"""A dispatch mode that counts the matmuls (``aten.mm``) torch runs inside it."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountMM(TorchDispatchMode):
    """``with CountMM() as count: ...`` then ``count.n``: the ``aten.mm`` calls run inside."""

    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))
