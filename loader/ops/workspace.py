"""Per-call workspaces of the launchers that need device memory beside the call's tensors.

A launcher (``ImagesLauncher``, ``QuantizeLauncher``) takes its workspace from torch's caching allocator on
the current stream, which is the stream the library launches on, and drops it when `launch` returns.
torch then hands the block out again only to work queued after those launches on that stream; under graph
capture the block comes from the graph's pool.
"""
from __future__ import annotations

from .checks import torch_module


class PerCallWorkspace:
    """Mixin: ``_alloc(nbytes)`` -> a new uint8 tensor of that many bytes on the launcher's device
    (``self.device.ordinal``).  The allocating function is made on first use (torch is imported then)."""

    _empty = None

    def _alloc(self, nbytes: int):
        empty = self._empty
        if empty is None:
            torch = torch_module()
            dev = torch.device("cuda", getattr(self.device, "ordinal", 0))
            u8 = torch.uint8
            empty = self._empty = lambda n: torch.empty(n, dtype=u8, device=dev)
        return empty(nbytes)
