"""Engine: a model over a paged KV cache, fed by the continuous-batching scheduler, with streaming output.

    engine = Engine.from_pretrained("smollm2")
    out = engine.generate("What is the capital of France?", SamplingParams(max_new_tokens=20))[0]
    out.text, out.token_ids, out.finish_reason

Each step runs at most two forwards: one prefill forward over the scheduled prompt chunks (varlen attention,
or paged "append" attention when a chunk continues a cached prefix) and one decode forward over the requests
that have one pending token (paged decode attention). On a GPU the decode forward is a CUDA graph replay per
batch-size bucket (cuda_graph.py); when every running request decodes greedily and nothing waits to join, the
next decode step is launched before this one's tokens are read (pipelined decode: the graph leaves its argmax in
the next step's input ids), so the host's bookkeeping overlaps the GPU's work. Errors the user can cause (bad
prompt, bad sampling values, a request that can never fit in the cache) are ValueError with a message meant for
them.
"""

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Union

import torch

from ..models.metadata import decode_metadata, prefill_metadata
from .cuda_graph import DecodeGraphs
from .pages import BlockManager, pages_for
from .sampling import SamplingParams, sample
from .scheduler import RUNNING, Request, Scheduler
from .tokenizer import ByteTokenizer, Detokenizer, encode_prompt

Prompt = Union[str, Sequence[int]]


@dataclass
class Output:
    index: int                      # position in the list given to generate
    text: str                       # the generated text (stop string cut off; "" without a tokenizer)
    token_ids: List[int]            # the generated tokens
    finish_reason: str              # "stop" (EOS, stop token or stop string) or "length"
    prompt_token_ids: List[int]
    prefill_tokens: int             # tokens computed by prefill forwards (recomputation after preemption too)
    decode_tokens: int              # tokens computed by decode forwards
    prefill_time: float             # seconds from arrival to the first token
    decode_time: float              # seconds from the first token to the end
    num_preemptions: int = 0


@dataclass
class StreamEvent:
    index: int
    text: str                       # new text since the last event of this request
    token_ids: List[int]            # new tokens
    finished: bool = False
    output: Optional[Output] = None  # set on the last event of a request


