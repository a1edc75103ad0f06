"""Secrets in a process's environment: what can be taken out of sight, and what cannot.

Linux shows the environment a process started with in ``/proc/<pid>/environ`` for as long as it runs,
to its user and to root: ``os.environ.pop`` (``unsetenv``) removes a variable for the process and the
ones it starts, not from there. :func:`blank_initial_value` overwrites a variable's value in that first
environment, where the kernel reads it from, so ``/proc/<pid>/environ`` shows the variable with its value
blanked. Nothing can reach the copies others keep: the environment of whoever started the process, the
container runtime's configuration (``docker inspect``, a pod's spec), a shell's history. A secret given as
a file, the variable holding its path, is in none of them.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

#: Fields of /proc/<pid>/stat (1-based, as proc(5) numbers them) with the first environment's bounds.
_ENV_START, _ENV_END = 50, 51


def blank_initial_value(name: str) -> bool:
    """Overwrite the value of ``name`` in this process's first environment with NUL bytes.

    Call it once the variable has been read and removed from ``os.environ`` (nothing then points at the
    old string). Only Linux has ``/proc/self/stat``; elsewhere, or when the kernel hides the bounds, it
    does nothing.

    Returns:
        Whether a value was blanked.
    """
    try:
        with open("/proc/self/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        # The fields after the command's ")" start at the 3rd.
        start, end = int(fields[_ENV_START - 3]), int(fields[_ENV_END - 3])
    except (OSError, IndexError, ValueError):
        return False
    if not 0 < start < end:
        return False
    block = ctypes.string_at(start, end - start)
    prefix = name.encode() + b"="
    offset = 0
    blanked = False
    for entry in block.split(b"\0"):
        if entry.startswith(prefix) and len(entry) > len(prefix):
            ctypes.memset(start + offset + len(prefix), 0, len(entry) - len(prefix))
            blanked = True
        offset += len(entry) + 1
    if blanked:
        logger.debug("blanked %s in this process's first environment (/proc/%d/environ)", name, os.getpid())
    return blanked
