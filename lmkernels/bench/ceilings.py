"""The hardware's measured limits, taken in the same run as the suites: device-to-device copy bandwidth
(bytes read + written) and bf16 GEMM throughput (cuBLAS through torch.matmul)."""

from .counts import copy_bytes, gbps, gemm_flops, tflops
from .timing import time_ms

COPY_BYTES = 1 << 30  # 1 GiB source, far larger than L2
GEMM_N = 8192


def copy_bandwidth(nbytes: int = COPY_BYTES) -> dict:
    import torch

    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    # Timed call by call: inside a CUDA graph the copy becomes a memcpy node served by the copy engines,
    # 20% slower (2.43 vs 3.00 TB/s on an H100); a 1 GiB copy makes the launch cost negligible.
    ms = time_ms(lambda: dst.copy_(src), cuda_graph=False)
    del src, dst
    torch.cuda.empty_cache()
    return {"copy_gbps": gbps(copy_bytes(nbytes), ms), "copy_ms": ms, "copy_bytes": nbytes}


def gemm_bf16(n: int = GEMM_N) -> dict:
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: torch.matmul(a, b, out=c))
    del a, b, c
    torch.cuda.empty_cache()
    return {"gemm_bf16_tflops": tflops(gemm_flops(n, n, n), ms), "gemm_ms": ms, "gemm_shape": [n, n, n]}


def measure() -> dict:
    """Both ceilings; prints them as it goes."""
    out = copy_bandwidth()
    print(f"ceiling: device-to-device copy {out['copy_gbps']:.0f} GB/s (read + write of {COPY_BYTES >> 20} MiB)",
          flush=True)
    out.update(gemm_bf16())
    print(f"ceiling: bf16 GEMM {GEMM_N}^3 {out['gemm_bf16_tflops']:.0f} TFLOP/s", flush=True)
    return out
