"""attention_prefill: the Triton kernel (interpreter, fp16: bf16 dots are garbage there) vs the float64 reference.

Most cases run 16 × 16 tiles (the `small_tiles` fixture) so that sequences of ≤ 80 tokens cross many
query and key tiles: mask-free middles, diagonal tiles, skipped tiles and window edges all occur. A few
run the production heuristic (128 × 64 / 128 × 128 tiles) as the GPU would.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from lmkernels.ops.attention import attention_prefill, kernels, prefill_ws, reference
from tests.helpers import TOL, compile_in_fresh_process, rel_err

DT = torch.float16


@pytest.fixture
def small_tiles(monkeypatch):
    def cfg(dqk, dv, max_seqlen_q):
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)

    monkeypatch.setattr(kernels, "prefill_config", cfg)


@pytest.fixture(params=[False, True], ids=["ptr", "tma"])
def tma(request, monkeypatch):
    """Both load paths: pointer tiles, and per-sequence TMA tensor descriptors (kernels.PREFILL_TMA)."""
    monkeypatch.setattr(kernels, "PREFILL_TMA", request.param)
    launched = []
    real = kernels._prefill_kernel.run
    monkeypatch.setattr(kernels._prefill_kernel, "run",
                        lambda *a, **kw: (launched.append(kw["TMA"]), real(*a, **kw))[1])
    yield request.param
    assert launched and all(t == request.param for t in launched)  # the path asked for is the path taken


@pytest.fixture
def poison(monkeypatch):
    """Outputs start as NaN, so an element the kernel never writes fails."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))


def packed(lens_q, lens_k, hq, hk, dqk=64, dv=None, dtype=DT):
    dv = dv or dqk
    cu_q = torch.tensor([0, *lens_q]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, dqk, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), hk, dqk, dtype=dtype)
    v = torch.randn(int(cu_k[-1]), hk, dv, dtype=dtype)
    return q, k, v, cu_q, cu_k


def check(o, lse, ro, rl, tol=TOL[DT]):
    """o against the float64 reference; lse finite where the reference is, −inf where it is −inf."""
    assert o.shape == ro.shape and o.dtype == DT
    assert rel_err(o, ro) < tol
    assert lse.dtype == torch.float32 and lse.shape == rl.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert torch.isfinite(lse[fin]).all()
    assert rel_err(lse[fin], rl[fin]) < 1e-5
    assert (o.double()[torch.isneginf(rl).transpose(-1, -2)] == 0).all()  # no key: o = 0


# ragged: 0 and 1 tokens, lengths off every tile size, q_len < k_len (a cached prefix), q_len > k_len, no keys
LENS_Q = [5, 37, 1, 0, 70, 20, 4]
LENS_K = [5, 50, 17, 3, 70, 9, 0]
MASKS = [  # (causal, window, softcap)
    (True, (-1, -1), 0.0),
    (False, (-1, -1), 0.0),
    (True, (9, -1), 0.0),
    (True, (20, 0), 30.0),
    (False, (7, 5), 0.0),
    (False, (-1, 3), 2.0),
]


@pytest.mark.parametrize("causal,window,softcap", MASKS)
@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 1), (8, 1)])  # GQA ratios 1, 4, 8
def test_varlen(small_tiles, tma, poison, causal, window, softcap, hq, hk):
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, hq, hk)
    o, lse = attention_prefill(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               max_seqlen_q=max(LENS_Q), window=window, softcap=softcap, return_lse=True)
    ro, rl = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal,
                                        window=window, softcap=softcap)
    check(o, lse, ro, rl)


@pytest.mark.parametrize("sq,sk", [(33, 33), (21, 47), (40, 17)])
@pytest.mark.parametrize("causal", [True, False])
def test_dense(small_tiles, tma, poison, sq, sk, causal):
    q = torch.randn(2, sq, 4, 64, dtype=DT)
    k, v = torch.randn(2, sk, 2, 64, dtype=DT), torch.randn(2, sk, 2, 64, dtype=DT)
    o, lse = attention_prefill(q, k, v, causal=causal, return_lse=True)
    ro, rl = reference.attention_dense(q.double(), k.double(), v.double(), causal=causal)
    check(o, lse, ro, rl)


@pytest.mark.parametrize("dqk,dv", [(96, 96), (128, 128), (256, 256), (192, 128)])
def test_head_dims(tma, poison, dqk, dv):
    """The larger head dims with the production tile heuristic (q/k 96 and 192 scored as 64 + 32 and 128 + 64)."""
    q, k, v, cu_q, cu_k = packed([19, 1], [30, 6], 2, 1, dqk, dv)
    o, lse = attention_prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    ro, rl = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True)
    assert o.shape == (q.shape[0], 2, dv)
    check(o, lse, ro, rl)


