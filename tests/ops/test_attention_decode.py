"""Paged KV cache: write_kv_cache and attention_decode (split-KV + merge) vs the float64 reference.

Kernels run in the Triton interpreter with fp16 (bf16 dots are garbage there); most cases use 16-key
tiles (`small_tiles`) so that a ≤ 80-token context spans several tiles, pages and splits.
"""

import pytest
import torch

from lmkernels.ops.attention import attention_decode, attention_prefill, kernels, reference, write_kv_cache
from tests.helpers import TOL, compile_in_fresh_process, rel_err

DT = torch.float16
# FP8 e4m3 keeps 3 mantissa bits: each cached element is off by up to 2^-4 relative (RMS ~2%). Against
# attention over the unquantised cache the output's relative error stays below this (measured 3.2–3.5e-2
# with unit-variance k, v and scores).
FP8_TOL = 5e-2


@pytest.fixture
def small_tiles(monkeypatch):
    def cfg(dqk, dv, rows, **kw):
        return dict(BLOCK_M=max(16, triton_next_pow2(rows)), BLOCK_N=16, num_warps=4, num_stages=1)

    monkeypatch.setattr(kernels, "decode_config", cfg)


def triton_next_pow2(n):
    return 1 << (max(1, n) - 1).bit_length()


@pytest.fixture
def poison(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))


