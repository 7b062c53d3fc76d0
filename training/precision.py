"""`precision="auto"`: the engine's precision from what the device computes natively.

bf16 halves activation memory and doubles matmul throughput where the hardware has it (CUDA
compute capability >= 8.0; x86 CPUs with AVX512-BF16 or AMX-BF16). Where it does not, PyTorch
emulates it: on a 2-core AVX2 EPYC a 512 x 512 matmul ran at 1.3 GFLOP/s in bf16 against 82 in
fp32, a 60x slower training step. So "auto" is bf16 only on native hardware and fp32 elsewhere;
fp16 is never chosen automatically (it needs loss scaling and overflows where bf16 does not).

The CPU is asked through torch, never by model name: cpuinfo's feature flags
(`torch.cpu.get_capabilities()`) say what the silicon has, and the kernels must also be allowed
to use it: oneDNN's bf16 matmul path (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`, false when
`ONEDNN_MAX_CPU_ISA` caps oneDNN below AVX-512) and ATen's vectorised kernels
(`torch.backends.cpu.get_cpu_capability()`, which `ATEN_CPU_CAPABILITY` caps). So capping both to
AVX2 on an AVX512-BF16 machine makes "auto" pick fp32, as on a real AVX2 machine.

`BERTFORGE_CPU_BF16=native|emulated` overrides the CPU's answer (in the driver and, through the
environment, in every worker): the test suite sets `emulated` so that it takes the same branch on
every machine, and a test of the bf16 branch sets `native`. Only the choice changes: the
arithmetic is still the machine's (bf16 named on an AVX2 CPU is emulated, slowly).
"""

from __future__ import annotations

import os

import torch

from bertforge.training.engine_config import PRECISIONS as REQUESTABLE

AUTO = "auto"
PRECISIONS = tuple(p for p in REQUESTABLE if p != AUTO)  # what an engine runs in

# cpuinfo's names for native bf16 arithmetic on x86.
_CPU_BF16_FEATURES = ("avx512_bf16", "amx_bf16")
CPU_BF16_OVERRIDE = "BERTFORGE_CPU_BF16"
_OVERRIDES = {"native": True, "emulated": False}


def cpu_native_bf16() -> tuple[bool, str]:
    """(whether this CPU computes bf16 natively and torch will use it, why)."""
    override = os.environ.get(CPU_BF16_OVERRIDE, "")
    if override:
        if override not in _OVERRIDES:
            raise ValueError(f"{CPU_BF16_OVERRIDE} must be one of {sorted(_OVERRIDES)} (or "
                             f"unset, to ask the CPU), got {override!r}")
        return _OVERRIDES[override], f"{CPU_BF16_OVERRIDE}={override} says so"
    capabilities = torch.cpu.get_capabilities()
    features = [name for name in _CPU_BF16_FEATURES if capabilities.get(name)]
    if not features:
        return False, ("this CPU has no native bf16 (no AVX512-BF16 or AMX-BF16): PyTorch "
                       "emulates bf16 there, ~60x slower than fp32 for matmuls")
    if not _onednn_bf16_enabled():
        return False, (f"this CPU has {'/'.join(features)} but oneDNN may not use it "
                       "(ONEDNN_MAX_CPU_ISA caps it below AVX-512): bf16 matmuls are emulated")
    aten = torch.backends.cpu.get_cpu_capability()
    if not aten.startswith("AVX512"):
        return False, (f"this CPU has {'/'.join(features)} but ATen's kernels are capped at "
                       f"{aten} (ATEN_CPU_CAPABILITY): bf16 would be emulated")
    return True, f"this CPU computes bf16 natively ({'/'.join(features)})"


def _onednn_bf16_enabled() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def cuda_native_bf16() -> tuple[bool, str]:
    """(whether the current CUDA device computes bf16 natively, why)."""
    # including_emulation=False: torch would otherwise say yes to any GPU that can store bf16.
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return True, f"{torch.cuda.get_device_name()} computes bf16 natively"
    return False, (f"{torch.cuda.get_device_name()} has no native bf16 (compute capability "
                   "< 8.0); fp16 is never chosen automatically: name it with --precision fp16")


def native_bf16(device_type: str) -> tuple[bool, str]:
    """Whether `device_type` ("cuda", "cpu", ...) computes bf16 natively, and why."""
    if device_type == "cuda":
        return cuda_native_bf16()
    if device_type == "cpu":
        return cpu_native_bf16()
    return False, f"bf16 support of device type {device_type!r} is not known"


def resolve_precision(
    requested: str, device_type: str, *, saved: str | None = None
) -> tuple[str, str]:
    """(the precision to run in, the reason) for `requested` on a `device_type` device.

    An explicit precision is kept as it is. "auto" on a resumed run keeps the precision its
    checkpoint was saved in (`saved`: its optimizer state is laid out for it); otherwise bf16
    where the device computes it natively, else fp32.
    """
    if requested != AUTO:
        if requested not in PRECISIONS:
            raise ValueError(f"precision must be one of {REQUESTABLE}, got {requested!r}")
        return requested, "named explicitly"
    if saved is not None:
        return saved, "the resumed checkpoint was trained in it"
    native, why = native_bf16(device_type)
    return ("bf16" if native else "fp32"), why


def slow_precision_warning(precision: str, device_type: str) -> str | None:
    """The one warning for bf16 on a CPU that emulates it, or None."""
    if precision != "bf16" or device_type != "cpu":
        return None
    native, why = cpu_native_bf16()
    if native:
        return None
    return (f"precision bf16 on this CPU will be slow: {why}; use --precision auto or fp32 "
            "for speed")