def test_head_dim_blocks():
    """A q/k head dim that is the sum of two powers of 2 is two blocks (scored as two dots), any other is padded."""
    dims = (64, 96, 128, 192, 256, 80, 72)
    assert [kernels.head_dim_blocks(d) for d in dims] == [(64, 0), (64, 32), (128, 0), (128, 64), (256, 0), (64, 16),
                                                         (128, 0)]


@pytest.mark.skipif(not prefill_ws.triton.__version__.startswith(prefill_ws.TRITON_VERSIONS),
                    reason="the Gluon kernel runs only on the triton it was checked with")
def test_warp_specialised_prefill_compiles_for_hopper():
    """The Gluon prefill has no interpreter path (the GPU check, `lmkernels check`, runs it against the reference
    with the Triton kernel's cases): here it must at least build for sm_90 as designed, in a fresh process (Gluon
    compiles through triton.language, which the interpreter tests patch here). Per consumer warpgroup three sites
    of score wgmma (tile 0, the unmasked and the masked loop: dqk / 16 instructions each) and three of P · V (the
    two loops and the last tile: BLOCK_N / 16); one TMA message per 64 columns (K, V, and Q for each warpgroup but
    for its high part at 192 = 128 + 64, which the warpgroup loads into registers); no mma.sync, no spills, within
    one SM's shared memory. Two and three warpgroups."""
    C = "lmkernels.ops.attention.compile_check"
    shapes = [(192, 128, "bf16", True, True), (128, 128, "fp16", False, False), (64, 64, "bf16", True, True),
              (256, 128, "bf16", True, True)]
    results = compile_in_fresh_process("[" + ", ".join(f"{C}.prefill_ws{a}" for a in shapes) + "]")
    for (dqk, dv, *_), r in zip(shapes, results):
        wgs, block_n, _ = prefill_ws.config(dqk, dv)
        q_smem = kernels.head_dim_blocks(dqk)[0]
        assert r["wgmma"] == wgs * 3 * (dqk + block_n) // 16 and r["mma"] == 0, r
        assert r["tma"] == wgs * q_smem // 64 + dqk // 64 + dv // 64 and r["stack"] == 0 and r["smem_kb"] <= 227, r


def test_warp_specialised_prefill_chosen_on_hopper_only():
    """The Gluon kernel's warpgroups and tiles (three × 4 stages where they fit, 192/128 included with q's high part
    in registers, else two × 4, else two × 2; 64-key tiles, 128 at d64); on the CPU (and under the interpreter, and
    with a config, paged or FP8 keys) the Triton kernel runs."""
    assert [prefill_ws.config(*d) for d in ((64, 64), (128, 128), (192, 128), (256, 128))] == [
        (3, 128, 4), (3, 64, 4), (3, 64, 4), (2, 64, 2)]
    q, k, v, *_ = packed([200], [200], 2, 1, 128)
    assert not prefill_ws.supported(q, k, v)
    assert kernels.prefill_path(q, k, v, 200).startswith("Triton 128x128")


@pytest.mark.parametrize("m_band", [2, 3, 100])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 3)])
def test_launch_bands(monkeypatch, tma, poison, m_band, hq, hk):
    """The launch order in bands of M_BAND query blocks, kv heads grouped within a band (where keys and values
    outgrow L2): every (head, block) program runs once, with bands that do not divide the 5 query blocks and a
    band longer than all of them; a GQA group of 2."""
    monkeypatch.setattr(kernels, "prefill_config", lambda dqk, dv, max_seqlen_q: dict(
        BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, M_BAND=m_band))
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, hq, hk)
    o, lse = attention_prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(LENS_Q),
                               return_lse=True)
    ro, rl = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True)
    check(o, lse, ro, rl)


