"""How far each of inductor's Triton kernels in a profile is from the GPU's memory bandwidth.

The fused kernels that torch.compile writes around the GEMMs (bias + GELU, dropout + residual
+ LayerNorm and their backwards) only move memory: each should run near the device's copy
bandwidth. A profile gives each kernel's time; inductor knows the bytes each one reads and
writes, and writes its estimate into the kernel's source (`'kernel_num_gb'` in its
`inductor_meta`) while `torch._inductor.config.benchmark_kernel` is on (a compile-time setting:
the kernels run as they would without it). Time over bytes says which kernels lose time, and
how much, against a plain copy measured on the same device; a kernel that draws random numbers
(dropout's mask, drawn inside the fused kernel) is marked, as Philox's integer work, not
memory, may bound it.

`gpu_profile.py` turns this on for its cases; on a CPU inductor writes C++, which carries no
estimate, and every figure here is n/a.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import torch
import torch._inductor.config

# A Triton kernel in inductor's source: its decorator's inductor_meta (a dict's repr, which
# holds the estimate and the kernel's name), then `@triton.jit` and the kernel's `def`. In a
# graph's wrapper the source sits inside `async_compile.triton('name', '''...''')`; a kernel's
# own module holds it alone. The metadata's `kernel_name` is the name: some inductor versions
# write the def as plain `triton_`.
_KERNEL_DEF = re.compile(r"@triton\.jit\s*\n\s*def (?P<name>triton_\w*)\(")
_META = "inductor_meta="
_NAME = re.compile(r"'kernel_name':\s*'(?P<name>triton_\w+)'")
_NUM_GB = re.compile(r"'kernel_num_gb':\s*(?P<gb>[0-9.eE+-]+)")
# What draws random numbers in inductor's Triton: tl.rand / tl.randint / tl.randn (and their
# 4x forms), triton_helpers' rand4x and rand_eager_kernel, Philox itself.
_RANDOM = re.compile(r"\btl\.rand|\btriton_helpers\.rand|\bphilox\b|\brandint64\b")
_SOURCE_END = "'''"


_estimates_since: float | None = None  # when enable_estimates ran (time.time())


def enable_estimates() -> None:
    """Have inductor write each Triton kernel's bytes into its source from now on (set before
    anything compiles: a kernel compiled earlier, or loaded from a cache filled without it,
    carries no estimate)."""
    global _estimates_since
    torch._inductor.config.benchmark_kernel = True
    if _estimates_since is None:
        _estimates_since = time.time()


def disable_estimates() -> None:
    torch._inductor.config.benchmark_kernel = False


def estimates_enabled() -> bool:
    return bool(torch._inductor.config.benchmark_kernel)


def parse_kernels(source: str) -> dict[str, dict[str, Any]]:
    """{kernel name: {"gb": bytes a call / 1e9 or None, "random": draws random numbers}} for
    every Triton kernel in `source` (a wrapper's code or a kernel's own module)."""
    kernels: dict[str, dict[str, Any]] = {}
    defs = list(_KERNEL_DEF.finditer(source))
    for i, match in enumerate(defs):
        meta_at = source.rfind(_META, defs[i - 1].end() if i else 0, match.start())
        meta = source[meta_at:match.start()] if meta_at >= 0 else ""
        body_end = defs[i + 1].start() if i + 1 < len(defs) else len(source)
        closing = source.find(_SOURCE_END, match.end(), body_end)
        body = source[match.end():closing if closing >= 0 else body_end]
        named = _NAME.search(meta)
        name = named["name"] if named else match["name"]
        if name == "triton_":  # neither says which kernel it is
            continue
        gb = _NUM_GB.search(meta)
        kernels[name] = {"gb": float(gb["gb"]) if gb else None,
                         "random": bool(_RANDOM.search(body))}
    return kernels


def _loaded_sources() -> list[tuple[str, str]]:
    """(path, source) of each module with a Triton kernel that inductor loaded in this process
    (graphs' wrappers and kernels' own modules), and, once `enable_estimates` ran, of each it
    wrote to its cache folder since: the two ways to find them, as inductor's bookkeeping has
    changed between versions."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    modules = list(getattr(PyCodeCache, "modules", []))
    modules += list(getattr(PyCodeCache, "modules_no_attr", {}).values())
    modules += list(getattr(PyCodeCache, "cache", {}).values())  # torch before 2.5
    paths = {m.__file__ for m in modules if getattr(m, "__file__", None)}
    if _estimates_since is not None:
        for folder, _, files in os.walk(cache_dir()):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    if name.endswith(".py") and os.path.getmtime(path) >= _estimates_since:
                        paths.add(path)
                except OSError:  # removed while we looked
                    continue
    sources = []
    for path in sorted(paths):
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError):  # removed since, or not inductor's
            continue
        if _KERNEL_DEF.search(source):
            sources.append((path, source))
    return sources


