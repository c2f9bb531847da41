"""What this host offers a process: the cores it may use, and the CPU a benchmark's figures depend on (no heavy
imports: the engine factory and every benchmark script call it)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one), at least 1."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_line(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The line a benchmark prints above its tables: the CPU model, the cores this process may use and the widest
    vector extension. CPU figures are comparable only on the same kind of machine: these machines vary between
    sessions (an AMD EPYC with AVX2 only, Xeons with AVX-512 BF16), and vLLM's attention-bound decode ran 2–4× slower
    on the first (docs/benchmarks.md, "The 1M-token episode")."""
    model, flags = "unknown CPU", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux
        pass
    vector = ("AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags
              else "AVX2" if "avx2" in flags else "no AVX2")
    return f"machine: {model}, {usable_cores()} usable cores, {vector}" + (", AMX" if "amx_tile" in flags else "")
