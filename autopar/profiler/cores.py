"""How many cores this process may use: what the CPU profiler and ``validate`` count ranks against."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity: taskset, a container's cpuset), which
    ``os.cpu_count`` -- every core of the host -- is not."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1
