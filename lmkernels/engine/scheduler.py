"""Continuous batching with chunked prefill and preemption by recomputation.

Every request carries its tokens (prompt + generated) and `num_computed`, how many of them sit in the KV
cache. Pending tokens = len(tokens) − num_computed: one pending token after a cached prefix is a decode,
anything else a prefill (a fresh prompt, the rest of a chunked prompt, or a preempted request's prompt +
generated tokens being recomputed).

One step, `Scheduler.schedule()`:
1. The running requests, oldest first. A decode takes one token of the step's token budget; a prefill takes
   a chunk of what is left of the budget after the decodes still to come (chunked prefill: a long prompt
   never stalls the decodes). The pages the tokens need are taken from the free list; when it runs dry a
   prefill chunk shrinks to the free room, and otherwise the youngest running request is preempted: its
   pages are freed, num_computed drops to 0, and it goes back to the front of the waiting queue, to be
   recomputed later from its prompt + generated tokens. The oldest request therefore always progresses
   (it fits alone: requests that could not are refused when added), so nothing starves or is lost.
2. If nothing was preempted, waiting requests join in arrival order while the budget, the pages and the
   sequence limit allow (a prompt may start with a first chunk).
Requests leave the running batch as soon as they finish (Scheduler.finish frees their pages).
"""

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .pages import BlockManager

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"

_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt_ids: List[int]
    params: object                          # SamplingParams
    index: int = 0                          # position in the caller's list
    generator: object = None                # torch.Generator of this request (sampling only)
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: List[int] = field(default_factory=list)
    num_computed: int = 0
    status: str = WAITING
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    # bookkeeping for outputs
    prefill_tokens: int = 0                 # tokens computed in prefill forwards (recomputation included)
    decode_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    text: str = ""
    detok: object = None
    emitted: int = 0                        # characters of text streamed so far

    @property
    def tokens(self) -> List[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decode(self) -> bool:
        """One pending token after a cached prefix (a one-token prompt is still a prefill)."""
        return self.num_computed > 0 and self.num_tokens - self.num_computed == 1


@dataclass
class Batch:
    prefills: List[Tuple[Request, int]]     # (request, new tokens this step)
    decodes: List[Request]
    preempted: List[Request]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be ≥ 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be ≥ max_num_seqs "
                             f"({max_num_seqs}): every running request decodes each step")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque = deque()
        self.running: List[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        req.status = WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        self.blocks.release(req.id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.release(req.id)
        req.num_computed = 0
        req.status = WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)  # victims leave youngest first, so the queue stays oldest first

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        prefills, decodes, preempted = [], [], []
        i = 0
        while i < len(self.running):
            r = self.running[i]
            decode = r.is_decode
            later_decodes = sum(1 for s in self.running[i + 1:] if s.is_decode)
            n = 1 if decode else min(r.num_pending, budget - later_decodes)
            if n <= 0:
                i += 1
                continue
            while not self.blocks.can_hold(r.id, r.num_computed + n):
                room = self.blocks.capacity(r.id) - r.num_computed
                if not decode and room > 0:
                    n = room
                    break
                victim = self.running[-1]
                preempted.append(victim)
                self._preempt(victim)
                if victim is r:
                    break
            if r.status != RUNNING:  # preempted itself: it was the youngest, nothing after it
                break
            self.blocks.ensure(r.id, r.num_computed + n)
            budget -= n
            if decode:
                decodes.append(r)
            else:
                prefills.append((r, n))
            i += 1

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            n = min(r.num_pending, budget, self.blocks.capacity(r.id) - r.num_computed)
            if n <= 0:
                break
            self.waiting.popleft()
            self.blocks.ensure(r.id, r.num_computed + n)
            r.status = RUNNING
            self.running.append(r)
            budget -= n
            prefills.append((r, n))
        return Batch(prefills, decodes, preempted)
