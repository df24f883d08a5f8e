"""headroom's own CPU kernels, compiled from C++ with torch's extension builder.

`make install` builds them once (`python -m headroom.models.kernels`) into torch's
extension cache; at run time they load from there. Where no compiler is present or the
build fails, cpu_kernels() answers None with the reason, and callers use PyTorch's ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent


@functools.cache
def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it is not readable)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


SOURCES = (
    "bindings.cpp",
    "q4_linear.cpp",
    "q8_linear.cpp",
    "qdot_linear.cpp",
    "paged_attention.cpp",
    "decode_spans.cpp",
    "paged_tile.cpp",
    "paged_prefill.cpp",
    "fused_ops.cpp",
    "pool.cpp",
)
VNNI_FLAGS = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}
# One build per checkout: torch's builder writes the sources' absolute paths into its
# build file, so two checkouts sharing one name rebuild over each other (3 minutes, the
# lock held) each time the other has built.
NAME = "headroom_cpu_kernels_" + hashlib.sha1(str(HERE).encode()).hexdigest()[:10]
# A build takes ~3 minutes on 2 cores. torch's builder holds a `lock` file in the build
# directory while it compiles and waits, without end, for any lock it finds; a build that
# was killed leaves its lock behind, and every later start would hang on it.
STALE_LOCK_S = 900.0


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove the builder's lock in build_dir if it is older than any build takes."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    log.warning("removing a stale build lock left %.0f s ago by a build that did not finish: %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


@functools.cache
def cpu_kernels() -> tuple[ModuleType | None, str]:
    """(the compiled module with q4_linear, q8_linear, qdot_linear and paged_decode_attention, or None; why)."""
    if os.environ.get("HEADROOM_NO_KERNELS"):
        return None, "HEADROOM_NO_KERNELS is set"
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import load

    # torch keeps the build directory's name to itself; without it, no cleanup (torch's own wait).
    with_build_dir = getattr(cpp_extension, "_get_build_directory", None)
    if with_build_dir is not None:
        clear_stale_lock(Path(with_build_dir(NAME, False)))

    flags = ["-O3", "-fopenmp"]  # at::parallel_for is OpenMP inlined from its header
    cpu = cpu_flags()
    if {"avx2", "fma"} <= cpu:
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if VNNI_FLAGS <= cpu:
        flags += ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"]
    try:
        module = load(
            name=NAME,
            sources=[str(HERE / name) for name in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(HERE)],
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, or it failed
        log.warning("headroom's CPU kernels did not build (%s); using PyTorch's ops", exc)
        return None, f"build failed: {str(exc).splitlines()[0][:200]}"
    simd = "AVX-512 VNNI" if "-mavx512vnni" in flags else "AVX2+FMA" if "-mavx2" in flags else "portable C++"
    return module, f"headroom's CPU kernels ({simd})"
