"""The engine on a CUDA GPU with the Triton kernels (`python -m lmkernels.engine.gpu_selftest`): checks that need
the GPU, printed as a short report; exit code 1 if a check fails.

1. A SmolLM2-135M-shaped model (preset, random weights, bf16): prefill logits against the same weights in fp32
   on the CPU through the ops' references.
2. The engine on it: a batch of prompts of different lengths with CUDA graphs (padded buckets) against the same
   batch without graphs (same batch shapes: identical tokens expected), each prompt alone (bf16 GEMMs of other
   shapes round differently: agreement reported), a tiny page budget (preemption), sampling with a seed.
3. `lmkernels generate` on the preset, with and without CUDA graphs (tokens/s lines).
The real SmolLM2 GGUF (98 MB) does not fit the 64 MiB the device tool carries; when it is installed it runs too.
"""

import sys
import time

import torch


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def main(device: str = "cuda") -> int:
    from ..cli import main as cli_main
    from ..loading import load_preset, smollm2_gguf_path
    from ..models import prefill_logits
    from . import Engine, SamplingParams

    fails = []

    def check(name, ok, detail):
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        if not ok:
            fails.append(name)

    torch.manual_seed(0)
    model = load_preset("smollm2-135m", dtype=torch.bfloat16, device=device, seed=0)
    ref = load_preset("smollm2-135m", dtype=torch.float32, device="cpu", seed=0)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(q.float().cpu())
    g = torch.Generator().manual_seed(1)
    lengths = (7, 130, 33, 1, 300, 64, 17, 250)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]
    gpu = prefill_logits(model, prompts[:3]).float().cpu()
    cpu = prefill_logits(ref, prompts[:3])
    err = _rel(gpu, cpu)
    check("bf16 Triton prefill logits vs fp32 CPU reference", err < 3e-2, f"rel err {err:.2e}")

    new = 48 if device == "cuda" else 10  # the CPU: a dry run of this script
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    e = Engine(model, None, num_pages=512, page_size=16, max_num_seqs=16, eos_token_ids=[])
    e.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
    t0 = time.perf_counter()
    graph = [o.token_ids for o in e.generate(prompts, params)]
    dt = time.perf_counter() - t0
    st = e.stats
    captured = sorted(e.graphs.graphs) if e.graphs is not None else []
    check("CUDA graphs replayed", 8 in captured and e.graphs.replays > 0,
          f"buckets captured {captured}, {e.graphs and e.graphs.replays} replays; batch of 8: "
          f"{st.decode_tokens / st.decode_time:.0f} decode tokens/s, {dt:.2f} s")
    pipelined = st.pipelined_steps
    e.pipeline = False
    sync = [o.token_ids for o in e.generate(prompts, params)]
    st = e.stats
    e.pipeline = True
    same = sum(a == b for a, b in zip(graph, sync))
    check("pipelined vs not pipelined greedy decode", same == len(prompts) and pipelined > new // 2,
          f"{same}/{len(prompts)} identical, {pipelined} pipelined steps; not pipelined "
          f"{st.decode_tokens / st.decode_time:.0f} decode tokens/s")
    graphs, e.graphs = e.graphs, None
    eager = [o.token_ids for o in e.generate(prompts, params)]
    st = e.stats
    same = sum(a == b for a, b in zip(graph, eager))
    check("graphs vs no graphs, same batch", same == len(prompts),
          f"{same}/{len(prompts)} identical; eager {st.decode_tokens / st.decode_time:.0f} decode tokens/s")
    e.graphs = graphs
    alone = [e.generate([p], params)[0].token_ids for p in prompts]
    agree = [sum(x == y for x, y in zip(a, b)) / new for a, b in zip(graph, alone)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), new) for a, b in zip(graph, alone)]
    check("batch vs each prompt alone (bf16)", sum(agree) / len(agree) >= 0.5,
          f"identical prefix lengths {first}, mean agreement {sum(agree) / len(agree):.2f}")
    tight = Engine(model, None, num_pages=40, page_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                   eos_token_ids=[])
    outs = tight.generate(prompts, params)
    lens_ok = all(len(o.token_ids) == new for o in outs)
    first_t = [next((i for i, (x, y) in enumerate(zip(o.token_ids, b)) if x != y), new) for o, b in zip(outs, alone)]
    check("preemption under a tiny page budget", tight.stats.preemptions > 0 and lens_ok
          and tight.blocks.num_free == tight.num_pages,
          f"{tight.stats.preemptions} preemptions, identical prefix lengths vs alone {first_t}; "
          f"pages back {tight.blocks.num_free}/{tight.num_pages}")
    sp = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=3)
    a = e.generate(prompts[:2], sp)
    b = e.generate(prompts[:2], sp)
    check("seeded sampling reproducible", [o.token_ids for o in a] == [o.token_ids for o in b],
          f"{a[0].token_ids[:8]}")

    for flags in ([], ["--no-cuda-graph"]):
        rc = cli_main(["generate", "--model", "smollm2-135m", "The capital of France is", "--max-new-tokens", "64",
                       "--raw", "--device", device, *flags])
        check(f"lmkernels generate {' '.join(flags) or '(CUDA graphs)'}", rc == 0, f"exit {rc}")
    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        print(f"[skip] real SmolLM2: {e}")
    else:
        rc = cli_main(["generate", "What is the capital of France?", "--max-new-tokens", "32"])
        check("real SmolLM2 answer", rc == 0, f"exit {rc}")
    if device == "cuda":
        attention_splits_diag()
    print(f"engine GPU self-test: {len(fails)} failure(s) {fails}", flush=True)
    return 1 if fails else 0


def attention_splits_diag():
    """Timing only (a note for the attention op): the paged decode at the 8B model's shapes (32 q / 8 kv heads,
    dim 128, pages of 16), B=1, as the engine's graphs call it (max_seqlen_k = the 8192-token context) against
    other split counts."""
    from ..bench.timing import time_ms
    from ..ops.attention import attention_decode

    hq, hk, d, ps, pages = 32, 8, 128, 16, 600
    kc = torch.randn(pages, ps, hk, d, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    q = torch.randn(1, hq, d, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(pages, device="cuda")[:512].int()[None].contiguous()
    out = []
    for ctx in (512, 4096):
        lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        cells = []
        for label, kw in (("graph (max 8192)", dict(max_seqlen_k=8192)), ("max=ctx", dict(max_seqlen_k=ctx)),
                          ("splits 64", dict(max_seqlen_k=8192, num_splits=64)),
                          ("splits 128", dict(max_seqlen_k=8192, num_splits=128))):
            try:
                ms = time_ms(lambda: attention_decode(q, kc, vc, table, lens, **kw))
                cells.append(f"{label} {ms * 1e3:.1f} us")
            except Exception as e:  # noqa: BLE001
                cells.append(f"{label} failed ({type(e).__name__}: {e})")
        out.append(f"ctx {ctx}: " + ", ".join(cells))
    print("[diag] attention_decode B=1, 8B shapes: " + " | ".join(out), flush=True)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
