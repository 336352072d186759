"""A minimal runner for tests and examples: prefill a batch of prompts, then greedy decode through the paged
cache, with pages handed out trivially (each sequence its own pages, in shuffled order to exercise the block
tables). The engine (scheduler, continuous batching, CUDA graphs) lives in lmkernels.engine."""

from typing import Optional

import torch

from .metadata import decode_metadata, prefill_metadata


def _allocate(lengths: list, page_size: int, seed: int = 0) -> tuple:
    need = [-(-n // page_size) for n in lengths]
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(sum(need), generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(pages[at: at + n])
        at += n
    return tables, sum(need)


@torch.inference_mode()
def prefill_logits(model, prompts: list, page_size: int = 16) -> torch.Tensor:
    """Last-position logits [B, vocab] (float32) of a packed prefill of the prompts (lists of token ids)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    tables, n_pages = _allocate([len(p) for p in prompts], page_size)
    cache = model.allocate_kv_cache(n_pages, page_size)
    positions, meta = prefill_metadata(tables, [len(p) for p in prompts], page_size, device=model.device)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=model.device)
    return model(ids, positions, meta, cache).float()


@torch.inference_mode()
def greedy_generate(model, prompts: list, max_new_tokens: int, *, page_size: int = 16,
                    eos_token_ids: Optional[list] = None, prefill_chunk: Optional[int] = None) -> list:
    """Greedy continuation of each prompt: a list of new-token lists (cut after the first EOS if eos_token_ids).

    prefill_chunk: prefill in chunks of that many tokens per sequence (append prefill over the cached prefix)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    dev = model.device
    lens = [len(p) for p in prompts]
    if max(lens) + max_new_tokens > model.max_model_len:
        raise ValueError(f"prompt + new tokens ({max(lens) + max_new_tokens}) exceed the model's context "
                         f"({model.max_model_len})")
    tables, n_pages = _allocate([n + max_new_tokens for n in lens], page_size)
    cache = model.allocate_kv_cache(n_pages, page_size)

    chunk = prefill_chunk or max(lens)
    done = [0] * len(prompts)
    last = [None] * len(prompts)
    while any(d < n for d, n in zip(done, lens)):  # prefill, possibly in chunks; finished prompts sit out
        active = [b for b in range(len(prompts)) if done[b] < lens[b]]
        takes = [min(chunk, lens[b] - done[b]) for b in active]
        positions, meta = prefill_metadata([tables[b] for b in active], takes, page_size,
                                           start_lens=[done[b] for b in active], device=dev)
        ids = torch.tensor([t for b, n in zip(active, takes) for t in prompts[b][done[b]: done[b] + n]],
                           dtype=torch.int64, device=dev)
        logits = model(ids, positions, meta, cache)
        for i, (b, n) in enumerate(zip(active, takes)):
            done[b] += n
            last[b] = logits[i]
    next_tok = [int(x.argmax()) for x in last]

    out = [[t] for t in next_tok]
    seq_lens = list(lens)
    for _ in range(max_new_tokens - 1):
        seq_lens = [n + 1 for n in seq_lens]
        positions, meta = decode_metadata(tables, seq_lens, page_size, device=dev)
        logits = model(torch.tensor(next_tok, dtype=torch.int64, device=dev), positions, meta, cache)
        next_tok = logits.argmax(-1).tolist()
        for o, t in zip(out, next_tok):
            o.append(t)
    if eos_token_ids:
        eos = set(eos_token_ids)
        out = [o[: next((i + 1 for i, t in enumerate(o) if t in eos), len(o))] for o in out]
    return out
