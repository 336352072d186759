"""What one forward step of a paged model needs besides the tokens: AttentionMetadata and the KVCache.

Layouts are those of lmkernels.ops.attention: a cache per layer [num_pages, page_size, Hk, D]; token t of a
sequence lives in page block_table[t // page_size], row t % page_size, i.e. slot = page · page_size + row.

Three kinds of step:
- prefill (no cached prefix): the new tokens of B sequences packed [T] with cu_seqlens [B + 1]; attention runs
  over the new tokens (attention_prefill, varlen); k/v are written to the cache at slot_mapping.
- append prefill (chunked prefill, a cached prefix): as prefill, plus block_tables and seq_lens (each sequence's
  full length, new tokens included); attention reads the keys from the cache (attention_prefill_paged).
- decode: Q = decode_query_len new tokens per sequence, T = B · Q, with block_tables and seq_lens
  (attention_decode). No host synchronisation on this path, so CUDA graphs can capture it.
"""

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor                     # [T] int32/int64: cache slot of each new token (−1: skip)
    cu_seqlens: Optional[torch.Tensor] = None      # prefill: [B + 1] int32 offsets of the packed new tokens
    max_seqlen: Optional[int] = None               # prefill: the longest new-token run (sizes the grid)
    block_tables: Optional[torch.Tensor] = None    # decode / append prefill: [B, max_pages] int32
    seq_lens: Optional[torch.Tensor] = None        # decode / append prefill: [B] int32, new tokens included
    max_seqlen_k: Optional[int] = None             # decode: an upper bound on seq_lens (None: the table's capacity)
    decode_query_len: int = 1                      # decode: new tokens per sequence
    logits_indices: Optional[torch.Tensor] = None  # rows to compute logits for (None: each sequence's last token)

    @property
    def num_seqs(self) -> int:
        if self.is_prefill:
            return self.cu_seqlens.shape[0] - 1
        return self.seq_lens.shape[0]

    def default_logits_indices(self, num_tokens: int) -> Optional[torch.Tensor]:
        """Each sequence's last new token (None for decode with Q = 1: every row is one)."""
        if self.logits_indices is not None:
            return self.logits_indices
        if self.is_prefill:
            return (self.cu_seqlens[1:] - 1).long()
        if self.decode_query_len == 1:
            return None
        q = self.decode_query_len
        return torch.arange(q - 1, num_tokens, q, device=self.slot_mapping.device)


@dataclass
class KVCache:
    """One (k, v) pair of paged caches per layer, each [num_pages, page_size, Hk, D]."""

    k: list
    v: list

    @classmethod
    def allocate(cls, config, num_pages: int, page_size: int, dtype=torch.bfloat16, device=None) -> "KVCache":
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        return cls(k, v)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def slots_for(block_table: list, positions, page_size: int) -> list:
    """Cache slots of one sequence's token positions under its page list."""
    return [block_table[p // page_size] * page_size + p % page_size for p in positions]


def prefill_metadata(block_tables: list, prompt_lens: list, page_size: int, start_lens: Optional[list] = None,
                     device=None) -> tuple:
    """(positions [T], AttentionMetadata) for prefilling tokens start_lens[b] … start_lens[b] + prompt_lens[b] − 1
    of each sequence (start 0: a fresh prompt; > 0: an append prefill over a cached prefix)."""
    start_lens = start_lens or [0] * len(prompt_lens)
    positions, slots, cu = [], [], [0]
    for table, n, s in zip(block_tables, prompt_lens, start_lens):
        pos = list(range(s, s + n))
        positions += pos
        slots += slots_for(table, pos, page_size)
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device), max_seqlen=max(prompt_lens, default=0),
    )
    if any(start_lens):
        meta.block_tables = _table_tensor(block_tables, device)
        meta.seq_lens = torch.tensor([s + n for s, n in zip(start_lens, prompt_lens)], dtype=torch.int32,
                                     device=device)
    return torch.tensor(positions, dtype=torch.int64, device=device), meta


def decode_metadata(block_tables: list, seq_lens: list, page_size: int, device=None) -> tuple:
    """(positions [B], AttentionMetadata) for one new token per sequence; seq_lens include that token."""
    positions = [n - 1 for n in seq_lens]
    slots = [slots_for(t, [p], page_size)[0] for t, p in zip(block_tables, positions)]
    meta = AttentionMetadata(
        is_prefill=False, slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=_table_tensor(block_tables, device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
    return torch.tensor(positions, dtype=torch.int64, device=device), meta


def _table_tensor(block_tables, device):
    width = max(len(t) for t in block_tables)
    rows = [list(t) + [0] * (width - len(t)) for t in block_tables]
    return torch.tensor(rows, dtype=torch.int32, device=device)
