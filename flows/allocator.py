"""jemalloc as the memory allocator of mintflow's processes, where the machine has it.

With glibc's malloc the training process's resident memory climbs for 100 GRPO iterations and
more (2438 -> 2882 MiB on the reference job, bench/vs_trl.py): freed blocks of the many tensor
shapes stay fragmented across threads. With jemalloc the same job runs at the same speed ~0.9 GB
lower and levels off after warm-up. The allocator can only be chosen when a process starts, so
the ``mintflow`` command re-executes itself with ``LD_PRELOAD``, and processes it starts (the
Prefect worker's flow runs) inherit it. ``MINTFLOW_ALLOCATOR=glibc`` keeps glibc's.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

LIBRARY = "libjemalloc.so.2"  # Debian's libjemalloc2 (make setup installs it)


def jemalloc_env() -> dict[str, str]:
    """``LD_PRELOAD`` for jemalloc when it is installed and wanted, else nothing."""
    if os.environ.get("MINTFLOW_ALLOCATOR", "jemalloc") != "jemalloc" or not ctypes.util.find_library("jemalloc"):
        return {}
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload:
        return {"LD_PRELOAD": preload}
    return {"LD_PRELOAD": f"{LIBRARY} {preload}".strip()}


def use_jemalloc(module: str) -> None:
    """Re-execute this process (``python -m module argv...``) under jemalloc, once, if it should be."""
    env = jemalloc_env()
    if env and env["LD_PRELOAD"] != os.environ.get("LD_PRELOAD"):
        os.environ.update(env)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]])


def allocator() -> str:
    """Which allocator this process runs with (for the record: run params, benchmarks)."""
    return "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"
