"""The paged KV cache's bookkeeping: a free list of fixed-size pages and one block table (a list of page ids)
per sequence. Token t of a sequence lives in page table[t // page_size], row t % page_size."""

from typing import Dict, List


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PageAllocator:
    """A free list of page ids 0 … num_pages − 1. Double frees and foreign ids raise (a bug, never user input)."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, … first
        self._used = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> List[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV pages: asked for {n}, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = True
        return pages

    def free(self, pages: List[int]) -> None:
        for p in pages:
            if not (0 <= p < self.num_pages) or not self._used[p]:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._used[p] = False
            self._free.append(p)


class BlockManager:
    """Block tables of the live sequences over one PageAllocator."""

    def __init__(self, num_pages: int, page_size: int):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.tables: Dict[int, List[int]] = {}

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def table(self, seq_id: int) -> List[int]:
        return self.tables.setdefault(seq_id, [])

    def capacity(self, seq_id: int) -> int:
        """Tokens the sequence could hold with its own pages plus every free page."""
        return (len(self.tables.get(seq_id, ())) + self.allocator.num_free) * self.page_size

    def can_hold(self, seq_id: int, num_tokens: int) -> bool:
        return num_tokens <= self.capacity(seq_id)

    def ensure(self, seq_id: int, num_tokens: int) -> None:
        """Grow the sequence's table to cover num_tokens tokens (the caller checked can_hold)."""
        table = self.table(seq_id)
        need = pages_for(num_tokens, self.page_size) - len(table)
        if need > 0:
            table.extend(self.allocator.allocate(need))

    def release(self, seq_id: int) -> None:
        self.allocator.free(self.tables.pop(seq_id, []))
