"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, with a torch.Generator per request.

The filters run batched over the rows; the random draw of each row uses only its request's generator
(an exponential race: argmax p_i / E_i with E_i ~ Exp(1) samples i with probability p_i), so a seeded
request draws the same tokens whatever else shares its batch."""

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0                # 1: off
    top_k: int = 0                    # 0 (or −1): off
    seed: Optional[int] = None        # None: a fresh random seed per request
    stop: Union[str, Sequence[str], None] = None   # stop strings (cut from the text)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer ≥ 1, got {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number ≥ 0 (0: greedy), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer ≥ 1, or 0 / −1 for no limit, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        self.stop = stop
        ids = list(self.stop_token_ids or [])
        if any(not is_int(t) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [N, V] after temperature, top-k (0: off) and top-p (1: off); excluded entries −inf.

    top-p keeps the smallest set of most likely tokens whose mass reaches p (always the most likely one)."""
    x = logits.float() / temperature[:, None]
    v = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(v, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k, v).clamp(max=v)
    sorted_x = sorted_x.masked_fill(rank >= k[:, None], float("-inf"))
    probs = sorted_x.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop = (mass_before >= top_p[:, None]) & (rank > 0) & (top_p[:, None] < 1)  # p = 1: off (no rounding cuts)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    out = torch.full_like(x, float("-inf"))
    out.scatter_(-1, order, sorted_x)
    return out.log_softmax(-1)


def sample(logits: torch.Tensor, params: List[SamplingParams], generators: List[Optional[torch.Generator]]) -> List[int]:
    """One token per row of logits [N, V] under each row's params (and generator for the random rows)."""
    n = logits.shape[0]
    tokens = logits.argmax(-1)
    rows = [i for i in range(n) if not params[i].greedy]
    if rows:
        dev = logits.device
        sub = logits[rows]
        t = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=dev)
        k = torch.tensor([params[i].top_k for i in rows], dtype=torch.int64, device=dev)
        p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32, device=dev)
        logp = filter_logits(sub, t, k, p)
        race = torch.stack([torch.empty(sub.shape[-1], device=dev).exponential_(generator=generators[i])
                            for i in rows])
        picked = (logp - race.log()).argmax(-1)  # argmax p / E, in log space
        tokens[rows] = picked
    return tokens.tolist()
