"""Timing: `triton.testing.do_bench` medians over input sets rotated through a working set larger than L2.

do_bench already zeroes a 256 MB buffer before every timed call; rotating the inputs as well keeps
every call reading from HBM even where that flush is not enough (and is what DESIGN.md asks for).
"""

import itertools
import math

MIN_ROTATION_BYTES = 256 << 20  # at least this many bytes touched over one cycle of the input sets
MAX_SETS = 16
DEFAULT_L2 = 50 << 20  # H100; H200 has 60 MB


def l2_bytes() -> int:
    """L2 size of the current CUDA device (DEFAULT_L2 when torch does not report it)."""
    import torch

    if not torch.cuda.is_available():
        return DEFAULT_L2
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2)


def rotation_count(bytes_per_call: int, l2: int = DEFAULT_L2, *, min_total: int = MIN_ROTATION_BYTES,
                   max_sets: int = MAX_SETS) -> int:
    """How many input sets to cycle through so that one cycle touches ≥ max(min_total, 4·L2) bytes."""
    target = max(min_total, 4 * l2)
    return max(1, min(max_sets, math.ceil(target / max(1, bytes_per_call))))


def cycling(fn, input_sets):
    """A no-argument closure calling fn(*set) on the next input set each time (cost: one next() call)."""
    sets = [tuple(s) for s in input_sets]
    if not sets:
        raise ValueError("input_sets must hold at least one set of arguments")
    if len(sets) == 1:
        (args,) = sets
        return lambda: fn(*args)
    it = itertools.cycle(sets)
    return lambda: fn(*next(it))


def time_ms(fn, input_sets=((),), *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn(*args), args cycling over `input_sets`.

    One call runs (and synchronises) before do_bench, so that compilation, autotuning and handle
    creation stay out of the numbers; do_bench then warms up for `warmup` ms and times calls for about
    `rep` ms, each between its own pair of CUDA events.
    """
    import torch
    from triton.testing import do_bench

    call = cycling(fn, input_sets)
    call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return float(do_bench(call, warmup=warmup, rep=rep, return_mode="median"))
