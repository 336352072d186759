"""The inference engine: paged KV cache bookkeeping, continuous batching with chunked prefill and preemption,
sampling, and streaming generation."""

from .engine import Engine, Output, Stats, StreamEvent
from .pages import BlockManager, PageAllocator
from .sampling import SamplingParams, filter_logits, sample
from .scheduler import Request, Scheduler
from .tokenizer import ByteTokenizer

__all__ = [
    "BlockManager", "ByteTokenizer", "Engine", "Output", "PageAllocator", "Request", "SamplingParams",
    "Scheduler", "Stats", "StreamEvent", "filter_logits", "sample",
]
