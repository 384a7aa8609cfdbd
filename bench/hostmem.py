"""Host memory of this process as the kernel counts it (Linux), for the benches' CPU figures.

A process started with glibc's mmap threshold at 64 KiB (``MMAP_ENV``) returns a freed tensor to
the kernel at once, so its peak RSS follows the live tensors; with the default, adaptive
threshold, freed blocks of the sizes already seen stay in the heap and the peak reads high.
"""
from __future__ import annotations

import os

MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def rss() -> int:
    """Resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """The peak RSS (VmHWM) back to the RSS now, so a measurement's peak is its own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    """Peak resident bytes (VmHWM) since the process started or the last reset_peak()."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))



class TensorPeak:
    """Peak bytes of live CPU tensor storages over a block of work, counted like CUDA's
    max_memory_allocated (storages, without the allocator's rounding or the libraries' code):

        with TensorPeak() as tp:
            step()
        tp.peak, tp.base          # bytes: the peak over the block, and what was live at its start

    The storages live at the start are found through the garbage collector's tensors (weights,
    optimizer states, buffers); each storage an operator makes inside the block is counted from
    its creation to its release (a weak reference on the storage; torch keeps one Python object
    per storage). Work below the dispatcher that makes no tensor (a kernel's own scratch) is
    not seen."""

    def __init__(self):
        self.base = self.live = self.peak = 0
        self.peak_op = None          # the operator whose output made the peak
        self._mode = None

    def __enter__(self):
        import gc
        import warnings
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        from torch.utils.weak import WeakIdKeyDictionary

        seen = WeakIdKeyDictionary()
        tracker = self

        def track(t) -> None:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
                return
            st = t.untyped_storage()
            if st in seen:
                return
            n = st.nbytes()
            seen[st] = n
            tracker.live += n
            tracker.peak = max(tracker.peak, tracker.live)
            weakref.finalize(st, tracker._release, n)

        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                     # deprecated module attributes met on the way
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    try:
                        track(obj)
                    except (RuntimeError, NotImplementedError):     # tensor subclasses without storage
                        pass
        self.base = self.live

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                before = tracker.peak
                for t in tree_leaves(out):
                    track(t)
                if tracker.peak > before:
                    tracker.peak_op = func.__name__
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def _release(self, n: int) -> None:
        self.live -= n

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False