def paged(lens, hk, d=64, dv=None, page_size=16, spare_pages=3, dtype=DT):
    """Caches with shuffled pages (NaN in every unused slot) and the block tables that address them."""
    dv = dv or d
    pages_per_seq = [-(-n // page_size) for n in lens]
    width = max(pages_per_seq + [1]) + 1  # one unused column: tables are wider than needed
    num_pages = sum(pages_per_seq) + spare_pages
    perm = torch.randperm(num_pages)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per_seq):
        tables[b, :n] = perm[at:at + n]
        at += n
    k_cache = torch.full((num_pages, page_size, hk, d), float("nan"), dtype=dtype)
    v_cache = torch.full((num_pages, page_size, hk, dv), float("nan"), dtype=dtype)
    for b, n in enumerate(lens):
        for t in range(n):
            page, row = tables[b, t // page_size], t % page_size
            k_cache[page, row] = torch.randn(hk, d, dtype=dtype)
            v_cache[page, row] = torch.randn(hk, dv, dtype=dtype)
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def check(o, lse, ro, rl, tol=TOL[DT]):
    assert o.shape == ro.shape and lse.shape == rl.shape and lse.dtype == torch.float32
    assert rel_err(o, ro) < tol
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert torch.isfinite(lse[fin]).all() and rel_err(lse[fin], rl[fin]) < 1e-5
    assert (o.double()[torch.isneginf(rl)] == 0).all()


LENS = [37, 1, 70, 16, 0]  # off tile and page sizes, a single token, an empty (padded) slot


@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("q_per_seq", [1, 3])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(small_tiles, poison, hq, hk, q_per_seq, num_splits):
    k_cache, v_cache, tables, lens = paged(LENS, hk)
    q = torch.randn(len(LENS), q_per_seq, hq, 64, dtype=DT)
    o, lse = attention_decode(q, k_cache, v_cache, tables, lens, num_splits=num_splits, return_lse=True)
    ro, rl = reference.attention_decode(q.double(), k_cache, v_cache, tables, lens)
    check(o, lse, ro, rl)


@pytest.mark.parametrize("window,softcap", [((20, -1), 0.0), ((-1, -1), 5.0), ((9, 0), 3.0)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_window_softcap(small_tiles, poison, window, softcap, num_splits):
    k_cache, v_cache, tables, lens = paged(LENS, 1, page_size=32)
    q = torch.randn(len(LENS), 2, 4, 64, dtype=DT)
    o, lse = attention_decode(q, k_cache, v_cache, tables, lens, window=window, softcap=softcap,
                              num_splits=num_splits, return_lse=True)
    ro, rl = reference.attention_decode(q.double(), k_cache, v_cache, tables, lens, window=window, softcap=softcap)
    check(o, lse, ro, rl)


@pytest.mark.parametrize("d,dv,page_size", [(128, 128, 64), (256, 256, 16), (192, 128, 32)])
def test_decode_head_dims_production_tiles(poison, d, dv, page_size):
    """The heuristic's tiles (64 keys, 32 at dim 256) and splits; 3-D q (one new token)."""
    k_cache, v_cache, tables, lens = paged([70, 5], 1, d, dv, page_size)
    q = torch.randn(2, 4, d, dtype=DT)
    o, lse = attention_decode(q, k_cache, v_cache, tables, lens, return_lse=True)
    ro, rl = reference.attention_decode(q[:, None].double(), k_cache, v_cache, tables, lens)
    check(o, lse, ro[:, 0], rl[:, 0])


def test_split_and_unsplit_agree(small_tiles):
    """1 split, some, and more splits than tiles (the extra programs exit) give the same answer."""
    k_cache, v_cache, tables, lens = paged([70, 33, 2], 2, page_size=16)
    q = torch.randn(3, 2, 8, 64, dtype=DT)
    base, base_lse = attention_decode(q, k_cache, v_cache, tables, lens, num_splits=1, return_lse=True)
    for ns in (2, 5, 16):
        o, lse = attention_decode(q, k_cache, v_cache, tables, lens, num_splits=ns, return_lse=True)
        assert rel_err(o, base) < 2e-3 and rel_err(lse, base_lse) < 1e-6


def test_all_empty_and_short_sequences(small_tiles, poison):
    """A padded batch (length 0) and sequences shorter than q_per_seq: o = 0, lse = −inf for keyless queries."""
    k_cache, v_cache, tables, lens = paged([0, 2, 0], 1)
    q = torch.randn(3, 4, 2, 64, dtype=DT)
    for ns in (1, 3):
        o, lse = attention_decode(q, k_cache, v_cache, tables, lens, num_splits=ns, return_lse=True)
        ro, rl = reference.attention_decode(q.double(), k_cache, v_cache, tables, lens)
        check(o, lse, ro, rl)
        assert (o[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, :2]).all()


def test_fp8_cache(small_tiles, poison):
    """FP8 e4m3 caches written by write_kv_cache: exact against the dequantised reference, and within
    FP8_TOL of attention over the unquantised values."""
    lens = [45, 7, 0]
    k_hi, v_hi, tables, seq_lens = paged(lens, 2, page_size=16)
    k_scale = torch.tensor([0.02, 0.05])
    v_scale = torch.tensor([0.03])  # one scalar for all heads
    k8 = torch.zeros(k_hi.shape, dtype=torch.float8_e4m3fn)
    v8 = torch.zeros(v_hi.shape, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([int(tables[b, t // 16]) * 16 + t % 16 for b, n in enumerate(lens) for t in range(n)])
    k_tok, v_tok = k_hi.flatten(0, 1)[slots], v_hi.flatten(0, 1)[slots]
    write_kv_cache(k_tok, v_tok, k8, v8, slots, k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(3, 2, 8, 64, dtype=DT)
    for ns, window, softcap in ((1, (-1, -1), 0.0), (3, (-1, -1), 0.0), (3, (20, -1), 4.0)):
        kw = dict(window=window, softcap=softcap)
        o, lse = attention_decode(q, k8, v8, tables, seq_lens, num_splits=ns, k_scale=k_scale, v_scale=v_scale,
                                  return_lse=True, **kw)
        ro, rl = reference.attention_decode(q.double(), k8, v8, tables, seq_lens, k_scale=k_scale, v_scale=v_scale,
                                            **kw)
        check(o, lse, ro, rl)
        exact, _ = reference.attention_decode(q.double(), k_hi, v_hi, tables, seq_lens, **kw)
        assert rel_err(o, exact) < FP8_TOL


@pytest.mark.parametrize("hq,hk,q_per_seq", [(4, 1, 1), (8, 2, 4)])
def test_decode_after_prefill_equals_prefill(small_tiles, monkeypatch, hq, hk, q_per_seq):
    """Prefill whole sequences; write their k/v into a shuffled paged cache; decoding the last q_per_seq
    tokens over the cache gives what the prefill gave for those tokens."""
    monkeypatch.setattr(kernels, "prefill_config",
                        lambda dqk, dv, m: dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    lens = [23, 64, 5]
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, h, 64, dtype=DT) for h in (hq, hk, hk))
    o_prefill = attention_prefill(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, window=(30, -1))

    page_size, num_pages = 16, 16
    perm = torch.randperm(num_pages).to(torch.int32)
    tables = perm[:12].view(3, 4)
    slots = torch.cat([tables[b, torch.arange(n) // page_size].long() * page_size + torch.arange(n) % page_size
                       for b, n in enumerate(lens)])
    k_cache = torch.full((num_pages, page_size, hk, 64), float("nan"), dtype=DT)
    v_cache = torch.full_like(k_cache, float("nan"))
    write_kv_cache(k, v, k_cache, v_cache, slots)
    last = torch.cat([torch.arange(int(cu[b + 1]) - q_per_seq, int(cu[b + 1])) for b in range(3)])
    o = attention_decode(q[last].view(3, q_per_seq, hq, 64), k_cache, v_cache, tables,
                         torch.tensor(lens, dtype=torch.int32), window=(30, -1), num_splits=2)
    assert rel_err(o.view(-1, hq, 64), o_prefill[last]) < TOL[DT]


def test_launch_does_not_depend_on_lengths(monkeypatch):
    """CUDA-graph safety: for one batch shape the grids and compile-time parameters are the same whatever
    seq_lens holds, for the persistent schedule (the default) and for split-KV with its merge."""
    launches = []
    for fn in (kernels._decode_kernel, kernels._decode_merge_kernel, kernels._decode_persistent_kernel):
        real = fn.run
        monkeypatch.setattr(fn, "run", lambda *a, _real=real, _fn=fn, **kw: (
            launches.append((_fn.fn.__name__, kw["grid"],
                             {k: v for k, v in kw.items() if k.isupper() or k.startswith("num_")})),
            _real(*a, **kw))[1])
    monkeypatch.setattr(kernels, "sm_count", lambda device: 3)
    k_cache, v_cache, tables, _ = paged([300, 300], 2, page_size=16, spare_pages=0)
    tables = torch.cat([tables, torch.zeros(2, 64 - tables.shape[1], dtype=torch.int32)], 1)  # room for 1024
    q = torch.randn(2, 1, 4, 64, dtype=DT)
    for splits in (None, 4):
        seen = []
        for lens in ([300, 300], [1, 257], [0, 0]):
            launches.clear()
            attention_decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), num_splits=splits)
            seen.append(list(launches))
        assert seen[0] == seen[1] == seen[2]
        if splits is None:
            (name, grid, _), = seen[0]
            assert name == "_decode_persistent_kernel" and grid == (2 * 3,)  # PROGRAMS_PER_SM × SMs
            launches.clear()  # one sequence: split-KV by the heuristic (nothing to balance)
            attention_decode(q[:1], k_cache, v_cache, tables[:1], torch.tensor([300], dtype=torch.int32))
            assert [x[0] for x in launches] == ["_decode_kernel", "_decode_merge_kernel"]
        else:
            assert [x[0] for x in seen[0]] == ["_decode_kernel", "_decode_merge_kernel"]
            assert seen[0][0][2]["NUM_SPLITS"] == 4


@pytest.mark.parametrize("programs", [1, 2, 5, 13, 64])
@pytest.mark.parametrize("lens,hq,hk,q_per_seq", [
    ([37, 1, 70, 16, 0], 4, 1, 1),  # ragged, a single token, an empty slot
    ([90, 3, 41], 8, 2, 3),  # 12 rows per kv head in one block
    ([64, 17], 8, 1, 3),  # 24 rows: two row blocks of 16 per kv head
    ([0, 0, 0], 2, 1, 2),  # nothing to read: o = 0, lse = −inf everywhere
])
def test_persistent_schedule(monkeypatch, poison, programs, lens, hq, hk, q_per_seq):
    """Stream-K decode on fixed grids: segments split over many programs (merged by the last one to arrive)
    and programs covering many segments; the counters are back to zero after every launch."""
    monkeypatch.setattr(kernels, "decode_config", lambda dqk, dv, rows, **kw: dict(
        BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, PROGRAMS=programs))
    k_cache, v_cache, tables, seq_lens = paged(lens, hk)
    q = torch.randn(len(lens), q_per_seq, hq, 64, dtype=DT)
    o, lse = attention_decode(q, k_cache, v_cache, tables, seq_lens, return_lse=True)
    ro, rl = reference.attention_decode(q.double(), k_cache, v_cache, tables, seq_lens)
    check(o, lse, ro, rl)
    assert not kernels._COUNTERS[("cpu", 0)].any()
    o2 = attention_decode(q, k_cache, v_cache, tables, seq_lens)  # no lse; same counters reused
    assert rel_err(o2, ro) < TOL[DT]


def test_persistent_window_softcap_fp8(monkeypatch):
    monkeypatch.setattr(kernels, "decode_config", lambda dqk, dv, rows, **kw: dict(
        BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, PROGRAMS=7))
    lens = [75, 6, 33]
    k_hi, v_hi, tables, seq_lens = paged(lens, 2, page_size=16)
    q = torch.randn(3, 2, 8, 64, dtype=DT)
    o, lse = attention_decode(q, k_hi, v_hi, tables, seq_lens, window=(20, -1), softcap=4.0, return_lse=True)
    ro, rl = reference.attention_decode(q.double(), k_hi, v_hi, tables, seq_lens, window=(20, -1), softcap=4.0)
    check(o, lse, ro, rl)
    ks, vs = torch.tensor([0.02, 0.05]), torch.tensor([0.03])
    k8, v8 = reference.quantize_fp8(k_hi, ks), reference.quantize_fp8(v_hi, vs)
    o, lse = attention_decode(q, k8, v8, tables, seq_lens, k_scale=ks, v_scale=vs, return_lse=True)
    ro, rl = reference.attention_decode(q.double(), k8, v8, tables, seq_lens, k_scale=ks, v_scale=vs)
    check(o, lse, ro, rl)


def test_num_splits_heuristic():
    h100 = 132
    assert kernels.decode_num_splits(1, 8, 1, 8192, h100) == 32  # B=1, 8k: fill the GPU, 256 keys per split
    assert kernels.decode_num_splits(32, 8, 1, 4096, h100) == 8  # 512-key chunks
    assert kernels.decode_num_splits(64, 8, 1, 16384, h100) == 32
    assert kernels.decode_num_splits(32, 8, 1, 32768, h100) == 33  # a 32k sequence alone spreads over 264 programs
    assert kernels.decode_num_splits(1, 8, 1, 512, h100) == 8  # short context: 8 splits of 64 keys
    assert kernels.decode_num_splits(1, 8, 1, 2048, h100) == 8
    assert kernels.decode_num_splits(1, 8, 1, 300, h100) == 4
    assert kernels.decode_num_splits(1, 8, 1, 100, h100) == 1
    assert kernels.decode_num_splits(0, 8, 1, 4096, h100) >= 1
    assert kernels.decode_chunk(32768, 33, 64) == 1024 and kernels.decode_chunk(4096, 1, 64) == 0


def test_fixed_chunks_and_a_low_context_bound(small_tiles, poison):
    """Chunks come from max_seqlen_k, so short sequences use fewer splits than long ones; a bound below the
    real lengths makes the chunks grow (no key is dropped)."""
    k_cache, v_cache, tables, lens = paged([70, 9, 33], 2, page_size=16)
    q = torch.randn(3, 1, 4, 64, dtype=DT)
    ro, rl = reference.attention_decode(q.double(), k_cache, v_cache, tables, lens)
    for bound in (80, 16, 1):
        o, lse = attention_decode(q, k_cache, v_cache, tables, lens, num_splits=5, max_seqlen_k=bound,
                                  return_lse=True)
        check(o, lse, ro, rl)


@pytest.mark.parametrize("length", [1, 37, 200])
def test_one_sequence_splits_by_its_length(small_tiles, poison, length):
    """One sequence in a launch sized for a far larger capacity (a CUDA graph's): the chunks follow the actual
    length on the device (200 keys: 7 splits of 32), and every key is still attended once."""
    k_cache, v_cache, tables, lens = paged([length], 2, page_size=16)
    q = torch.randn(1, 1, 4, 64, dtype=DT)
    ro, rl = reference.attention_decode(q.double(), k_cache, v_cache, tables, lens)
    o, lse = attention_decode(q, k_cache, v_cache, tables, lens, max_seqlen_k=4096, return_lse=True)
    check(o, lse, ro, rl)


def test_write_kv_cache_exact_and_skips_padding(poison):
    k_cache = torch.full((6, 16, 2, 64), 7.0, dtype=DT)
    v_cache = torch.full((6, 16, 2, 128), 7.0, dtype=DT)
    k, v = torch.randn(9, 2, 64, dtype=DT), torch.randn(9, 2, 128, dtype=DT)
    slots = torch.randperm(96)[:9]
    slots[[2, 5]] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(k, v, want_k, want_v, slots)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert (k_cache == 7).sum() == (6 * 16 - 7) * 2 * 64  # nothing else touched
    # strided k/v (views of a fused projection) and int32 slots
    kv = torch.randn(9, 4, 64, dtype=DT)
    write_kv_cache(kv[:, :2], kv[:, 2:], k_cache, k_cache.clone(), slots.int())
    reference.write_kv_cache(kv[:, :2], kv[:, 2:], want_k, want_k.clone(), slots)
    assert torch.equal(k_cache, want_k)


def test_write_kv_cache_fp8_rounding():
    """Quantisation to e4m3 rounds to nearest-even and saturates at ±448, like torch's cast."""
    k = torch.randn(40, 2, 64, dtype=torch.float32) * torch.logspace(-4, 3, 40)[:, None, None]
    v = torch.randn(40, 2, 64, dtype=torch.float32)
    k_cache = torch.zeros(3, 16, 2, 64, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    scale = torch.tensor([0.5, 2.0])
    slots = torch.arange(40)
    write_kv_cache(k, v, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.write_kv_cache(k, v, want_k, want_v, slots, scale, scale)
    assert torch.equal(k_cache.float(), want_k.float()) and torch.equal(v_cache.float(), want_v.float())
    assert k_cache.float().abs().max() == 448


def test_write_kv_cache_fp8_bit_exact_signed_zero_and_subnormals():
    """Bit for bit what torch's cast gives, signs of zero included: tiny negatives round to −0 (0x80), values
    between e4m3 subnormals (step 2^-9) round to nearest-even, the normal range too."""
    sub = torch.tensor([-1e-7, -0.0009, 0.0009, -0.00098, 0.00098, 2.0**-10, -(2.0**-10), 3 * 2.0**-10,
                        -3 * 2.0**-10, 0.0156, -0.0155, 0.0, -0.0, 1e-30, -1e-30, 448.0, -500.0, 1.0625, -1.1875])
    k = sub.repeat(64 * 2 // sub.numel() + 1)[:128].view(2, 1, 64)
    k_cache = torch.zeros(1, 16, 1, 64, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    one = torch.ones(1)
    write_kv_cache(k, k, k_cache, v_cache, torch.tensor([3, 9]), k_scale=one, v_scale=one)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.write_kv_cache(k, k, want_k, want_v, torch.tensor([3, 9]), one, one)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert (k_cache.view(torch.uint8) == 0x80).any()  # −0 was written as −0


def test_empty_inputs():
    k_cache, v_cache, tables, lens = paged([5], 1)
    write_kv_cache(torch.randn(0, 1, 64, dtype=DT), torch.randn(0, 1, 64, dtype=DT), k_cache, v_cache,
                   torch.zeros(0, dtype=torch.int64))
    o = attention_decode(torch.randn(0, 1, 2, 64, dtype=DT), k_cache, v_cache, tables[:0], lens[:0])
    assert o.shape == (0, 1, 2, 64)


def _decode_args():
    k_cache, v_cache, tables, lens = paged([20, 5], 2, page_size=16)
    return torch.randn(2, 1, 4, 64, dtype=DT), k_cache, v_cache, tables, lens


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (lambda a: {**a, "q": a["q"].float()}, TypeError, "q must have dtype"),
        (lambda a: {**a, "q": a["q"][:, :, :3]}, ValueError, "multiple of the heads of k_cache"),
        (lambda a: {**a, "v_cache": a["v_cache"][:, :, :1]}, ValueError, "v_cache must have as many heads"),
        (lambda a: {**a, "k_cache": a["k_cache"].bfloat16()}, TypeError, "k_cache must have dtype"),
        (lambda a: {**a, "v_cache": a["v_cache"].bfloat16()}, TypeError, "v_cache must have dtype"),
        (lambda a: {**a, "q": a["q"][..., :32], "k_cache": a["k_cache"][..., :32]}, ValueError,
         "head dim of q and k must be one of"),
        (lambda a: {**a, "k_cache": a["k_cache"][..., :32]}, ValueError, "k_cache must have the head dim"),
        (lambda a: {**a, "block_tables": a["block_tables"].float()}, TypeError, "block_tables must have dtype"),
        (lambda a: {**a, "block_tables": a["block_tables"][:1]}, ValueError, "one row per sequence"),
        (lambda a: {**a, "block_tables": a["block_tables"][:, :1]}, ValueError, "page table is too short"),
        (lambda a: {**a, "block_tables": a["block_tables"] + 100}, ValueError, "pages outside"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, ValueError, "seq_lens must have shape"),
        (lambda a: {**a, "seq_lens": a["seq_lens"].float()}, TypeError, "seq_lens must have dtype"),
        (lambda a: {**a, "num_splits": 0}, ValueError, "num_splits"),
        (lambda a: {**a, "window": (4, 2)}, ValueError, "window right"),
        (lambda a: {**a, "k_scale": torch.ones(2), "v_scale": torch.ones(2)}, ValueError, "FP8 caches only"),
        (lambda a: {**a, "k_cache": a["k_cache"].to(torch.float8_e4m3fn),
                    "v_cache": a["v_cache"].to(torch.float8_e4m3fn)}, ValueError, "needs k_scale and v_scale"),
        (lambda a: {**a, "k_cache": a["k_cache"].to(torch.float8_e4m3fn),
                    "v_cache": a["v_cache"].to(torch.float8_e4m3fn), "k_scale": torch.ones(3),
                    "v_scale": torch.ones(2)}, ValueError, "k_scale must hold one float32 per kv head"),
        (lambda a: {**a, "q": a["q"][None]}, ValueError, r"q must be \[batch, q_per_seq, heads, dim\]"),
    ],
)
def test_decode_bad_inputs(change, exc, match):
    q, k_cache, v_cache, tables, lens = _decode_args()
    args = change(dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=lens))
    with pytest.raises(exc, match=match):
        attention_decode(**args)


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (lambda a: {**a, "v": a["v"][:3]}, ValueError, "v must have k's tokens"),
        (lambda a: {**a, "k_cache": a["k_cache"][..., :1, :]}, ValueError, "k_cache must be"),
        (lambda a: {**a, "v_cache": a["v_cache"][:2]}, ValueError, "v_cache must be"),
        (lambda a: {**a, "k_cache": a["k_cache"].float()}, TypeError, "k_cache must have dtype"),
        (lambda a: {**a, "slot_mapping": a["slot_mapping"][:2]}, ValueError, "slot_mapping must have shape"),
        (lambda a: {**a, "slot_mapping": a["slot_mapping"] + 1000}, ValueError, "slot_mapping must lie in"),
        (lambda a: {**a, "slot_mapping": a["slot_mapping"] - 10}, ValueError, "slot_mapping must lie in"),
        (lambda a: {**a, "k": a["k"].bfloat16()}, TypeError, "v must have dtype"),
    ],
)
def test_write_kv_bad_inputs(change, exc, match):
    args = dict(k=torch.randn(4, 2, 64, dtype=DT), v=torch.randn(4, 2, 64, dtype=DT),
                k_cache=torch.zeros(3, 16, 2, 64, dtype=DT), v_cache=torch.zeros(3, 16, 2, 64, dtype=DT),
                slot_mapping=torch.tensor([0, 5, -1, 47]))
    with pytest.raises(exc, match=match):
        write_kv_cache(**change(args))


def test_torch_compile_fullgraph(small_tiles):
    """One decode step — cache write, paged attention with LSE — traces as one graph and matches eager."""
    k_cache0, v_cache0, tables, lens = paged([20, 9], 2, page_size=16, spare_pages=0)

    def step(q, k_new, v_new, k_cache, v_cache, slots, lens):
        write_kv_cache(k_new, v_new, k_cache, v_cache, slots)
        return attention_decode(q, k_cache, v_cache, tables, lens, num_splits=2, return_lse=True)

    q = torch.randn(2, 4, 64, dtype=DT)
    k_new, v_new = torch.randn(2, 2, 64, dtype=DT), torch.randn(2, 2, 64, dtype=DT)
    lens1 = lens + 1
    slots = torch.stack([tables[b, int(n) // 16].long() * 16 + int(n) % 16 for b, n in enumerate(lens)])
    eager = step(q, k_new, v_new, k_cache0.clone(), v_cache0.clone(), slots, lens1)
    kc, vc = k_cache0.clone(), v_cache0.clone()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_new, v_new, kc, vc, slots, lens1)
    torch.testing.assert_close(compiled, eager)
    ro, _ = reference.attention_decode(q[:, None].double(), kc, vc, tables, lens1)
    assert rel_err(eager[0], ro[:, 0]) < TOL[DT]


def test_split_merge_sums_inside_each_thread():
    """The split-KV decode's merge kernel at 32 splits of d128, built for sm_90 as decode launches it, sums a row's
    splits inside each thread (one warp: no shared memory beyond a few hundred bytes); at block_s · dv / 1024 = 4 warps
    the sum crossed warps through 2 KB and one sequence at 8k took 4% longer (H200, NOTES, session al)."""
    assert kernels.decode_merge_warps(32, 128) == 1 and kernels.decode_merge_warps(64, 128) == 2
    r = compile_in_fresh_process("lmkernels.ops.attention.compile_check.decode_merge(32, 128)")
    assert r["smem_kb"] == 0 and r["stack"] == 0, r