def loaded_kernels() -> dict[str, dict[str, Any]]:
    """Every Triton kernel inductor has loaded in this process (or written since the estimates
    were turned on), as `parse_kernels` gives them.
    A name that two different kernels share (two graphs can each have a `..._0`) keeps `gb`
    None: a profile sums such kernels under one name, so no single size fits its time."""
    found: dict[str, dict[str, Any]] = {}
    for _, source in _loaded_sources():
        for name, kernel in parse_kernels(source).items():
            seen = found.setdefault(name, kernel)
            if seen is not kernel and seen["gb"] != kernel["gb"]:
                seen["gb"] = None
            seen["random"] = seen["random"] or kernel["random"]
    return found


def save_sources(folder: str) -> int:
    """Copy the source of every module with a Triton kernel that `_loaded_sources` finds into
    `folder` (under its own file name): the GPU's kernels, to read where there is no GPU.
    Returns how many files are there now."""
    os.makedirs(folder, exist_ok=True)
    for path, source in _loaded_sources():
        with open(os.path.join(folder, os.path.basename(path)), "w", encoding="utf-8") as f:
            f.write(source)
    return len(os.listdir(folder))


def copy_bandwidth_gbps(device: str, gib: float = 1.0, repeats: int = 10) -> float | None:
    """A device-to-device copy of `gib` GiB, read and written: GB/s moved (1e9 bytes), the
    bandwidth a memory-bound kernel can reach here. None on a CPU."""
    if device != "cuda":
        return None
    n = int(gib * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 4 * n * repeats / seconds / 1e9


def bandwidth_report(kernels: dict[str, tuple[float, float]],
                     known: dict[str, dict[str, Any]], copy_gbps: float | None,
                     steps: int, top: int = 15) -> dict[str, Any]:
    """`kernels`: {name: (calls, microseconds)} over `steps` profiled steps; `known`: what
    `loaded_kernels` gives. Per step: the Triton kernels' time, the share of it with a size
    known, the bytes those move and the time they would take at `copy_gbps`; and the `top`
    kernels losing most time against that copy, each with its achieved bandwidth; and every
    Triton kernel's row, longest first."""
    triton = {name: v for name, v in kernels.items() if name.startswith("triton_")}
    rows = []
    for name, (calls, us) in triton.items():
        info = known.get(name, {})
        gb = info.get("gb")
        ms = us / 1e3 / steps
        row = {"name": name, "ms_per_step": ms, "calls_per_step": calls / steps,
               "gb_per_call": gb, "random": info.get("random"),
               "achieved_gbps": None, "floor_ms_per_step": None, "lost_ms_per_step": None}
        if gb is not None and us > 0:
            row["achieved_gbps"] = gb * calls / (us / 1e6)
            if copy_gbps:
                row["floor_ms_per_step"] = 1e3 * gb * calls / steps / copy_gbps
                row["lost_ms_per_step"] = ms - row["floor_ms_per_step"]
        rows.append(row)
    sized = [r for r in rows if r["gb_per_call"] is not None]
    ms_sized = sum(r["ms_per_step"] for r in sized)
    gb_sized = sum(r["gb_per_call"] * r["calls_per_step"] for r in sized)
    floor = 1e3 * gb_sized / copy_gbps if copy_gbps and sized else None
    lost = sorted((r for r in sized if r["lost_ms_per_step"] is not None),
                  key=lambda r: -r["lost_ms_per_step"])
    return {
        "copy_gbps": copy_gbps,
        "triton_ms_per_step": sum(r["ms_per_step"] for r in rows),
        "sized_ms_per_step": ms_sized,
        "sized_gb_per_step": gb_sized,
        "sized_floor_ms_per_step": floor,
        "random_ms_per_step": sum(r["ms_per_step"] for r in rows if r["random"]),
        "top_lost": lost[:top],
        # Every Triton kernel, longest first (the JSON's; the markdown lists `top_lost`).
        "kernels": sorted(rows, key=lambda r: -r["ms_per_step"]),
    }


def markdown(report: dict[str, Any]) -> list[str]:
    """The report's lines for a case's section (nothing where no kernel had a size)."""
    if not report["sized_ms_per_step"]:
        return []
    copy = report["copy_gbps"]
    ms, gb = report["sized_ms_per_step"], report["sized_gb_per_step"]
    lines = [
        f"Triton kernels against the memory bandwidth: {ms:.2f} of their "
        f"{report['triton_ms_per_step']:.2f} ms/step have inductor's size estimate; they move "
        f"{gb:.1f} GB/step (achieved {gb / (ms / 1e3):,.0f} GB/s)"
        + (f"; a device copy runs at {copy:,.0f} GB/s, at which they would take "
           f"{report['sized_floor_ms_per_step']:.2f} ms" if copy else "")
        + f". Kernels that draw random numbers: {report['random_ms_per_step']:.2f} ms/step.",
    ]
    if report["top_lost"]:
        lines += ["", "| ms/step | at copy bandwidth | lost | GB/call | GB/s | random | kernel |",
                  "|---:|---:|---:|---:|---:|---|---|"]
        for r in report["top_lost"]:
            lines.append(
                f"| {r['ms_per_step']:.2f} | {r['floor_ms_per_step']:.2f} "
                f"| {r['lost_ms_per_step']:.2f} | {r['gb_per_call']:.3f} "
                f"| {r['achieved_gbps']:,.0f} | {'yes' if r['random'] else ''} "
                f"| `{r['name']}` |")
    return lines
