"""headroom's own CPU kernels, compiled from C++ with torch's extension builder.

`make install` builds them once (`python -m headroom.kernels`) into torch's
extension cache; at run time they load from there. Where no compiler is present or the
build fails, cpu_kernels() answers None with the reason, and callers use PyTorch's ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
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


# By what they compute: common/ (the bindings, the thread pool, SIMD and tensor helpers),
# linear/ (the quantised matmuls and the LoRA deltas), attention/ (paged decode and prefill; the Triton
# kernels beside them), ops/ (fused elementwise and norm ops).
SOURCES = (
    "common/bindings.cpp",
    "common/pool.cpp",
    "linear/q4_linear.cpp",
    "linear/q8_linear.cpp",
    "linear/qdot_linear.cpp",
    "linear/qdot_avx2.cpp",
    "linear/quantise.cpp",
    "linear/lora_add.cpp",
    "attention/paged_attention.cpp",
    "attention/decode_spans.cpp",
    "attention/paged_tile.cpp",
    "attention/paged_prefill.cpp",
    "ops/fused_ops.cpp",
)
INCLUDES = ("common", "attention")
VNNI_FLAGS = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}
# One build per checkout: torch's builder writes the sources' absolute paths into its
# build file, so two checkouts sharing one name rebuild over each other each time the
# other has built.
NAME = "headroom_cpu_kernels_" + hashlib.sha1(str(HERE).encode()).hexdigest()[:10]
PROGRESS_EVERY_S = 10.0


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Held across torch's build and load. torch's builder marks a build with a `lock` file
    and waits, without end, for any it finds; a build killed part-way (a timeout, Ctrl-C,
    the OOM killer) leaves it behind. This OS lock dies with its process instead: whoever
    holds it knows that any `lock` there is such a leftover, and clears it at once, and
    a start that finds another live process building waits for it and says so."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "headroom.lock", "a+", encoding="ascii") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.seek(0)
            log.warning("waiting for process %s, which is building headroom's CPU kernels", held.read() or "?")
            fcntl.flock(held, fcntl.LOCK_EX)
        held.seek(0)
        held.truncate()
        held.write(str(os.getpid()))
        held.flush()
        leftover = build_dir / "lock"
        if leftover.exists():
            log.warning("removing the build lock of a build that did not finish: %s", leftover)
            leftover.unlink(missing_ok=True)
        yield


@contextlib.contextmanager
def progress(build_dir: Path, total: int) -> Iterator[None]:
    """Say what is being compiled while a build runs (a first start that compiles for a
    minute in silence looks hung). A load from the cache compiles nothing and says nothing."""
    done = threading.Event()
    started = time.time()

    def compiled() -> int:
        fresh = 0
        for o in build_dir.glob("*.o"):
            with contextlib.suppress(OSError):  # the builder may be replacing it
                fresh += o.stat().st_mtime >= started
        return fresh

    def report() -> None:
        announced = False
        while not done.wait(PROGRESS_EVERY_S if announced else 2.0):
            count = compiled()
            if not announced and (count or (build_dir / "lock").exists()):
                log.warning("building headroom's CPU kernels for this CPU: %d C++ files into %s", total, build_dir)
                announced = True
            elif announced:
                log.warning("... %d of %d compiled after %.0f s", count, total, time.time() - started)

    reporter = threading.Thread(target=report, name="headroom-kernel-build-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()
        if compiled():
            log.warning("headroom's CPU kernels: built in %.0f s", time.time() - started)


def compiler_takes(flags: list[str]) -> bool:
    """Whether the C++ compiler torch builds with accepts these flags (a preprocessor run)."""
    cxx = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run(
            [cxx, *flags, "-x", "c++", "-E", "-"], input="", capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@functools.cache
def cpu_kernels() -> tuple[ModuleType | None, str]:
    """(the compiled module with q4_linear, q8_linear, qdot_linear and paged_decode_attention, or None; why)."""
    if os.environ.get("HEADROOM_NO_KERNELS"):
        return None, "HEADROOM_NO_KERNELS is set"
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import load

    # torch keeps the build directory's name to itself; without it, no lock (torch's own wait).
    with_build_dir = getattr(cpp_extension, "_get_build_directory", None)
    build_dir = Path(with_build_dir(NAME, False)) if with_build_dir is not None else None

    flags = ["-O3", "-fopenmp"]  # at::parallel_for is OpenMP inlined from its header
    cpu = cpu_flags()
    if {"avx2", "fma"} <= cpu:
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if VNNI_FLAGS <= cpu:
        flags += ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"]
        # bfloat16 attention: only where the compiler knows the flags too (GCC 10 for
        # BF16, 11 for AMX), else an older compiler would fail the whole build.
        wanted = [["-mavx512bf16"]] if "avx512_bf16" in cpu else []
        if wanted and {"amx_tile", "amx_bf16"} <= cpu:
            wanted.append(["-mamx-tile", "-mamx-bf16"])
        for extra in wanted:
            if not compiler_takes(extra):
                break
            flags += extra
    try:
        with (
            build_lock(build_dir) if build_dir else contextlib.nullcontext(),
            progress(build_dir, len(SOURCES)) if build_dir else contextlib.nullcontext(),
        ):
            module = load(
                name=NAME,
                sources=[str(HERE / name) for name in SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(HERE / folder) for folder in INCLUDES],
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, or it failed
        log.warning("headroom's CPU kernels did not build (%s); using PyTorch's ops", exc)
        return None, f"build failed: {str(exc).splitlines()[0][:200]}"
    simd = "AVX-512 VNNI" if "-mavx512vnni" in flags else "AVX2+FMA" if "-mavx2" in flags else "portable C++"
    if "-mavx512bf16" in flags:
        simd += ", BF16 and AMX" if "-mamx-bf16" in flags else " and BF16"
    return module, f"headroom's CPU kernels ({simd})"
