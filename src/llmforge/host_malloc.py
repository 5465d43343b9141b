"""Host memory allocator settings for training processes (glibc ``mallopt``).

A training step allocates and frees the same large host tensors every step (activations, the
optimizer's temporaries: megabytes each on the CPU). glibc's ``malloc`` serves blocks above a
*dynamic* mmap threshold (128 KiB at start) with fresh ``mmap`` calls and gives the top of the
heap back to the kernel once more than the trim threshold is free, so every step page-faults
and zero-fills the same memory again: measured on the demo-sized CPU runs here, about 20,000
minor page faults per optimizer step, 10-15 % of the process's time in the kernel.

:func:`tune_host_malloc` (``trainer.malloc_tuning: true``, the default) sets, for the whole
process:

- ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's maximum on 64-bit): blocks up to 32 MiB come from the
  heap and are reused, larger ones are still mmapped;
- ``M_TRIM_THRESHOLD`` = 1 GiB: freed memory at the top of the heap is kept for the next step
  instead of being returned (peak RSS is unchanged, since the step reaches it anyway; the
  process's RSS between steps stays at the peak);
- ``M_TOP_PAD`` = 64 MiB: the heap grows in larger steps (fewer ``brk`` calls).

:func:`release_free_heap` (``malloc_trim(0)``) hands the pages that the heap holds free back to
the kernel, in every arena. The trainer calls it, then :func:`tune_host_malloc`, once the data
module is set up and before the model is built (``LLMModule.setup``): tokenizing an in-memory
corpus (the demo's 1.7 M tokens) frees ~100 MiB of encoder objects, partly in the ``tokenizers``
threads' arenas, and with the trim threshold already at 1 GiB they stayed resident under the
whole run's peak (issue 30: +124 MiB at the start of training, measured).

This is the same remedy as the ``MALLOC_*_`` environment variables of glibc (``mallopt(3)``)
and the jemalloc/tcmalloc advice of PyTorch's CPU performance guide, applied in-process. It
affects the host allocator only (CUDA memory has its own caching allocator) and does nothing
on other C libraries (macOS, musl). ``trainer.malloc_tuning: false`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt(3) parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024
TOP_PAD_BYTES = 64 * 1024 * 1024

_applied = False


def _glibc() -> "ctypes.CDLL | None":
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it (musl does not)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def release_free_heap() -> bool:
    """Return the free memory of every glibc arena to the kernel (``malloc_trim(0)``); whether
    it ran (``False`` off glibc). Costs a walk of the free lists: call it between phases (after
    the data is tokenized), not per step."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def tune_host_malloc() -> bool:
    """Apply the settings above to this process once; returns whether they are in effect.

    Never raises: on a C library without ``mallopt`` (or when a call is refused) it returns
    ``False`` and the allocator keeps its defaults.
    """
    global _applied
    if _applied:
        return True
    libc = _glibc()
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES)))
    _applied = ok
    return ok
