"""Timing: `triton.testing.do_bench` medians of CUDA-graph replays, over input sets rotated through a
working set larger than L2, so every call reads from HBM and host launch costs stay out of the figure.
"""

import itertools
import math

MIN_ROTATION_BYTES = 256 << 20  # at least this many bytes touched over one cycle of the input sets
MAX_SETS = 16
# do_bench zeroes a 256 MB buffer before each timed replay, which leaves L2 full of dirty lines; the first call
# after it pays for writing them back (9 µs of a 127 µs MLA decode, benchmarks/NOTES.md). A graph of at least
# this many calls spreads that over them, as back-to-back calls in a model would see it.
MIN_CALLS_PER_GRAPH = 4
# … and enough calls that a graph spans this much GPU time (at most MAX_CALLS_PER_GRAPH): each replay also pays the
# graph's launch, its first call's start with no call before it to overlap and its last call's tail, ~13 µs on the
# H200, which 4 calls of a 45 µs MLA decode counted as 3.3 µs a call (44.8 µs against a 41.5 µs period between
# back-to-back calls inside the graph, benchmarks/NOTES.md, issue 6, session aj)
MIN_GRAPH_MS = 0.5
MAX_CALLS_PER_GRAPH = 64
DEFAULT_L2 = 50 << 20  # H100; H200 has 60 MB


def l2_bytes() -> int:
    """L2 size of the current CUDA device (DEFAULT_L2 without one, or when torch does not report it)."""
    import torch

    from .._utils import l2_bytes as device_l2

    return device_l2(torch.device("cuda")) if torch.cuda.is_available() else DEFAULT_L2


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


def calls_per_graph(n_sets: int, call_ms: float) -> int:
    """Calls one timed graph holds: whole cycles of the n_sets input sets, at least MIN_CALLS_PER_GRAPH, and enough
    for MIN_GRAPH_MS of GPU time at call_ms a call (counting no more than MAX_CALLS_PER_GRAPH for that)."""
    want = max(MIN_CALLS_PER_GRAPH, min(MAX_CALLS_PER_GRAPH, math.ceil(MIN_GRAPH_MS / max(call_ms, 1e-6))))
    return n_sets * math.ceil(want / n_sets)


def time_ms(fn, input_sets=((),), *, warmup: int = 25, rep: int = 100, info: dict = None,
            cuda_graph: bool = True) -> float:
    """Median milliseconds of one fn(*args) on the GPU, args cycling over `input_sets`.

    The calls are replayed from a CUDA graph holding the input sets in turn (calls_per_graph: enough calls that
    a replay's own costs, its launch and do_bench's L2 flush, are spread thin, as over a model's back-to-back
    calls), so the figure is the GPU's time, not Python's: on the H100 machine a Triton launch alone costs ~50
    µs of host time, more than a norm over 4096×2048 takes on the GPU, and do_bench's L2 flush does not hide it
    (benchmarks/NOTES.md).
    The sets together exceed L2, so every call still reads from HBM. A function that cannot be captured
    is timed call by call instead, as is every call with cuda_graph=False; `info["method"]` records
    which way ("cuda_graph" or "eager: why").
    """
    import torch
    from triton.testing import do_bench

    sets = [tuple(s) for s in input_sets]
    call = cycling(fn, sets)
    for _ in range(len(sets)):  # compile, autotune, allocate outside the timing
        call()
    torch.cuda.synchronize()
    method = "eager: asked for"
    if cuda_graph:
        try:
            n_calls = calls_per_graph(len(sets), float("inf"))
            graph = _capture(call, n_calls)
            guess = float(do_bench(graph.replay, warmup=5, rep=20, return_mode="median")) / n_calls
            if calls_per_graph(len(sets), guess) > n_calls:
                n_calls = calls_per_graph(len(sets), guess)
                del graph
                graph = _capture(call, n_calls)
            ms = float(do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")) / n_calls
            method = "cuda_graph"
        except Exception as e:  # e.g. a host sync inside fn
            torch.cuda.synchronize()
            method = f"eager: capture failed ({type(e).__name__})"
    if method != "cuda_graph":
        ms = float(do_bench(call, warmup=warmup, rep=rep, return_mode="median"))
    if info is not None:
        info["method"] = method
    return ms


def _capture(call, n_calls):
    """A CUDA graph of n_calls calls (one per input set), warmed up on a side stream as torch recommends."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n_calls):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n_calls):
            call()
    return graph
