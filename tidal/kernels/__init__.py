"""Compute kernels below the expert runtime. ``cpu_experts``: the CPU expert executor (native C++
kernel loaded with ctypes, with a torch fallback)."""

from tidal.kernels.cpu_experts import (
    CpuExpertJob,
    CpuExpertKernel,
    detected_isa,
    kernel_available,
    supported_isas,
    torch_reference_experts,
    unavailable_reason,
)

__all__ = [
    "CpuExpertJob",
    "CpuExpertKernel",
    "detected_isa",
    "kernel_available",
    "supported_isas",
    "torch_reference_experts",
    "unavailable_reason",
]