def test_band_rule(monkeypatch):
    """Bands where fewer than PREFILL_KV_SHARE programs of a kv head run at once (SMs / kv heads) and the keys and
    values outgrow half of L2 (the interpreter's: 50 MB), else one block."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert kernels.prefill_m_band(128, 8192, 192 + 128, 2, cpu) == kernels.PREFILL_M_BAND > 1  # 671 MB, MHA
    assert kernels.prefill_m_band(16, 8192, 192 + 128, 2, cpu) == kernels.PREFILL_M_BAND  # 84 MB
    assert kernels.prefill_m_band(32, 2048, 256, 2, cpu) == kernels.PREFILL_M_BAND  # 34 MB
    assert kernels.prefill_m_band(32, 1024, 256, 2, cpu) == 1  # 17 MB: in L2
    assert kernels.prefill_m_band(8, 32768, 256, 2, cpu) == 1  # GQA 32/8: 16 programs share a kv head


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (24, 24))])
def test_production_tiles(tma, poison, causal, window):
    """The GPU's 128-query × 64-key tiles (head dim 128) over sequences longer than one key tile."""
    q, k, v, cu_q, cu_k = packed([80, 3], [80, 70], 2, 1, 128)
    o, lse = attention_prefill(q, k, v, causal=causal, window=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               return_lse=True)
    ro, rl = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal,
                                        window=window)
    check(o, lse, ro, rl)


def test_fused_qkv_views_and_scale(small_tiles):
    """q, k, v as strided views of one [T, Hq + 2·Hk, D] projection; an explicit scale; no LSE asked."""
    qkv = torch.randn(45, 4 + 2 + 2, 64, dtype=DT)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    cu = torch.tensor([0, 12, 45], dtype=torch.int64)
    o = attention_prefill(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, scale=0.3)
    ro, _ = reference.attention_varlen(q.double(), k.double(), v.double(), cu, cu, causal=True, scale=0.3)
    assert rel_err(o, ro) < TOL[DT]


def test_misaligned_views_fall_back_to_pointers(small_tiles, monkeypatch):
    """TMA descriptors need 16-byte aligned bases and strides: an odd view quietly takes the pointer path."""
    monkeypatch.setattr(kernels, "PREFILL_TMA", True)
    launched = []
    real = kernels._prefill_kernel.run
    monkeypatch.setattr(kernels._prefill_kernel, "run",
                        lambda *a, **kw: (launched.append(kw["TMA"]), real(*a, **kw))[1])
    buf = torch.randn(20 * 4 * 64 + 1, dtype=DT)
    q = buf[1:].view(20, 4, 64)  # base 2 bytes off alignment
    k, v = torch.randn(20, 2, 64, dtype=DT), torch.randn(20, 2, 64, dtype=DT)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    o = attention_prefill(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    ro, _ = reference.attention_varlen(q.double(), k.double(), v.double(), cu, cu, causal=True)
    assert launched == [False] and rel_err(o, ro) < TOL[DT]


def test_max_seqlen_q_inferred(small_tiles):
    q, k, v, cu_q, cu_k = packed([3, 26], [3, 26], 2, 1)
    o = attention_prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)  # max_seqlen_q computed from cu_seqlens_q
    ro, _ = reference.attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True)
    assert rel_err(o, ro) < TOL[DT]


def test_empty_batch():
    q, k, v, cu_q, cu_k = packed([0, 0], [4, 0], 2, 1)
    o, lse = attention_prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    assert o.shape == (0, 2, 64) and lse.shape == (2, 0)


