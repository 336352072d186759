import pytest

from lmkernels.engine import BlockManager, PageAllocator, Request, SamplingParams, Scheduler


def test_allocator_hands_out_and_takes_back():
    a = PageAllocator(4)
    pages = a.allocate(3)
    assert sorted(pages) == [0, 1, 2] and a.num_free == 1
    with pytest.raises(RuntimeError):
        a.allocate(2)
    a.free(pages[:1])
    with pytest.raises(RuntimeError):
        a.free(pages[:1])  # double free
    assert a.num_free == 2


def test_block_tables_grow_page_by_page():
    b = BlockManager(num_pages=5, page_size=4)
    b.ensure(7, 1)
    assert len(b.table(7)) == 1
    b.ensure(7, 4)
    assert len(b.table(7)) == 1
    b.ensure(7, 5)
    assert len(b.table(7)) == 2 and b.num_free == 3
    assert b.capacity(7) == 20 and not b.can_hold(7, 21)
    b.release(7)
    assert b.num_free == 5


def _req(n_prompt):
    return Request(prompt_ids=list(range(3, 3 + n_prompt)), params=SamplingParams())


def test_scheduler_budget_and_chunks():
    blocks = BlockManager(num_pages=6, page_size=4)
    s = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=8)
    a, b = _req(10), _req(12)
    s.add(a)
    s.add(b)
    batch = s.schedule()  # a's first chunk takes the whole budget of 8 tokens
    assert batch.prefills == [(a, 8)] and s.running == [a]
    a.num_computed += 8
    batch = s.schedule()  # a finishes its prompt (2), b starts with what is left (6)
    assert batch.prefills == [(a, 2), (b, 6)]
    a.num_computed += 2
    b.num_computed += 6
    a.output_ids.append(5)  # a decodes now (1 token); b's chunk takes the rest: 6 pending, budget 7
    batch = s.schedule()
    assert batch.decodes == [a] and batch.prefills == [(b, 6)] and blocks.num_free == 0
    a.num_computed += 1
    b.num_computed += 6
    a.output_ids.append(6)
    b.output_ids.append(6)
    # a (12 tokens: 3 pages) decodes within its pages; b needs a 4th page for token 12, none is free, and b is
    # the youngest: it preempts itself, frees its 3 pages and waits; a is not touched
    batch = s.schedule()
    assert batch.decodes == [a] and batch.preempted == [b] and list(s.waiting) == [b]
    assert b.num_computed == 0 and blocks.num_free == 3


@pytest.mark.parametrize("num_pages,max_seqs,budget", [(6, 4, 8), (9, 3, 5), (40, 8, 64)])
def test_scheduler_simulation_never_loses_a_request(num_pages, max_seqs, budget):
    """Drive the scheduler with a fake model: every request finishes with all its tokens, the pages add up
    after every step, budgets hold, and a tight cache preempts."""
    blocks = BlockManager(num_pages=num_pages, page_size=4)
    s = Scheduler(blocks, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    lens, max_new = [10, 3, 17, 1, 9, 6], 8
    reqs = [_req(n) for n in lens]
    for r in reqs:
        s.add(r)
    finished, preemptions = [], 0
    for _ in range(1000):
        if not s.has_unfinished():
            break
        batch = s.schedule()
        preemptions += len(batch.preempted)
        work = batch.prefills + [(r, 1) for r in batch.decodes]
        assert work and sum(n for _, n in work) <= budget and len(s.running) <= max_seqs
        assert sum(len(t) for t in blocks.tables.values()) + blocks.num_free == num_pages
        for r, n in work:
            assert len(blocks.table(r.id)) * 4 >= r.num_computed + n
            r.num_computed += n
            if r.num_computed == r.num_tokens:
                r.output_ids.append(r.num_tokens)  # a token that records the position it was sampled at
                if len(r.output_ids) == max_new:
                    s.finish(r, "length")
                    finished.append(r)
    assert sorted(finished, key=lambda r: r.id) == reqs
    for r, n in zip(reqs, lens):  # recomputation after preemption never re-samples a token
        assert r.output_ids == list(range(n, n + max_new))
    assert blocks.num_free == num_pages and not blocks.tables
    if num_pages == 6:
        assert preemptions > 0
