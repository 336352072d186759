"""Decode on static buffers, replayed from CUDA graphs captured per batch-size bucket.

A decode step of B sequences runs the model on the first `bucket(B)` rows of static device buffers (token ids,
positions, cache slots, block tables, sequence lengths). Rows past B are padding: sequence length 0 (the paged
decode op gives zeros for them and reads no page), slot −1 (write_kv_cache skips them), token 0, position 0.
Nothing on this path depends on the values of those buffers for its launch shapes (the attention decode op's
grid is fixed by the batch size, see lmkernels.ops.attention.attention_decode), so one graph per bucket is
captured the first time the bucket is used (after an eager warm-up run that compiles the kernels) and replayed
after the buffers are refilled.

Each graph also writes the greedy token of every row (argmax of its logits) to `next_tokens` and to `ids`, so the
engine can launch the next greedy step before it has read this one's tokens (pipelined decode, engine.py).

Graphs share one memory pool; each graph's logits buffer stays alive and is read right after its replay,
before any other replay (the engine samples from it at once), which is what makes the sharing safe.

`capture=False` runs the same padded static-buffer forward eagerly (the CPU tests check the padding and the
pipelining this way).
"""

from typing import List, Optional, Sequence

import torch

from ..models.metadata import AttentionMetadata

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def buckets_for(max_batch: int) -> List[int]:
    """The capture sizes up to max_batch (max_batch itself included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
    return sorted({b for b in DEFAULT_BUCKETS if b < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_batch: int, max_pages: int, *, capture: bool = True,
                 buckets: Optional[Sequence[int]] = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.capture = bool(capture) and self.device.type == "cuda"
        self.max_batch = int(max_batch)
        self.buckets = sorted(buckets) if buckets else buckets_for(self.max_batch)
        if self.buckets[-1] < self.max_batch:
            raise ValueError(f"the largest bucket ({self.buckets[-1]}) is below max_batch ({self.max_batch})")
        self.max_pages = int(max_pages)
        self.page_size = kv_cache.page_size
        n, dev = self.buckets[-1], self.device
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(n, self.max_pages, dtype=torch.int32, device=dev)
        self.next_tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        # pinned host staging, two sets used in turn: the copies into the static buffers are asynchronous (a
        # pipelined step is prepared while the step before still runs), and a set is written again only two
        # steps later, after the step that read it was waited for
        pin = self.device.type == "cuda"
        self.host_tokens = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host_turn = 0
        self._stage = [(torch.zeros(3, n, dtype=torch.int64, pin_memory=pin),
                        torch.zeros(n, dtype=torch.int32, pin_memory=pin),
                        torch.zeros(n, self.max_pages, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self._stage_turn = 0
        self.graphs = {}
        self.outputs = {}
        self.pool = None
        self.replays = 0

    def bucket(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"a decode batch of {batch} exceeds the largest CUDA-graph bucket {self.buckets[-1]}")

    def ready(self, batch: int) -> bool:
        """Whether a decode of `batch` sequences replays without a capture first."""
        return batch <= self.buckets[-1] and (not self.capture or self.bucket(batch) in self.graphs)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slots[:b], block_tables=self.tables[:b],
                                 seq_lens=self.seq_lens[:b], max_seqlen_k=self.max_pages * self.page_size)

    def _forward(self, b: int) -> torch.Tensor:
        """The model on the first b rows; the greedy tokens go to next_tokens and become the next step's ids (the
        pipelined greedy decode reads them there without a round trip through the host)."""
        out = self.model(self.ids[:b], self.positions[:b], self._meta(b), self.kv_cache)
        tokens = out.argmax(-1)
        self.next_tokens[:b].copy_(tokens)
        self.ids[:b].copy_(tokens)
        return out

    def _capture(self, b: int) -> None:
        """Warm up (kernel compilation, the attention op's persistent counters) and capture bucket b, with every
        row as padding so neither run touches the cache."""
        self.seq_lens[:b].zero_()
        self.slots[:b].fill_(-1)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(b)
        self.pool = graph.pool()
        self.graphs[b] = graph
        self.outputs[b] = out

    def prepare(self, ids: Optional[List[int]], positions: List[int], slots: List[int], tables: List[List[int]],
                seq_lens: List[int]) -> int:
        """Fill the static buffers for a step of B = len(positions) sequences (ids None: keep the ids the last
        replay wrote, its greedy tokens, row for row); returns the bucket. The copies are asynchronous."""
        n = len(positions)
        b = self.bucket(n)
        width = max(len(t) for t in tables)
        if width > self.max_pages:
            raise ValueError(f"a block table of {width} pages exceeds the graph buffers' {self.max_pages}")
        if self.capture and b not in self.graphs:
            if ids is None:
                raise RuntimeError("a pipelined decode step needs its bucket captured already")
            self._capture(b)
        pad = b - n  # padding rows: no key, no cache write
        i64, lens, table = self._stage[self._stage_turn]
        self._stage_turn ^= 1
        rows = [list(positions) + [0] * pad, list(slots) + [-1] * pad]
        if ids is not None:
            rows.append(list(ids) + [0] * pad)
        i64[: len(rows), :b] = torch.tensor(rows, dtype=torch.int64)
        lens[:b] = torch.tensor(list(seq_lens) + [0] * pad, dtype=torch.int32)
        table[:n, :width] = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.positions[:b].copy_(i64[0, :b], non_blocking=True)
        self.slots[:b].copy_(i64[1, :b], non_blocking=True)
        if ids is not None:
            self.ids[:b].copy_(i64[2, :b], non_blocking=True)
        self.seq_lens[:b].copy_(lens[:b], non_blocking=True)
        self.tables[:n].copy_(table[:n], non_blocking=True)  # whole rows (contiguous); columns past width: unread
        return b

    def replay(self, n: int) -> torch.Tensor:
        """Run the step prepared for n sequences; logits [n, vocab] (read before the next replay)."""
        b = self.bucket(n)
        self.replays += 1
        if not self.capture:
            return self._forward(b)[:n]
        self.graphs[b].replay()
        return self.outputs[b][:n]

    def fetch_tokens(self, n: int):
        """Start copying the greedy tokens of the last replay to the host; (host tensor, event to wait on)."""
        host = self.host_tokens[self._host_turn][:n]
        self._host_turn ^= 1
        host.copy_(self.next_tokens[:n], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return host, event

    def run(self, ids: List[int], positions: List[int], slots: List[int], tables: List[List[int]],
            seq_lens: List[int]) -> torch.Tensor:
        """Logits [B, vocab] of one decode step of B = len(ids) sequences (a view of the graph's output
        buffer: read it before the next call)."""
        self.prepare(ids, positions, slots, tables, seq_lens)
        return self.replay(len(ids))
