"""The hardware's measured limits, taken in the same run as the suites: device-to-device copy bandwidth
(bytes read + written) and bf16 GEMM throughput (cuBLAS through torch.matmul); and, per size, what one kernel
that only reads a given number of bytes reaches (read_bandwidth): the most any op reading them can reach, so a
row whose read ceiling is below its goal cannot meet it (fixed per-launch costs against too few bytes)."""

import functools

import torch
import triton
import triton.language as tl

from .._utils import interpreting, sm_count
from .counts import copy_bytes, gbps, gemm_flops, tflops
from .timing import l2_bytes, rotation_count, time_ms

COPY_BYTES = 1 << 30  # 1 GiB source, far larger than L2
GEMM_N = 8192


def copy_bandwidth(nbytes: int = COPY_BYTES) -> dict:
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    # Timed call by call: inside a CUDA graph the copy becomes a memcpy node served by the copy engines,
    # 20% slower (2.43 vs 3.00 TB/s on an H100); a 1 GiB copy makes the launch cost negligible.
    ms = time_ms(lambda: dst.copy_(src), cuda_graph=False)
    del src, dst
    torch.cuda.empty_cache()
    return {"copy_gbps": gbps(copy_bytes(nbytes), ms), "copy_ms": ms, "copy_bytes": nbytes}


@triton.jit
def _read_block(x_ptr, n, block, acc, BLOCK: tl.constexpr):
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit: the suites' rows reach 4.8 GB
    return acc + tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, steps, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """Program p sums blocks p, p + programs, p + 2·programs, … (steps of them) of x in fp32, so no load is dead;
    one partial sum a program."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    if INTERPRET:  # the interpreter cannot take tensor range() bounds; a for loop is what the pipeliner overlaps
        i = 0
        while i < steps:
            acc = _read_block(x_ptr, n, i * programs + pid, acc, BLOCK)
            i += 1
    else:
        for i in range(steps):
            acc = _read_block(x_ptr, n, i * programs + pid, acc, BLOCK)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_partials(x, programs: int, block: int = 4096, out=None):
    """One launch of _read_kernel over x: `programs` partial sums (fp32, into out if given) whose total is Σ x."""
    out = x.new_empty(programs, dtype=torch.float32) if out is None else out
    _read_kernel[(programs,)](x, out, x.numel(), triton.cdiv(x.numel(), programs * block), BLOCK=block,
                              INTERPRET=interpreting(), num_warps=8)
    return out


# programs per SM tried by read_bandwidth (its figure is the best of them and of torch.sum)
READ_PROGRAMS_PER_SM = (1, 2, 4, 8)


@functools.lru_cache(maxsize=None)
def read_bandwidth(nbytes: int) -> dict:
    """GB/s of one kernel reading nbytes (bf16) from HBM, timed as the suites time ops (CUDA graphs, input sets
    rotated past L2, timing.rotation_count): the best of _read_kernel at READ_PROGRAMS_PER_SM and torch.sum."""
    sets = [(torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda"),)
            for _ in range(rotation_count(nbytes, l2_bytes()))]
    sms = sm_count(sets[0][0].device)
    tries = {f"triton x{k}/SM": (lambda x, k=k: read_partials(x, k * sms)) for k in READ_PROGRAMS_PER_SM}
    tries["torch.sum"] = lambda x: x.sum(dtype=torch.float32)
    times = {name: time_ms(fn, sets) for name, fn in tries.items()}
    best = min(times, key=times.get)
    del sets
    return {"read_gbps": gbps(nbytes, times[best]), "read_ms": times[best], "read_by": best}


def gemm_bf16(n: int = GEMM_N) -> dict:
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
