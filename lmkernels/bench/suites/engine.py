"""The engine end to end: a random Llama-3-8B-shaped bf16 model (preset llama3-8b) on lmkernels, beside Hugging
Face transformers on the same weights (issue 4).

The Hugging Face model is built on the meta device from the same config and its parameters are set to views of
ours (q/k/v and gate/up are row slices of our fused matrices, which are contiguous), so both fit in one GPU with
one copy of the 16 GB of weights; attention is sdpa. Its logits are checked against ours first.

Rows (figures in `unit`; "gbps" holds the row's figure so the report's columns and ratios read it):
- decode B=1, context 512 and 4096: tokens/s of the engine's decode steps (CUDA graphs, greedy, Python
  scheduling and sampling included) while generating DECODE_TOKENS tokens after the prompt, against
  `generate` of HF. Shown as the weight bytes streamed per second (GB/s = tokens/s × bytes each step must read:
  every weight but the embedding table, of which one row is read), so % of copy is the issue's "% of the
  weight-bandwidth limit" (copy bandwidth measured in the same run ÷ those bytes). Goals: ≥ 85% of the limit,
  ≥ 10x HF.
- prefill of 4096 tokens (one sequence, KV written to the cache, logits of the last token): tokens/s of a
  forward, ours against HF (`model(ids, logits_to_keep=1)`, sdpa); goal ≥ 1.15x HF.
- decode throughput at batch 64 (context 512): ours with CUDA graphs (pipelined greedy decode: step t + 1 is
  launched before the tokens of step t are read), with graphs but not pipelined, without graphs, and HF
  generate (tokens/s). The B=1 rows carry the not-pipelined and no-graph figures in their notes too.
- kernels per decoder layer: CUDA kernels of one decode step (B=1, context 512) counted by the torch profiler,
  divided by the layers; "gbps" holds layers ÷ kernels ×100 (higher is better, so the ratio reads HF's count
  ÷ ours); the counts themselves are in the row's `kernels_per_layer` keys and note.
HF timings use few tokens (its decode step costs tens of ms): its decode rate is (t(1 + n) − t(1)) / n
tokens over `generate` calls of 1 and 1 + n new tokens.
"""

import time
import traceback

import torch

from .. import harness
from ..harness import log_line, short_error

PRESET = "llama3-8b"
DRY_PRESET = "tiny-llama"  # the CPU dry run (fp16 through the Triton interpreter)
CONTEXTS = (512, 4096)
DECODE_TOKENS = 128
HF_DECODE_TOKENS = 16
PREFILL = 4096
BATCH = 64
BATCH_CONTEXT = 512
BATCH_TOKENS = 64
HF_BATCH_TOKENS = 8
PAGE_SIZE = 16
REPEATS = 5  # prefill timings: median of this many forwards
TOL = 5e-2   # ours vs HF logits, both bf16 through 32 layers
COPY_GOAL, HF_DECODE_GOAL, PREFILL_GOAL = 0.85, 10.0, 1.15
GOAL_TEXT = (f"decode B=1: ≥ {COPY_GOAL:.0%} of the weight-bandwidth limit (copy GB/s ÷ weight bytes read per "
             f"token) and ≥ {HF_DECODE_GOAL:.0f}x HF generate; prefill 4096: ≥ {PREFILL_GOAL}x HF (sdpa)")


def _dev():
    return harness.device()


def _dtype():
    return torch.bfloat16 if _dev() == "cuda" else torch.float16


def _sync():
    if _dev() == "cuda":
        torch.cuda.synchronize()


def _preset():
    return PRESET if _dev() == "cuda" else DRY_PRESET


# ----------------------------------------------------------------------------------------------------
# the two models on one set of weights