@dataclass
class Stats:
    prefill_tokens: int = 0
    prefill_time: float = 0.0
    decode_tokens: int = 0
    decode_time: float = 0.0
    steps: int = 0
    preemptions: int = 0
    pipelined_steps: int = 0   # decode steps launched while the previous one still ran

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else 0.0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    def __init__(self, model, tokenizer=None, *, num_pages: Optional[int] = None, page_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: Optional[int] = None,
                 eos_token_ids: Optional[Sequence[int]] = None, use_cuda_graph: bool = True,
                 kv_cache_bytes: Optional[int] = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = model.device
        self.max_model_len = model.max_model_len
        self.page_size = int(page_size)
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.max_num_seqs = int(max_num_seqs)
        if num_pages is None:
            num_pages = self._default_num_pages(kv_cache_bytes)
        self.num_pages = int(num_pages)
        self.blocks = BlockManager(self.num_pages, self.page_size)
        self.kv_cache = model.allocate_kv_cache(self.num_pages, self.page_size)
        tokens = int(max_num_batched_tokens or max(2048, self.max_num_seqs))
        self.max_num_seqs = min(self.max_num_seqs, tokens)  # every running request decodes in each step
        self.scheduler = Scheduler(self.blocks, self.max_num_seqs, tokens)
        eos = list(model.config.eos_token_ids()) if eos_token_ids is None else list(eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if eos_token_ids is None and tok_eos is not None and tok_eos not in eos:
            eos.append(int(tok_eos))
        self.eos_token_ids = set(eos)
        # decode on static buffers, replayed from CUDA graphs per batch-size bucket (cuda_graph.py)
        self.use_cuda_graph = bool(use_cuda_graph) and self.device.type == "cuda"
        self.graphs = None
        if self.use_cuda_graph:
            self.graphs = DecodeGraphs(model, self.kv_cache, self.max_num_seqs,
                                       pages_for(self.max_model_len, self.page_size))
        self.stats = Stats()
        self._events: List[StreamEvent] = []
        self.pipeline = True  # pipelined greedy decode on the CUDA-graph path (see _start_pipeline)
        self._inflight = None

    # ------------------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_pretrained(cls, spec=None, dtype=None, device=None, max_model_len=None, num_pages=None,
                        page_size: int = 16, **kwargs) -> "Engine":
        """An engine over lmkernels.loading.load_model(spec) (a checkpoint directory, a GGUF file, a preset,
        or None / "smollm2": the embedded SmolLM2-135M-Instruct) and its tokenizer (a byte-level stand-in for
        presets)."""
        from ..loading import load_model, load_tokenizer

        device = _check_device(device)
        model = load_model(spec, dtype=dtype, device=device, max_model_len=max_model_len)
        tokenizer = load_tokenizer(spec)
        if tokenizer is None:
            c = model.config
            tokenizer = ByteTokenizer(c.vocab_size, c.bos_token_id, (c.eos_token_ids() or [None])[0])
        return cls(model, tokenizer, num_pages=num_pages, page_size=page_size, **kwargs)

    def _default_num_pages(self, kv_cache_bytes) -> int:
        c = self.model.config
        elem = torch.empty((), dtype=self.model.dtype).element_size()
        page_bytes = 2 * c.num_layers * self.page_size * c.num_kv_heads * c.head_dim * elem
        if kv_cache_bytes is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_cache_bytes = int(free * 0.85)
            else:
                kv_cache_bytes = 1 << 30
        most = self.max_num_seqs * pages_for(self.max_model_len, self.page_size)
        return max(1, min(most, kv_cache_bytes // page_bytes))

    # ------------------------------------------------------------------------------------------------------
    # requests

    def _prompt_ids(self, prompt: Prompt, raw: bool) -> List[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give prompts as lists of token ids")
            ids = encode_prompt(self.tokenizer, prompt, raw)
        else:
            ids = list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError("a prompt is a string or a list of token ids (integers)")
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0 … {vocab - 1})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                             f"tokens (the prompt and at least one new token must fit)")
        return ids

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, index: int = 0,
                    raw: bool = False) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        ids = self._prompt_ids(prompt, raw)
        cached = min(len(ids) + params.max_new_tokens - 1, self.max_model_len - 1)
        if pages_for(cached, self.page_size) > self.num_pages:
            raise ValueError(f"a request of {len(ids)} prompt tokens + {params.max_new_tokens} new tokens needs "
                             f"{pages_for(cached, self.page_size)} KV pages; the cache has {self.num_pages} "
                             f"(raise num_pages or lower max_new_tokens)")
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        req = Request(prompt_ids=ids, params=params, index=index, generator=gen, arrival_time=time.perf_counter())
        if self.tokenizer is not None:
            req.detok = Detokenizer(self.tokenizer)
        self.scheduler.add(req)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------------------------------------------
    # one step

    @torch.inference_mode()
    def step(self) -> List[StreamEvent]:
        """Schedule, run the forwards, sample, and return the stream events of this step."""
        if self._inflight is not None:
            return self._continue_pipeline()
        batch = self.scheduler.schedule()
        if batch.empty:
            if self.has_unfinished():
                raise RuntimeError("the scheduler made no progress (a bug: every request was checked to fit)")
            return []
        self.stats.steps += 1
        self.stats.preemptions += len(batch.preempted)
        self._events = []
        dev, ps = self.device, self.page_size
        if batch.prefills:
            t0 = time.perf_counter()
            reqs = [r for r, _ in batch.prefills]
            lens = [n for _, n in batch.prefills]
            starts = [r.num_computed for r in reqs]
            positions, meta = prefill_metadata([self.blocks.table(r.id) for r in reqs], lens, ps,
                                               start_lens=starts, device=dev)
            ids = torch.tensor([t for r, s, n in zip(reqs, starts, lens) for t in r.tokens[s: s + n]],
                               dtype=torch.int64, device=dev)
            logits = self.model(ids, positions, meta, self.kv_cache)
            done = []
            for row, (r, n) in enumerate(batch.prefills):
                r.num_computed += n
                r.prefill_tokens += n
                if r.num_computed == r.num_tokens:
                    done.append(row)
            if done:
                self._sample([reqs[i] for i in done], logits[done])
            _sync(dev)
            self.stats.prefill_tokens += sum(lens)
            self.stats.prefill_time += time.perf_counter() - t0
        if batch.decodes:
            t0 = time.perf_counter()
            reqs = batch.decodes
            if self.pipeline and self.graphs is not None and not batch.prefills and not batch.preempted \
                    and all(r.params.greedy for r in reqs) and self.graphs.ready(len(reqs)):
                self._start_pipeline(reqs, t0)
                return self._events
            tables = [self.blocks.table(r.id) for r in reqs]
            lens = [r.num_computed + 1 for r in reqs]
            last = [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs]  # the pending token
            if self.graphs is not None:
                pos = [n - 1 for n in lens]
                slots = [t[p // ps] * ps + p % ps for t, p in zip(tables, pos)]
                logits = self.graphs.run(last, pos, slots, tables, lens)
            else:
                positions, meta = decode_metadata(tables, lens, ps, device=dev)
                ids = torch.tensor(last, dtype=torch.int64, device=dev)
                logits = self.model(ids, positions, meta, self.kv_cache)
            for r in reqs:
                r.num_computed += 1
                r.decode_tokens += 1
            self._sample(reqs, logits)
            self.stats.decode_tokens += len(reqs)
            self.stats.decode_time += time.perf_counter() - t0
        return self._events

    # ------------------------------------------------------------------------------------------------------
    # pipelined greedy decode: while the GPU runs step t + 1, the host reads and processes the tokens of step t

    def _launch_decode(self, reqs: List[Request], ahead: int):
        """Prepare and replay one decode step of reqs at `ahead` tokens past their pending one (0: the pending
        token, ids from the host; 1: the token the step in flight is computing, ids left on the device by it), and
        start fetching its greedy tokens; (host tokens, event)."""
        ps = self.page_size
        tables = [self.blocks.table(r.id) for r in reqs]
        lens = [r.num_computed + 1 + ahead for r in reqs]
        pos = [n - 1 for n in lens]
        slots = [t[p // ps] * ps + p % ps for t, p in zip(tables, pos)]
        ids = None if ahead else [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs]
        self.graphs.prepare(ids, pos, slots, tables, lens)
        self.graphs.replay(len(reqs))
        return self.graphs.fetch_tokens(len(reqs))

    def _can_run_ahead(self, reqs: List[Request]) -> bool:
        """Whether a step one token past the one in flight may be launched for exactly these requests: nothing
        waits to join, none is sure to stop at the step in flight, and the pages for the extra token exist (they
        are taken now)."""
        if self.scheduler.waiting or len(reqs) != len(self.scheduler.running):
            return False
        need = 0
        for r in reqs:
            if len(r.output_ids) + 2 > r.params.max_new_tokens or r.num_computed + 2 >= self.max_model_len:
                return False
            need += max(0, pages_for(r.num_computed + 2, self.page_size) - len(self.blocks.table(r.id)))
        if need > self.blocks.num_free:
            return False
        for r in reqs:
            self.blocks.ensure(r.id, r.num_computed + 2)
        return True

    def _finish_decode(self, reqs: List[Request], host, event, t0: float) -> None:
        """Wait for a step's tokens and append them to the requests still running."""
        if event is not None:
            event.synchronize()
        tokens = host.tolist()
        now = time.perf_counter()
        n = 0
        for r, tok in zip(reqs, tokens):
            if r.status != RUNNING:  # stopped at the step before: this token was computed ahead and is dropped
                continue
            r.num_computed += 1
            r.decode_tokens += 1
            self._append(r, tok, now)
            n += 1
        self.stats.decode_tokens += n
        self.stats.decode_time += time.perf_counter() - t0

    def _start_pipeline(self, reqs: List[Request], t0: float) -> None:
        host, event = self._launch_decode(reqs, 0)
        if self._can_run_ahead(reqs):
            self._inflight = (reqs, self._launch_decode(reqs, 1))
            self.stats.pipelined_steps += 1
        self._finish_decode(reqs, host, event, t0)

    def _continue_pipeline(self) -> List[StreamEvent]:
        t0 = time.perf_counter()
        self._events = []
        self.stats.steps += 1
        reqs, (host, event) = self._inflight
        self._inflight = None
        if all(r.status == RUNNING for r in reqs) and self._can_run_ahead(reqs):
            self._inflight = (reqs, self._launch_decode(reqs, 1))
            self.stats.pipelined_steps += 1
        self._finish_decode(reqs, host, event, t0)
        return self._events

    def _sample(self, reqs: List[Request], logits: torch.Tensor) -> None:
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        now = time.perf_counter()
        for r, tok in zip(reqs, tokens):
            self._append(r, tok, now)

    def _append(self, r: Request, tok: int, now: float) -> None:
        p = r.params
        r.output_ids.append(tok)
        if r.first_token_time is None:
            r.first_token_time = now
        reason = None
        special_stop = tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids)
        if special_stop:
            reason = "stop"
        elif r.detok is not None:
            delta = r.detok.step(r.output_ids)
            if delta:
                r.text += delta
                if p.stop:
                    cut = _find_stop(r.text, p.stop, len(r.text) - len(delta))
                    if cut is not None:
                        r.text = r.text[:cut]
                        reason = "stop"
        if reason is None and (len(r.output_ids) >= p.max_new_tokens or r.num_tokens >= self.max_model_len):
            reason = "length"
            if r.detok is not None and not p.stop:
                r.text += r.detok.flush(r.output_ids, r.text)
        if reason is not None:
            r.finish_time = now
            self.scheduler.finish(r, reason)
        # stream: hold back a tail that could still grow into a stop string
        end = len(r.text) if reason else len(r.text) - _stop_prefix_len(r.text, p.stop)
        text, r.emitted = r.text[r.emitted: end], max(r.emitted, end)
        self._events.append(StreamEvent(r.index, text, [tok], reason is not None,
                                        self._output(r) if reason else None))

    def _output(self, r: Request) -> Output:
        first = r.first_token_time or r.finish_time
        return Output(index=r.index, text=r.text, token_ids=list(r.output_ids), finish_reason=r.finish_reason,
                      prompt_token_ids=list(r.prompt_ids), prefill_tokens=r.prefill_tokens,
                      decode_tokens=r.decode_tokens, prefill_time=first - r.arrival_time,
                      decode_time=r.finish_time - first, num_preemptions=r.num_preemptions)

    def warmup(self, batch_size: int = 1) -> None:
        """Run a few tokens through a prefill and decode steps of `batch_size` requests, so that first-call costs
        (kernel compilation, lazy imports, the CUDA graph of that batch bucket) stay out of the timed runs."""
        vocab = self.model.config.vocab_size
        prompts = [[(3 + i) % vocab, (4 + i) % vocab] for i in range(batch_size)]
        self.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
        self.stats = Stats()

    # ------------------------------------------------------------------------------------------------------
    # batch API

    def stream(self, prompts: Union[Prompt, List[Prompt]], params=None, *, raw: bool = False) -> Iterator[StreamEvent]:
        """Add the prompts and run steps until all finish, yielding each request's events as they come.
        params: one SamplingParams for all, or a list with one per prompt."""
        if self.has_unfinished():
            raise RuntimeError("the engine is already running requests")
        prompts = _as_list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                reqs.append(self.add_request(prompt, p, index=i, raw=raw))
        except Exception:
            self._abort()
            raise
        self.stats = Stats()
        try:
            while self.has_unfinished():
                yield from self.step()
        finally:
            self._abort()

    def generate(self, prompts: Union[Prompt, List[Prompt]], params=None, *, raw: bool = False,
                 callback: Optional[Callable[[StreamEvent], None]] = None) -> List[Output]:
        """Outputs in the order of the prompts (a single prompt gives a list of one)."""
        outputs = {}
        for ev in self.stream(prompts, params, raw=raw):
            if callback is not None:
                callback(ev)
            if ev.finished:
                outputs[ev.index] = ev.output
        return [outputs[i] for i in sorted(outputs)]

    def _abort(self) -> None:
        """Drop every unfinished request (after an error or an abandoned stream), freeing their pages."""
        if self._inflight is not None:
            self._inflight = None
            _sync(self.device)
        s = self.scheduler
        for r in list(s.running) + list(s.waiting):
            s.blocks.release(r.id)
        s.running.clear()
        s.waiting.clear()


def _check_device(device) -> torch.device:
    """The device to run on (default: cuda when available); ValueError for a bad or unavailable one."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but no CUDA GPU is available here (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def _as_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _find_stop(text: str, stops: List[str], new_from: int) -> Optional[int]:
    """Where the first stop string that ends in the new text starts, or None."""
    best = None
    for s in stops:
        j = text.find(s, max(0, new_from - len(s) + 1))
        if j >= 0 and (best is None or j < best):
            best = j
    return best


def _stop_prefix_len(text: str, stops: List[str]) -> int:
    """The longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
