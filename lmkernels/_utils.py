"""Helpers shared by the ops: input checks and the choice between Triton kernel and reference."""

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors run the reference, unless the interpreter is on."""
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, t, *, dtypes=None, ndim=None, min_ndim=None, shape=None) -> None:
    """Raise TypeError/ValueError naming `name` when `t` is not a tensor of the expected kind."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_names(dtypes)}; got {str(t.dtype).removeprefix('torch.')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_same_device(**tensors) -> None:
    """All given tensors (None entries skipped) must live on one device."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; they must share a device")


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {t.stride()}")


def as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """View `t` as [rows, last_dim] without copying; rows may be strided, the last dim must not be."""
    check_unit_stride(name, t)
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as rows "
            f"without a copy; pass a contiguous tensor"
        ) from None


def check_index_range(name: str, t: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """Values of the index tensor `t` within [lo, hi): a data check, so for CPU tensors only (on CUDA it would
    cost a host sync); `what` says what the range is."""
    if t.device.type != "cpu" or t.numel() == 0:
        return
    t_lo, t_hi = torch.aminmax(t)
    if t_lo < lo or t_hi >= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}) ({what}), got values in [{t_lo}, {t_hi}]")


# Programmatic dependent launch (Hopper): kernels launched with it start while the kernel before them drains and
# wait for it (gdc_wait) before touching its outputs. False turns it off everywhere (to compare).
ENABLE_PDL = True
try:  # grid dependency control, for kernels that take a USE_PDL flag (triton ≥ 3.4)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: pdl_enabled() is False, USE_PDL never set
    gdc_launch_dependents = gdc_wait = None


def pdl_enabled(device) -> bool:
    """Whether to launch with PDL: a CUDA device of compute capability ≥ 9, a triton that exposes grid dependency
    control, not the interpreter (which has no inline assembly)."""
    if not ENABLE_PDL or gdc_wait is None or device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


_SM_COUNT = {}
_L2_BYTES = {}


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device (cached); the interpreter pretends to have 8."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


_DRAM_GBPS = {}


def dram_gbps_per_sm(device) -> float:
    """The device's peak DRAM bandwidth (GB/s, from its memory clock and bus width) per multiprocessor (cached): an
    H100 SXM's 3.35 TB/s on 132 SMs is 25.4, an H200's 4.8 TB/s 36.4. 0 for the interpreter, and where the driver
    does not report it (launch heuristics then take their default)."""
    if device.type != "cuda":
        return 0.0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DRAM_GBPS:
        try:
            from triton.testing import get_dram_gbps

            gbps = get_dram_gbps(index)
        except (ImportError, AttributeError, KeyError, RuntimeError):
            gbps = 0.0
        _DRAM_GBPS[index] = gbps / sm_count(device)
    return _DRAM_GBPS[index]


H100_L2_BYTES = 50 << 20


def l2_bytes(device) -> int:
    """L2 cache bytes of a CUDA device (cached; an H100's where torch does not report it); the interpreter
    pretends to have an H100's."""
    if device.type != "cuda":
        return H100_L2_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _L2_BYTES:
        props = torch.cuda.get_device_properties(index)
        _L2_BYTES[index] = int(getattr(props, "L2_cache_size", 0) or H100_L2_BYTES)
    return _L2_BYTES[index]


def check_block_tables(block_tables, seq_lens, page_size, num_pages):
    """seq_lens within the page table's capacity and the pages it uses within [0, num_pages): data checks,
    so for CPU tensors only (on CUDA they would cost a host sync). One vectorised test over the table."""
    if block_tables.device.type != "cpu" or seq_lens.numel() == 0:
        return
    lens = seq_lens.long()
    cap = block_tables.shape[1] * page_size
    if int(lens.min()) < 0 or int(lens.max()) > cap:
        raise ValueError(f"seq_lens must lie in [0, {cap}] (block_tables holds {block_tables.shape[1]} pages of "
                         f"{page_size} per sequence): the page table is too short, got seq_lens up to {int(lens.max())}")
    used = torch.arange(block_tables.shape[1])[None, :] < ((lens + page_size - 1) // page_size)[:, None]
    bad = (((block_tables < 0) | (block_tables >= num_pages)) & used).any(1)
    if bad.any():
        b = int(bad.nonzero()[0])
        raise ValueError(f"block_tables[{b}] refers to pages outside [0, {num_pages}): "
                         f"{block_tables[b, : -(-int(lens[b]) // page_size)].tolist()}")