def test_reference_matches_sdpa_float64():
    """The reference against an independent oracle, torch SDPA in float64 (causal with q_len = k_len, GQA)."""
    q = torch.randn(1, 4, 23, 64, dtype=torch.float64)
    k, v = torch.randn(1, 2, 23, 64, dtype=torch.float64), torch.randn(1, 2, 23, 64, dtype=torch.float64)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    ro, _ = reference.attention_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    assert rel_err(ro, sdpa) < 1e-12
    # end-aligned causal with a window, via an explicit mask
    q2 = q[:, :, -7:]
    mask = reference.allowed_mask(7, 23, True, (5, -1))
    sdpa = F.scaled_dot_product_attention(q2, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    ro, _ = reference.attention_dense(q2.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                      window=(5, -1))
    assert rel_err(ro, sdpa) < 1e-12
    # softcap by its formula
    s = torch.einsum("qhd,khd->hqk", q2[0].transpose(0, 1), k[0].transpose(0, 1).repeat_interleave(2, 1)) / 8
    s = 4.0 * torch.tanh(s / 4.0)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    want = torch.einsum("hqk,khd->qhd", p, v[0].transpose(0, 1).repeat_interleave(2, 1))
    got, _ = reference.attention(q2[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), causal=True,
                                 window=(5, -1), softcap=4.0)
    assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda q, k, v, c: attention_prefill(q.float(), k.float(), v.float(), cu_seqlens_q=c, cu_seqlens_k=c),
         TypeError, "q must have dtype"),
        (lambda q, k, v, c: attention_prefill(q, k.bfloat16(), v, cu_seqlens_q=c, cu_seqlens_k=c),
         TypeError, "k must have dtype"),
        (lambda q, k, v, c: attention_prefill(q[:, :3], k, v, cu_seqlens_q=c, cu_seqlens_k=c),
         ValueError, "multiple of the heads of k"),
        (lambda q, k, v, c: attention_prefill(q, k, v[:, :1], cu_seqlens_q=c, cu_seqlens_k=c),
         ValueError, "v must have as many heads"),
        (lambda q, k, v, c: attention_prefill(q[..., :48], k[..., :48], v, cu_seqlens_q=c, cu_seqlens_k=c),
         ValueError, "head dim of q and k must be one of"),
        (lambda q, k, v, c: attention_prefill(q, k[..., :32], v, cu_seqlens_q=c, cu_seqlens_k=c),
         ValueError, "k must have the head dim of q"),
        (lambda q, k, v, c: attention_prefill(q, k, v, cu_seqlens_q=c), ValueError, "given together"),
        (lambda q, k, v, c: attention_prefill(q, k, v, cu_seqlens_q=c.float(), cu_seqlens_k=c),
         TypeError, "cu_seqlens_q must have dtype"),
        (lambda q, k, v, c: attention_prefill(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c[:2]),
         ValueError, "cu_seqlens_k must have shape"),
        (lambda q, k, v, c: attention_prefill(q, k, v, cu_seqlens_q=c.flip(0), cu_seqlens_k=c),
         ValueError, "cu_seqlens_q must start at 0"),
        (lambda q, k, v, c: attention_prefill(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=2),
         ValueError, "max_seqlen_q"),
        (lambda q, k, v, c: attention_prefill(q, k, v), ValueError, r"q must be \[batch, seq, heads, dim\]"),
        (lambda q, k, v, c: attention_prefill(q[None], k[None, :5], v[None], causal=False),
         ValueError, "same sequence length"),
        (lambda q, k, v, c: attention_prefill(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, window=(3, 2)),
         ValueError, "window right"),
        (lambda q, k, v, c: attention_prefill(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, window=(-2, -1)),
         ValueError, "window left"),
        (lambda q, k, v, c: attention_prefill(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, softcap=-1.0),
         ValueError, "softcap"),
        (lambda q, k, v, c: attention_prefill(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, scale=0.0),
         ValueError, "scale"),
        (lambda q, k, v, c: attention_prefill(q.transpose(1, 2).contiguous().transpose(1, 2), k, v,
                                              cu_seqlens_q=c, cu_seqlens_k=c), ValueError, "q must be contiguous"),
    ],
)
def test_bad_inputs(call, exc, match):
    q = torch.randn(10, 4, 64, dtype=DT)
    k, v = torch.randn(10, 2, 64, dtype=DT), torch.randn(10, 2, 64, dtype=DT)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(exc, match=match):
        call(q, k, v, cu)


def test_meta_device_named():
    q = torch.randn(10, 4, 64, dtype=DT)
    k = torch.randn(10, 2, 64, dtype=DT, device="meta")
    with pytest.raises(ValueError, match="k is on meta"):
        attention_prefill(q, k, k, cu_seqlens_q=torch.tensor([0, 10]), cu_seqlens_k=torch.tensor([0, 10]))


def test_torch_compile_fullgraph(small_tiles):
    """A GQA attention block built on the op traces as one graph and gives the eager result."""

    def block(x, wq, wkv, cu):
        q = (x @ wq).view(-1, 4, 64)
        kv = (x @ wkv).view(-1, 2, 2, 64)
        o, lse = attention_prefill(q, kv[:, 0], kv[:, 1], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=17,
                                   window=(8, -1), return_lse=True)
        return o.flatten(1), lse

    x = torch.randn(29, 32, dtype=DT)
    wq, wkv = torch.randn(32, 256, dtype=DT) / 6, torch.randn(32, 256, dtype=DT) / 6
    cu = torch.tensor([0, 12, 29], dtype=torch.int32)
    eager = block(x, wq, wkv, cu)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, wq, wkv, cu)
    torch.testing.assert_close(compiled, eager)
    ref, _ = reference.attention_varlen((x @ wq).view(-1, 4, 64).double(), (x @ wkv).view(-1, 2, 2, 64)[:, 0].double(),
                                        (x @ wkv).view(-1, 2, 2, 64)[:, 1].double(), cu, cu, causal=True,
                                        window=(8, -1))
    assert rel_err(eager[0], ref.flatten(1)) < TOL[DT]
    assert not math.isnan(eager[1].sum().item())