def hf_twin(model):
    """A transformers LlamaForCausalLM (sdpa) whose parameters are views of `model`'s."""
    import transformers
    from ...loading import preset_config

    cfg = preset_config(model.preset_name)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=model.dtype, attn_implementation="sdpa")
    for name, _ in list(hf.named_parameters(remove_duplicate=False)):  # tied lm_head too
        target, rows = model.hf_target(name)
        tensor = target if rows is None else target[rows]
        owner, leaf = name.rsplit(".", 1)
        setattr(hf.get_submodule(owner), leaf, torch.nn.Parameter(tensor, requires_grad=False))
    rotary = hf.model.rotary_emb
    with torch.device(model.device):  # the rotary inv_freq buffers, computed where the model lives
        hf.model.rotary_emb = type(rotary)(config=hf.config)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"HF twin: tensors left on the meta device: {left[:4]}")
    return hf.eval()


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: all parameters but the embedding table (one row of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    if model.lm_head is None:  # tied: the table is read whole as the lm_head
        return total
    return total - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()


def random_prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


# ----------------------------------------------------------------------------------------------------
# measurements


def median_ms(fn, repeats=REPEATS, warmup=2):
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def engine_decode(engine, prompts, new_tokens, cuda_graph=True, pipeline=True):
    """(decode tokens/s, stats) of engine.generate over the prompts, greedy, after a short warm-up run with the
    same batch (graph capture and kernel compilation stay out of the figure)."""
    from ...engine import SamplingParams

    graphs = engine.graphs
    if not cuda_graph:
        engine.graphs = None
    engine.pipeline = pipeline
    try:
        engine.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
        engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    finally:
        engine.graphs = graphs
        engine.pipeline = True
    st = engine.stats
    return st.decode_tokens / st.decode_time, st


def hf_generate_seconds(hf, ids, new_tokens):
    mask = torch.ones_like(ids)
    _sync()
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    _sync()
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t0


def hf_decode(hf, prompts, new_tokens):
    """HF generate decode tokens/s: (t(1 + n) − t(1)) over n steps of the whole batch."""
    ids = torch.tensor(prompts, device=_dev())
    hf_generate_seconds(hf, ids, 2)  # warm-up
    t1 = min(hf_generate_seconds(hf, ids, 1) for _ in range(2))
    tn = hf_generate_seconds(hf, ids, 1 + new_tokens)
    return new_tokens * len(prompts) / max(tn - t1, 1e-9)


def count_kernels(fn) -> int:
    """Kernels one call of fn runs on the GPU (torch profiler device events, memcpy/memset excluded); on the CPU
    dry run, the profiler's top-level CPU ops."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _dev() == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        _sync()
    events = prof.events()
    if _dev() == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.lower().startswith(("memcpy", "memset"))]
    else:
        kernels = [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
    PROFILES.append(_kernel_table(kernels))
    return len(kernels)


PROFILES = []  # per count_kernels call: the kernels by total device time (for the notes)


def _kernel_table(kernels, top=12):
    """[(name, count, total µs)] of the most expensive kernels (device time on the GPU, CPU time on the CPU)."""
    agg = {}
    for e in kernels:
        t = getattr(e, "device_time", None)
        if t is None:
            t = getattr(e, "cuda_time", 0.0)
        if not t:
            t = e.cpu_time
        name = e.name[:80]
        c, tot = agg.get(name, (0, 0.0))
        agg[name] = (c + 1, tot + float(t))
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]
    return [[name, c, round(tot, 1)] for name, (c, tot) in rows]


# ----------------------------------------------------------------------------------------------------
# rows


def _res(name, kind, figure=None, **extra):
    r = {"name": name, "kind": kind, **extra}
    if figure is not None:
        r["gbps"] = figure
    return r


def _row(op, label, shape, unit, ours, peers, copy_gbps, goals, note="", nbytes=None):
    return harness.unit_row(op, label, shape, nbytes, unit, ours, peers, copy_gbps, goals, note,
                            untimed="not measured")

class Bench:
    """The models, the engine and the measurements shared by the rows."""

    def __init__(self, copy_gbps):
        from ...engine import Engine
        from ...engine.pages import pages_for
        from ...loading import load_preset

        self.copy_gbps = copy_gbps
        name = _preset()
        t0 = time.perf_counter()
        self.model = load_preset(name, dtype=_dtype(), device=_dev(), seed=0)
        self.model.preset_name = name
        self.hf = hf_twin(self.model)
        self.cfg = self.model.config
        self.bytes_per_token = weight_bytes_per_token(self.model)
        pages = max(BATCH * pages_for(BATCH_CONTEXT + BATCH_TOKENS + 1, PAGE_SIZE),
                    pages_for(max(CONTEXTS) + DECODE_TOKENS + 1, PAGE_SIZE), pages_for(PREFILL, PAGE_SIZE)) + 8
        self.engine = Engine(self.model, None, num_pages=pages, page_size=PAGE_SIZE, max_num_seqs=BATCH,
                             max_num_batched_tokens=max(BATCH * BATCH_CONTEXT, PREFILL), eos_token_ids=[])
        log_line(f"[engine] {name}: {sum(p.numel() for p in self.model.parameters()) / 1e9:.2f}B parameters, "
                 f"{self.bytes_per_token / 1e9:.2f} GB read per decode step, KV cache {pages} pages of {PAGE_SIZE} "
                 f"({self.engine.kv_cache.bytes() / 1e9:.1f} GB), set up in {time.perf_counter() - t0:.1f} s")

    @torch.inference_mode()
    def check(self):
        """Ours vs HF: last-position logits of a prompt (rel err) and the first greedy tokens."""
        from ...models import prefill_logits

        prompt = random_prompts(1, 100, self.cfg.vocab_size, seed=7)[0]
        ours = prefill_logits(self.model, [prompt])[0].double()
        ref = self.hf(torch.tensor([prompt], device=_dev()), logits_to_keep=1).logits[0, -1].double()
        err = ((ours - ref).norm() / ref.norm()).item()
        log_line(f"[engine] check: ours vs HF last-position logits rel err {err:.2e}")
        self.err = err
        return err

    def decode_row(self, context):
        prompts = random_prompts(1, context, self.cfg.vocab_size, seed=context)
        label = f"decode B=1 ctx={context}"
        per_token = self.bytes_per_token
        try:
            tps, st = engine_decode(self.engine, prompts, DECODE_TOKENS)
            replay_ms = None
            if _dev() == "cuda" and 1 in self.engine.graphs.graphs:
                replay_ms = median_ms(self.engine.graphs.graphs[1].replay, repeats=20)
            ours = _res("lmkernels engine", "ours", tps * per_token / 1e9, tokens_per_s=tps, err=self.err,
                        ms_per_token=1e3 / tps, graph_replay_ms=replay_ms)
        except Exception as e:
            log_line(traceback.format_exc())
            ours = _res("lmkernels engine", "ours", missing=short_error(e))
        try:
            eager, _ = engine_decode(self.engine, prompts, max(2, DECODE_TOKENS // 4), cuda_graph=False)
            no_graph = _res("ours, no CUDA graph", "ours-eager", eager * per_token / 1e9, tokens_per_s=eager)
        except Exception as e:
            no_graph = _res("ours, no CUDA graph", "ours-eager", missing=short_error(e))
        try:
            sync_tps, _ = engine_decode(self.engine, prompts, max(2, DECODE_TOKENS // 2), pipeline=False)
            no_pipe = _res("ours, graphs, not pipelined", "ours-sync", sync_tps * per_token / 1e9,
                           tokens_per_s=sync_tps)
        except Exception as e:
            no_pipe = _res("ours, graphs, not pipelined", "ours-sync", missing=short_error(e))
        try:
            hf_tps = hf_decode(self.hf, prompts, HF_DECODE_TOKENS)
            hf = _res("HF generate", "hf", hf_tps * per_token / 1e9, tokens_per_s=hf_tps)
        except Exception as e:
            log_line(traceback.format_exc())
            hf = _res("HF generate", "hf", missing=short_error(e))
        limit = self.copy_gbps * 1e9 / per_token if self.copy_gbps else None
        parts = [f"tokens/s: ours {ours.get('tokens_per_s', 0):.1f}"]
        if "tokens_per_s" in no_pipe:
            parts.append(f"graphs not pipelined {no_pipe['tokens_per_s']:.1f}")
        if "tokens_per_s" in no_graph:
            parts.append(f"no graph {no_graph['tokens_per_s']:.1f}")
        if "tokens_per_s" in hf:
            parts.append(f"HF {hf['tokens_per_s']:.1f}")
        if limit:
            parts.append(f"limit {limit:.1f}")
        if ours.get("graph_replay_ms"):
            parts.append(f"graph replay alone {ours['graph_replay_ms']:.2f} ms/token")
        note = ", ".join(parts) + f"; GB/s = tokens/s × {per_token / 1e9:.2f} GB of weights read per token"
        row = _row("engine_decode", label, [1, context], "GB/s", ours, [hf], self.copy_gbps,
                   {"copy": COPY_GOAL, "peer": HF_DECODE_GOAL}, note, nbytes=per_token)
        row["ours_no_cuda_graph"] = no_graph
        row["ours_not_pipelined"] = no_pipe
        return row

    def prefill_row(self):
        from ...models.metadata import prefill_metadata

        n = PREFILL
        prompt = random_prompts(1, n, self.cfg.vocab_size, seed=11)[0]
        ids = torch.tensor(prompt, dtype=torch.int64, device=_dev())
        table = list(range(-(-n // PAGE_SIZE)))
        positions, meta = prefill_metadata([table], [n], PAGE_SIZE, device=_dev())
        kv = self.engine.kv_cache
        with torch.inference_mode():
            try:
                ours_logits = self.model(ids, positions, meta, kv)[-1].double()
                ms = median_ms(lambda: self.model(ids, positions, meta, kv))
                ours = _res("lmkernels", "ours", n / ms * 1e3, ms=ms, tokens_per_s=n / ms * 1e3)
            except Exception as e:
                log_line(traceback.format_exc())
                ours, ours_logits = _res("lmkernels", "ours", missing=short_error(e)), None
            try:
                hf_ids = ids[None]
                ref = self.hf(hf_ids, use_cache=True, logits_to_keep=1).logits[0, -1].double()
                hms = median_ms(lambda: self.hf(hf_ids, use_cache=True, logits_to_keep=1))
                hf = _res("HF sdpa", "hf", n / hms * 1e3, ms=hms, tokens_per_s=n / hms * 1e3)
                if ours_logits is not None:
                    err = ((ours_logits - ref).norm() / ref.norm()).item()
                    ours["err"] = err
                    if not err <= TOL:
                        ours["wrong"] = f"rel err vs HF {err:.2e} > {TOL:.0e}"
            except Exception as e:
                log_line(traceback.format_exc())
                hf = _res("HF sdpa", "hf", missing=short_error(e))
        note = (f"ms: ours {ours.get('ms', float('nan')):.1f}, HF {hf.get('ms', float('nan')):.1f}; tokens/s of one "
                f"forward (KV written, last-token logits), median of {REPEATS}")
        return _row("engine_prefill", f"prefill {n} tokens", [1, n], "tokens/s", ours, [hf], self.copy_gbps,
                    {"peer": PREFILL_GOAL}, note)

    def batch_row(self):
        prompts = random_prompts(BATCH, BATCH_CONTEXT, self.cfg.vocab_size, seed=5)
        res = []
        for name, kind, graph, pipe in (("lmkernels engine", "ours", True, True),
                                        ("ours, graphs, not pipelined", "ours-sync", True, False),
                                        ("ours, no CUDA graph", "ours-eager", False, False)):
            try:
                tps, st = engine_decode(self.engine, prompts, BATCH_TOKENS, cuda_graph=graph, pipeline=pipe)
                res.append(_res(name, kind, tps, tokens_per_s=tps, steps=st.steps, pipelined=st.pipelined_steps))
            except Exception as e:
                log_line(traceback.format_exc())
                res.append(_res(name, kind, missing=short_error(e)))
        try:
            hf_tps = hf_decode(self.hf, prompts, HF_BATCH_TOKENS)
            res.append(_res("HF generate", "hf", hf_tps, tokens_per_s=hf_tps))
        except Exception as e:
            log_line(traceback.format_exc())
            res.append(_res("HF generate", "hf", missing=short_error(e)))
        ours, peers = res[0], res[1:]
        note = "decode tokens/s of the whole batch: " + ", ".join(
            f"{r['name']} {r['tokens_per_s']:.0f}" for r in res if "tokens_per_s" in r)
        return _row("engine_decode", f"decode B={BATCH} ctx={BATCH_CONTEXT}", [BATCH, BATCH_CONTEXT], "tokens/s",
                    ours, peers, self.copy_gbps, {}, note)

    def launches_row(self):
        from ...models.metadata import decode_metadata

        layers = self.cfg.num_layers
        ctx = CONTEXTS[0]
        kv = self.engine.kv_cache
        table = list(range(-(-(ctx + 1) // PAGE_SIZE)))
        positions, meta = decode_metadata([table], [ctx + 1], PAGE_SIZE, device=_dev())
        tok = torch.tensor([5], dtype=torch.int64, device=_dev())
        with torch.inference_mode():
            try:
                k = count_kernels(lambda: self.model(tok, positions, meta, kv))
                ours = _res("lmkernels (eager step)", "ours", 100 * layers / k, kernels=k, kernels_per_layer=k / layers)
            except Exception as e:
                log_line(traceback.format_exc())
                ours = _res("lmkernels (eager step)", "ours", missing=short_error(e))
            try:
                from transformers import DynamicCache

                ids = torch.tensor(random_prompts(1, ctx, self.cfg.vocab_size, seed=3), device=_dev())
                cache = DynamicCache(config=self.hf.config)
                self.hf(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                pos = torch.tensor([[ctx]], device=_dev())
                k_hf = count_kernels(lambda: self.hf(tok[None], past_key_values=cache, position_ids=pos,
                                                     use_cache=True))
                hf = _res("HF", "hf", 100 * layers / k_hf, kernels=k_hf, kernels_per_layer=k_hf / layers)
            except Exception as e:
                log_line(traceback.format_exc())
                hf = _res("HF", "hf", missing=short_error(e))
        if len(PROFILES) >= 2:
            ours["profile_us"], hf["profile_us"] = PROFILES[-2], PROFILES[-1]
            for who, table in (("ours", PROFILES[-2]), ("HF", PROFILES[-1])):
                log_line(f"[engine] {who} eager decode step, top kernels (name, count, µs): {table}")
        note = (f"CUDA kernels per decoder layer in one B=1 decode step (whole step ÷ {layers} layers): ours "
                f"{ours.get('kernels_per_layer', float('nan')):.2f}, HF {hf.get('kernels_per_layer', float('nan')):.2f}"
                f"; figure = 100 × layers ÷ kernels (higher is fewer); with CUDA graphs ours is one graph launch "
                f"per step")
        return _row("engine_launches", f"kernels/layer decode B=1 ctx={ctx}", [1, ctx], "100·layers/kernel", ours,
                    [hf], self.copy_gbps, {}, note)


def run(result: dict, quick: bool = False, save=lambda: None) -> None:
    result["goal_text"] = GOAL_TEXT
    copy_gbps = (result.get("ceilings") or {}).get("copy_gbps")
    bench = Bench(copy_gbps)
    bench.check()
    builds = [lambda c=c: bench.decode_row(c) for c in CONTEXTS]
    builds += [bench.prefill_row, bench.batch_row, bench.launches_row]
    harness.run_rows(builds, result, progress_line, "engine", save)


def progress_line(row: dict) -> str:
    head = f"[engine] {row.get('op')} {row.get('label')}:"
    if row.get("status") != "ok":
        return f"{head} FAILED ({row.get('failure')})"
    parts = [f"ours {row['ours']['gbps']:.1f} {row.get('unit')}"]
    if row.get("pct_copy") is not None:
        parts.append(f"{row['pct_copy']:.1f}% of the limit")
    for p in row["peers"]:
        parts.append(f"{p['name']} {p['gbps']:.1f}" if "gbps" in p else f"{p['name']} n/a")
    if row.get("ratio") is not None:
        parts.append(f"{row['ratio']:.2f}x {row['best_peer']}")
    goal = row.get("goal") or {}
    parts.append("goal " + ("met" if all(v is not False for v in goal.values()) else
                            "miss: " + ", ".join(k for k, v in goal.items() if v is False)))
    return f"{head} " + ", ".join(parts) + (f" | {row['note']}" if row.get("note") else "")
