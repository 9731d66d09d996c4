"""Peak-memory accounting for tensors allocated by a piece of code, on any device.

CUDA has ``torch.cuda.max_memory_allocated``; the CPU allocator has no equivalent, and RSS deltas are
noisy (the allocator keeps freed pages, the interpreter allocates numpy scratch). ``AllocationTracker``
instead watches every aten op through a ``TorchDispatchMode``: each output whose storage is new (not
one of the op's inputs) counts as an allocation until the storage is freed (a ``weakref.finalize`` on
the storage, which PyTorch keeps alive exactly as long as the C++ storage). The result is the peak of
live tensor bytes allocated inside the region: the "global memory" of the kernel model. The Triton CPU
interpreter's numpy tiles are not tensors and are not counted; they stand for on-chip memory.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class Allocation:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass
class AllocationReport:
    peak_bytes: int = 0
    live_bytes: int = 0
    allocations: list[Allocation] = field(default_factory=list)

    @property
    def largest_numel(self) -> int:
        return max((a.nbytes // a.dtype.itemsize for a in self.allocations), default=0)


class AllocationTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """``with AllocationTracker() as tracker: ...`` then read ``tracker.report``."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.report = AllocationReport()
        self._live: dict[int, int] = {}

    def _free(self, ptr: int) -> None:
        nbytes = self._live.pop(ptr, 0)
        self.report.live_bytes -= nbytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs, _ = tree_flatten((args, kwargs))
        input_ptrs = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        outputs, _ = tree_flatten(out)
        for t in outputs:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            nbytes = storage.nbytes()
            if nbytes == 0 or ptr in input_ptrs or ptr in self._live:
                continue
            self._live[ptr] = nbytes
            self.report.live_bytes += nbytes
            self.report.peak_bytes = max(self.report.peak_bytes, self.report.live_bytes)
            self.report.allocations.append(Allocation(tuple(t.shape), t.dtype, nbytes))
            weakref.finalize(storage, self._free, ptr)
        return out
