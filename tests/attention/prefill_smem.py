"""Compile the Triton prefill kernel for an NVIDIA GPU without one and print its shared memory per block.

Only CUDA itself is stood in for: a fake active Triton driver reports the target (sm_80 .. sm_90) and
`JITFunction.warmup` runs Triton's real NVIDIA compiler (its bundled ptxas) down to a cubin, never a launch;
the compiled kernel's `metadata.shared` is what the driver would check against the device's
`shared_memory_per_block_optin`. From the review tools of session 40 (fakedrv.py, compile_only.py).

    python tests/attention/prefill_smem.py 86 fp16:256:64,64,8,1 fp32:128:64,32,4,2 ...

prints one line `cap dtype block_d bm,bn,warps,stages shared` per job, the most over the plain and the
soft-capped, windowed variant. It measured rayllm.attention.triton_prefill.SHARED_BYTES. Run it in a process of its
own: the fake driver replaces Triton's for the whole process (interpreter tests included).
"""

from __future__ import annotations

import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime.driver import driver

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class FakeDriver:
    """The active driver of a process with a GPU of compute capability `cap` (none is touched)."""

    def __init__(self, cap: int) -> None:
        self.target = GPUTarget("cuda", cap, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise NotImplementedError

    def map_python_to_cpp_type(self, ty: str) -> str:
        return CudaDriver.map_python_to_cpp_type(self, ty)


def shared_bytes(cap: int, dtype: torch.dtype, block_d: int, block_m: int, block_n: int, warps: int,
                 stages: int) -> int:
    """Shared memory of the prefill kernel compiled for sm_<cap>: the most over its compile-time variants."""
    from rayllm.attention.triton_prefill import _prefill_kernel

    driver.set_active(FakeDriver(cap))
    args = [torch.zeros(1, dtype=dtype)] * 4 + [torch.zeros(1, dtype=torch.int32)] * 4
    # Strides and sizes as a real step passes them (ints; 1 would specialise them to constants).
    ints = [4096, 256, 4096, 256, 65536, 16384, 256, 8, 0.0625, 50.0, 4096, 64, 2, block_d, 3]
    most = 0
    for softcap, window in ((False, False), (True, True)):  # one alone measured the same as both
        kernel = _prefill_kernel.warmup(
            *args, *ints, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, TILE_IN_BLOCK=True, SOFTCAP=softcap,
            WINDOW=window, PRECISION="ieee" if dtype == torch.float32 else "tf32", num_warps=warps,
            num_stages=stages, grid=(1,))
        most = max(most, kernel.metadata.shared)
    return most


def main(argv: list[str]) -> None:
    cap = int(argv[0])
    for job in argv[1:]:
        name, block_d, tiles = job.split(":")
        bm, bn, warps, stages = (int(x) for x in tiles.split(","))
        print(cap, name, block_d, tiles, shared_bytes(cap, DTYPES[name], int(block_d), bm, bn, warps, stages),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
