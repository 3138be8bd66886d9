"""Process memory housekeeping."""

from __future__ import annotations


def return_freed_memory() -> None:
    """Hand the float layers freed while quantizing back to the OS (glibc keeps freed chunks under
    its adaptive mmap threshold in its heap, where they would count in the resident set for good)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass
