"""The engine on a tiny random Llama (fp32, reference ops): continuous batching, chunked prefill and
preemption give exactly the tokens of each prompt alone; stops; errors."""

import pytest
import torch

from lmkernels.engine import Engine, SamplingParams
from lmkernels.loading import load_preset
from lmkernels.models import greedy_generate

from .conftest import LetterTokenizer, random_prompts

LENGTHS = (5, 40, 17, 1, 90, 33)
NEW = 12


@pytest.fixture(scope="module")
def alone(tiny_model):
    """Each prompt alone, greedy, through the models' own simple runner (not the engine)."""
    prompts = random_prompts(LENGTHS)
    return prompts, [greedy_generate(tiny_model, [p], NEW)[0] for p in prompts]


def _engine(model, tokenizer=None, **kw):
    kw.setdefault("eos_token_ids", [])
    return Engine(model, tokenizer, **kw)


def _record(engine):
    """Wrap the scheduler to keep every batch."""
    batches, schedule = [], engine.scheduler.schedule

    def wrapped():
        b = schedule()
        batches.append((b, [(r, r.num_computed) for r, _ in b.prefills]))
        return b

    engine.scheduler.schedule = wrapped
    return batches


def test_batch_equals_each_prompt_alone(tiny_model, alone):
    prompts, ref = alone
    e = _engine(tiny_model, num_pages=256, page_size=16)
    outs = e.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert [o.token_ids for o in outs] == ref
    assert [o.index for o in outs] == list(range(len(prompts)))
    assert all(o.finish_reason == "length" and o.prompt_token_ids == p for o, p in zip(outs, prompts))
    assert sum(o.prefill_tokens for o in outs) == sum(LENGTHS) == e.stats.prefill_tokens
    assert all(o.decode_tokens == NEW - 1 for o in outs)
    assert e.stats.preemptions == 0 and e.blocks.num_free == e.num_pages


def test_requests_join_and_leave_every_step(tiny_model, alone):
    """Requests arrive while others decode and leave when done (different max_new_tokens)."""
    prompts, ref = alone
    e = _engine(tiny_model, num_pages=256, page_size=8)
    batches = _record(e)
    news = [NEW, 3, 7, NEW, 5, 9]
    reqs, done, step = [], {}, 0
    while len(done) < len(prompts):
        if step % 2 == 0 and len(reqs) < len(prompts):
            i = len(reqs)
            reqs.append(e.add_request(prompts[i], SamplingParams(max_new_tokens=news[i]), index=i))
        for ev in e.step():
            if ev.finished:
                done[ev.index] = ev.output
        step += 1
    for i, (r, n) in enumerate(zip(ref, news)):
        assert done[i].token_ids == r[:n]
    mixed = [b for b, _ in batches if b.prefills and b.decodes]
    assert mixed, "no step had a prefill beside running decodes"
    sizes = [len(b.decodes) for b, _ in batches]
    assert max(sizes) >= 3 and sizes[-1] == 1  # the batch grew and shrank
    assert e.blocks.num_free == e.num_pages


