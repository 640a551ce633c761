"""A torch function mode that fails where a step's forward would stall or bake a host value.

Inside a CUDA graph's capture, and on the forward path the issue's static step promises, none
of these may happen:

* **a read on the host** of a device value: ``.item()``, ``.tolist()``, ``.cpu()``,
  ``.numpy()``, a tensor's truth (``if tensor:``), ``int(tensor)`` / ``float(tensor)``;
* **a tensor made from host data or host sizes**: ``torch.tensor`` / ``as_tensor`` /
  ``from_numpy`` (a copy from the host each step), and the factories that take their shape
  from the host (``torch.empty``, ``zeros``, ``ones``, ``full``, ``arange``): a per-step
  buffer a captured graph would replay at its captured size.

Shape-derived allocations (``empty_like``, ``new_empty``, an op's own result) are the
forward's activations: under a graph they come from its pool, so they pass. On CPU every
tensor is on the host, so this guard stands in for the GPU's rule: it checks the code path,
which is the same on both devices. It sees Python's calls only: a sync inside an operator's
own CUDA code (``torch.bincount`` reads its input's range on the host there) passes it, which
the GPU suite's captures catch (``tests/gpu/test_gpu_decode_graphs.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
_HOST_MADE = {"tensor", "as_tensor", "from_numpy", "empty", "zeros", "ones", "full", "arange"}


class HostSyncError(AssertionError):
    """The guarded code read a device value on the host, or made a tensor from host data."""


class NoHostSync(TorchFunctionMode):
    """``with NoHostSync(): forward()`` raises :class:`HostSyncError` at the first offence."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            raise HostSyncError(f"the forward read a tensor on the host ({name})")
        if name in _HOST_MADE and func is getattr(torch, name, None):
            raise HostSyncError(f"the forward made a tensor from the host (torch.{name})")
        return func(*args, **(kwargs or {}))
