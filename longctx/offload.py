"""Saved-activation offload to pinned host memory that overlaps compute.

``BlockOffloader`` wraps the forward of a stack of blocks. For the blocks it is told to
offload, every tensor autograd saves inside the block (with full activation
checkpointing: only the block's input) is copied to pinned host memory on a side CUDA
stream as soon as it is saved, and the GPU copy is released once that transfer is done
(``record_stream`` keeps the allocator from reusing it earlier). In the backward, the
first use of block i's tensors starts the host -> GPU copy of block i-1's on the same side
stream, so the next block's inputs arrive while block i computes: one block prefetched
ahead, nothing on the critical path except the first offloaded block reached.

``offload_activations`` (``ParallelPlan``): ``False``/0 none, ``True`` every block, an int
n: the first n blocks (their inputs live longest: the backward reaches them last), so
that only what does not fit leaves the GPU.

On CPU tensors pack/unpack return the tensor itself (nothing to offload to) while the
bookkeeping runs the same way; ``tests/model/test_offload.py`` checks exact gradients.
Tensors named in ``keep`` (e.g. the RoPE tables every block shares) are never copied.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

from .validation import ArgumentValueError


class _Saved:
    """One saved tensor: on the GPU (not offloaded), in host memory, or prefetched back."""

    __slots__ = ("tensor", "host", "event", "device", "group")

    def __init__(self, tensor=None, host=None, event=None, device=None, group=-1):
        self.tensor, self.host, self.event, self.device, self.group = tensor, host, event, device, group


class BlockOffloader:
    """One forward's offload state; ``block(i, offload)`` wraps block i's forward."""

    def __init__(self, keep: Iterable[torch.Tensor] = (), min_bytes: int = 0):
        self.keep = {t.untyped_storage().data_ptr() for t in keep if isinstance(t, torch.Tensor)}
        self.min_bytes = min_bytes
        self.groups: dict[int, list[_Saved]] = {}
        self.prefetched: set[int] = set()
        self.stream: Optional[torch.cuda.Stream] = None
        self.copies_out = 0
        self.prefetches: list[int] = []  # block indices, in the order their prefetch started

    def _side_stream(self, device: torch.device):
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream

    # -- forward: pack ---------------------------------------------------------------

    def _pack(self, group: int, offload: bool, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.keep or t.numel() * t.element_size() < self.min_bytes:
            return t
        if not offload:
            # Stays where it is; the marker only tells the backward where it has got to.
            return _Saved(tensor=t, group=group)
        item = _Saved(group=group, device=t.device)
        self.groups.setdefault(group, []).append(item)
        self.copies_out += 1
        if not t.is_cuda:
            item.tensor = t  # nothing to offload to: the same tensor back
            return item
        stream = self._side_stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the GPU block is reused only after the copy has run
        item.host = host
        return item

    # -- backward: unpack + prefetch ------------------------------------------------------

    def _fetch(self, group: int) -> None:
        """Start the host -> GPU copies of one block's tensors on the side stream."""
        if group in self.prefetched or group not in self.groups:
            return
        self.prefetched.add(group)
        self.prefetches.append(group)
        for item in self.groups[group]:
            if item.host is None or item.tensor is not None:
                continue
            stream = self._side_stream(item.device)
            with torch.cuda.stream(stream):
                item.tensor = item.host.to(item.device, non_blocking=True)
                item.event = torch.cuda.Event()
                item.event.record(stream)

    def _unpack(self, item):
        if not isinstance(item, _Saved):
            return item
        self._fetch(item.group)
        self._fetch(item.group - 1)  # the block the backward reaches next
        t = item.tensor
        if item.host is None:
            return t  # on the GPU all along, or a CPU tensor
        if t is None:  # unpacked before (retain_graph): fetch again, synchronously
            return item.host.to(item.device)
        current = torch.cuda.current_stream(item.device)
        if item.event is not None:
            current.wait_event(item.event)
            item.event = None
        t.record_stream(current)  # allocated on the side stream, used on this one
        # The backward holds it now and frees it after use; keeping a reference here
        # would keep every prefetched block on the GPU until the graph is freed.
        item.tensor = None
        return t

    @contextlib.contextmanager
    def block(self, index: int, offload: bool):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(index, offload, t), self._unpack):
            yield


def offload_count(setting, n_blocks: int) -> int:
    """How many blocks (the first ones) ``offload_activations`` sends to host memory."""
    if setting is True:
        return n_blocks
    if not setting:
        return 0
    return min(int(setting), n_blocks)


def check_offload_setting(value) -> None:
    """``offload_activations`` is a bool or a non-negative int (a number of blocks)."""
    if isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 0:
        raise ArgumentValueError(
            "offload_activations",
            f"must be a bool or a non-negative int (blocks whose saved inputs go to host memory), got {value!r}",
        )