def test_chunked_prefill_gives_the_same_tokens(tiny_model, alone):
    prompts, ref = alone
    e = _engine(tiny_model, num_pages=256, page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    batches = _record(e)
    outs = e.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert [o.token_ids for o in outs] == ref
    assert any(start > 0 for _, chunks in batches for _, start in chunks)  # append prefill over a cached prefix
    assert all(sum(n for _, n in b.prefills) + len(b.decodes) <= 16 for b, _ in batches)
    assert max(len(b.decodes) + len(b.prefills) for b, _ in batches) <= 4


def test_preemption_under_a_tiny_page_budget(tiny_model, alone):
    prompts, ref = alone
    # the longest request needs (90 + 11) / 4 → 26 pages: 30 pages hold it alone, not the batch
    e = _engine(tiny_model, num_pages=30, page_size=4, max_num_seqs=6, max_num_batched_tokens=32)
    outs = e.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert [o.token_ids for o in outs] == ref
    assert e.stats.preemptions > 0 and sum(o.num_preemptions for o in outs) == e.stats.preemptions
    assert sum(o.prefill_tokens for o in outs) > sum(LENGTHS)  # recomputation
    assert e.blocks.num_free == 30 and not e.blocks.tables


def test_a_request_that_can_never_fit_is_refused(tiny_model):
    e = _engine(tiny_model, num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="KV pages"):
        e.generate([list(range(3, 20))], SamplingParams(max_new_tokens=4))
    assert not e.has_unfinished() and e.blocks.num_free == 4


def test_max_model_len_and_prompt_errors():
    model = load_preset("tiny-llama", dtype=torch.float32, max_model_len=32)
    e = _engine(model, num_pages=16, page_size=4)
    out = e.generate([list(range(3, 28))], SamplingParams(max_new_tokens=50))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 32 - 25
    with pytest.raises(ValueError, match="context"):
        e.generate([list(range(3, 35))])
    with pytest.raises(ValueError, match="empty"):
        e.generate([[]])
    with pytest.raises(ValueError, match="vocabulary"):
        e.generate([[3, 4, 9999]])
    with pytest.raises(ValueError, match="tokenizer"):
        e.generate("some text")


def test_eos_and_stop_token_ids(tiny_model, alone):
    prompts, ref = alone
    toks = ref[1]
    eos = toks[4]
    cut = toks[: toks.index(eos) + 1]
    e = _engine(tiny_model, num_pages=64, eos_token_ids=[eos])
    assert e.generate([prompts[1]], SamplingParams(max_new_tokens=NEW))[0].token_ids == cut
    out = e.generate([prompts[1]], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
    assert out.token_ids == toks and out.finish_reason == "length"
    e = _engine(tiny_model, num_pages=64)
    out = e.generate([prompts[1]], SamplingParams(max_new_tokens=NEW, stop_token_ids=[eos]))[0]
    assert out.token_ids == cut and out.finish_reason == "stop"


def test_stop_strings_cut_the_text_and_stream_nothing_past_them(tiny_model, alone):
    prompts, ref = alone
    e = _engine(tiny_model, LetterTokenizer(), num_pages=64)
    full = LetterTokenizer().decode(ref[2])
    out = e.generate([prompts[2]], SamplingParams(max_new_tokens=NEW))[0]
    assert out.text == full
    stop = full[5:8]
    j = full.find(stop)
    events = []
    out = e.generate([prompts[2], prompts[0]], SamplingParams(max_new_tokens=NEW, stop=[stop, "never"]),
                     callback=events.append)[0]
    assert out.finish_reason == "stop" and out.text == full[:j]
    assert out.token_ids == ref[2][: j + len(stop)]
    assert "".join(ev.text for ev in events if ev.index == 0) == full[:j]
    # a stop string that only ever half appears is held back while it could complete, then released
    half = full[-1] + "#"
    streamed = []
    out = e.generate([prompts[2]], SamplingParams(max_new_tokens=NEW, stop=half), callback=streamed.append)[0]
    assert out.text == full and "".join(ev.text for ev in streamed) == full


def test_static_decode_buffers_with_padded_buckets(tiny_model, alone):
    """The CUDA-graph decode path without the capture (CPU): batches padded up to a bucket with length-0
    rows and skipped cache slots give the tokens of each prompt alone, as requests join and leave."""
    from lmkernels.engine.cuda_graph import DecodeGraphs, buckets_for
    from lmkernels.engine.pages import pages_for

    assert buckets_for(6) == [1, 2, 4, 6] and buckets_for(1) == [1]
    prompts, ref = alone
    e = _engine(tiny_model, num_pages=256, page_size=8, max_num_seqs=6, max_num_batched_tokens=48)
    e.graphs = DecodeGraphs(tiny_model, e.kv_cache, 6, pages_for(e.max_model_len, 8), capture=False,
                            buckets=[1, 4, 6])
    seen = []
    run = e.graphs.run
    e.graphs.run = lambda ids, *a: seen.append(len(ids)) or run(ids, *a)
    news = [NEW, 3, 7, NEW, 5, 9]
    outs = e.generate(prompts, [SamplingParams(max_new_tokens=n) for n in news])
    for o, r, n in zip(outs, ref, news):
        assert o.token_ids == r[:n]
    assert {2, 3, 5} & set(seen)  # padded batches
    assert e.blocks.num_free == e.num_pages


def test_pipelined_greedy_decode(tiny_model, alone):
    """The decode step t + 1 launched before the tokens of step t are read (ids left on the device by the
    in-graph argmax): same tokens as each prompt alone, with requests of different lengths stopping (their
    token computed ahead is dropped), an EOS, a request joining mid-way (the pipeline drains) and a sampled
    request (never pipelined)."""
    from lmkernels.engine.cuda_graph import DecodeGraphs
    from lmkernels.engine.pages import pages_for

    prompts, ref = alone
    eos = ref[4][6]
    e = _engine(tiny_model, num_pages=256, page_size=4, max_num_seqs=6, max_num_batched_tokens=128,
                eos_token_ids=[eos])
    e.graphs = DecodeGraphs(tiny_model, e.kv_cache, 6, pages_for(e.max_model_len, 4), capture=False,
                            buckets=[2, 4, 6])
    news = [NEW, 3, 7, NEW, NEW, 9]
    expect = [r[:n] for r, n in zip(ref, news)]
    expect[4] = ref[4][: ref[4].index(eos) + 1]
    outs = e.generate(prompts, [SamplingParams(max_new_tokens=n) for n in news])
    assert [o.token_ids for o in outs] == expect
    assert e.stats.pipelined_steps >= 3 and e.blocks.num_free == e.num_pages and e._inflight is None
    # a request added while the pipeline runs: it drains, the newcomer prefills, decoding goes on
    e.eos_token_ids = set()
    before = e.stats.pipelined_steps
    done, step = {}, 0
    e.add_request(prompts[0], SamplingParams(max_new_tokens=NEW), index=0)
    while e.has_unfinished() or step == 0:
        if step == 4:
            e.add_request(prompts[5], SamplingParams(max_new_tokens=NEW), index=5)
        for ev in e.step():
            if ev.finished:
                done[ev.index] = ev.output.token_ids
        step += 1
    assert done == {0: ref[0], 5: ref[5]}
    assert e.blocks.num_free == e.num_pages
    assert e.stats.pipelined_steps > before + 3
