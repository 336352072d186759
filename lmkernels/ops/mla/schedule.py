"""The split-KV schedule of an MLA decode step: which keys of which sequence each decode program (a "slot") takes,
computed once per step on the device by one small Triton program and read by every layer's decode kernel (one row
per program), as FlashMLA's get_mla_metadata does.

Balanced split: one chunk size c (in key tiles) for the whole batch, the smallest c ≥ lo = max(min_tiles,
⌈tiles / slots⌉, ⌈longest / MAX_CHUNKS⌉ (what a merge takes)) with Σᵢ max(1, ⌈tilesᵢ / c⌉) ≤ slots; sequence i is
cut into nᵢ = max(1, ⌈tilesᵢ / c⌉) chunks, numbered in sequence order, and slot p takes chunk p. So a long sequence
among short ones takes the spare slots; a uniform batch (all lengths equal) gets c = ⌈tiles / (slots // batch)⌉,
decode_num_splits's static split. Shapes decide the launch (slots); only the table depends on the lengths, so CUDA
graphs capture both kernels. The decode kernels once found their chunk themselves, each program repeating the
search: that cost ~3.6 µs a program in the Gluon kernel (H100, benchmarks/NOTES.md, issue 6, session n).

One more wave (the Gluon kernel's launch, kernels.decode_plan): where the launch was sized for `base` slots at one
chunk a sequence, it may hold a wave more (`wave` slots run at once). The schedule then also finds c₂, the smallest
c that fits all the slots, and takes it only where the busiest slot's work drops, estimated (in tiles) as c + (w −
1) · (tiles / Σnᵢ + SWITCH): w = ⌈Σnᵢ / wave⌉ chunks one after another, all but one of average length, each further
one paying SWITCH. So a long sequence among many short ones no longer runs in a few long chunks on the spare slots
of the base waves; a uniform batch of short sequences keeps the base.

A launch of programs (the Triton kernel's and the few-rows Gluon kernel's, kernels.decode_plan: the base slots as
programs): each program takes
either a chunk (c over the programs as slots, as above: at most one a program) or one contiguous range of L key tiles of the batch's tiles laid end to end, across sequence
ends (FlashMLA's and FlashInfer's balance): L = ⌈Σ tilesᵢ / programs⌉, at least min_tiles. A sequence's part inside
one program is a piece (a "chunk" below: pieces take the chunks' rows, partial slots and merges); a program takes
its pieces one after another. Ranges where the busiest program's work drops, in tiles: L + CUT against c, both
times the programs that share an SM (⌈programs / wave⌉), neither below Σ tilesᵢ / DRAM (constants below). One 16-row program streams ~26 GB/s alone, so a skewed batch's time is its busiest
program's work (H100, benchmarks/NOTES.md, issue 6, session r).

Layout of the schedule (int32, one tensor): slots rows of ROW = 6 values (sequence, its length, first key, end key,
its chunk count, the slot of its first chunk; sequence −1: a spare slot), then the merge list: its length, then
(sequence, first chunk's slot, chunks) for each sequence of several chunks, in order; for a launch of programs,
then a row of PROGRAM_ROW values a program: its first slot, its slot count (it takes the slots from the first
on), and its first slot's row."""

import torch
import triton
import triton.language as tl

from ..._utils import gdc_launch_dependents, gdc_wait, pdl_enabled

ROW = 6
SCHEDULE_ROW = tl.constexpr(ROW)  # (jit functions read module globals only as constexprs)
PROGRAM_ROW = 8  # a program's row: its first slot, its slot count, then its first slot's row
PROGRAM_ROW_VALUES = tl.constexpr(PROGRAM_ROW)
MAX_CHUNKS = 256  # chunks of one sequence at most (what the merge takes)
SEQ_BLOCK = 256  # sequences per block (the first block stays in registers through the search)
CANDIDATES = 16  # chunk sizes tested per search round
PDL = True  # launch with programmatic dependent launch (Hopper; see _schedule_kernel)
# what a slot's next chunk costs beyond its tiles (its q load and pipeline fill, its partial and merge), in key tiles
# (32 keys in the 16-row Triton kernel, 64 in the Gluon kernel). H100 (benchmarks/NOTES.md, issue 6, session p):
# Triton, 70 × 1k in 210 chunks of 11 tiles, two a slot, took as long as 70 whole sequences (32 tiles), so > 10;
# 1 × 8k + 127 × 512 in 16-tile chunks over two waves (against 52 in one) was 25% faster, so < 20. Gluon, 128 heads,
# 1 × 8k + 127 × 512 in three waves of 8-tile chunks was 7% slower than two waves with 26-tile ones, so > 10.7
SWITCH_TILES = 16
SCHEDULE_WARPS = 8  # _schedule_kernel's (build_schedule says why)
RANGE_BLOCK = 1024  # a launch of programs: sequences and pieces in registers (slots = batch + programs − 1)
RANGE_BLOCK_MIN = 256  # … in blocks of the slots' power of 2, at least this
# The cost rule between chunks and ranges, in key tiles of one program streaming alone (H100, NOTES, issue 6, session
# r): a range cut at a sequence end costs its program a second start (q, the pipeline's fill) and both pieces a
# partial and a merge, ~RANGE_CUT_TILES; programs that share an SM (more programs than a wave) each take that many
# times longer a tile; and no launch beats DRAM, which DRAM_PROGRAMS programs at one program's rate saturate (26 GB/s
# each against ~3 TB/s), so the busiest program's work counts only above Σ tiles / DRAM_PROGRAMS. Fitted on 38
# batches (r-8, r-10): the rule takes the faster layout on all but one (3.7% slower there). The few-rows Gluon kernel
# (64-key tiles, one program an SM, H200) keeps it: on 18 batches, 10 uniform, the rule's pick was within 0.6% of the
# faster of ranges and chunks (NOTES, issue 6, session ag)
RANGE_CUT_TILES = 10
DRAM_PROGRAMS = 120


def merge_entries(batch: int, slots: int) -> int:
    """Length bound of the merge list: a sequence of several chunks takes ≥ 2 slots, so at most slots − batch of
    them (4 for 128 sequences on 132 slots: the merge grid stays that small)."""
    return max(1, min(batch, slots - batch))


def schedule_size(batch: int, slots: int, programs: int = 0) -> int:
    """Values of the schedule; programs > 0: a launch of programs (their rows, PROGRAM_ROW values each)."""
    return ROW * slots + 1 + 3 * merge_entries(batch, slots) + PROGRAM_ROW * programs


def program_rows(sched: torch.Tensor, batch: int, slots: int) -> torch.Tensor:
    """The program rows of a launch of programs (a view, PROGRAM_ROW values a program)."""
    return sched[ROW * slots + 1 + 3 * merge_entries(batch, slots):]


@triton.jit
def _block_lens(len_ptr, b0, batch, len0):
    """(indices, lengths) of sequences b0 + [0, SEQ_BLOCK), 0 past the batch; block 0 from registers (len0)."""
    i = b0 + tl.arange(0, len0.shape[0])
    loaded = tl.load(len_ptr + i, mask=(i < batch) & (b0 > 0), other=0).to(tl.int32)
    return i, tl.where(b0 == 0, len0, loaded)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _chunk_counts(len_ptr, batch, len0, cand, BLOCK_N: tl.constexpr):
    """Σᵢ max(1, ⌈tilesᵢ / c⌉) for each chunk size c of cand [K]."""
    count = tl.zeros(cand.shape, tl.int32)
    b0 = 0
    while b0 < batch:
        i, lens = _block_lens(len_ptr, b0, batch, len0)
        n = tl.maximum(tl.cdiv(tl.cdiv(lens, BLOCK_N)[:, None], cand[None, :]), 1)
        count += tl.sum(tl.where((i < batch)[:, None], n, 0), 0)
        b0 += len0.shape[0]
    return count


@triton.jit
def _smallest_fit(len_ptr, batch, len0, lo, hi, slots, K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The smallest chunk size c in [lo, hi] whose chunks fit the slots (hi fits: ≤ slots // batch chunks each), K
    candidates a round, each round cutting the range K-fold: 16⁴ tiles apart (4M keys at 64 a tile) take 4 rounds."""
    k = tl.arange(0, K)
    while lo < hi:
        step = tl.cdiv(hi - lo, K)
        count = _chunk_counts(len_ptr, batch, len0, tl.minimum(lo + step * k, hi), BLOCK_N)  # candidate 0 = lo
        first_ok = tl.min(tl.where(count <= slots, k, K), 0)  # K: none fits below hi
        # (candidates by arithmetic, not picked out of the vector: two reductions a round fewer)
        new_lo = tl.where(first_ok == 0, lo, lo + step * (first_ok - 1) + 1)
        hi = tl.where(first_ok == K, hi, tl.minimum(lo + step * first_ok, hi))
        lo = new_lo
    return hi


@triton.jit
def _busiest(c, chunks, total, wave, switch):
    """The busiest slot's work, in tiles, for `chunks` chunks of ≤ c tiles (`total` in all), `wave` at a time (the
    cost rule of the extra wave: module docstring)."""
    return c + (tl.cdiv(chunks, wave) - 1) * (total // tl.maximum(chunks, 1) + switch)


@triton.jit(do_not_specialize=["batch", "slots", "base", "wave", "min_tiles"])  # one compile for every batch size
def _schedule_kernel(len_ptr, sched_ptr, batch, slots, base, wave, min_tiles, BLOCK_N: tl.constexpr,
                     MAX_CHUNKS: tl.constexpr, SEQ_BLOCK: tl.constexpr, K: tl.constexpr, SWITCH: tl.constexpr,
                     EXTRA_WAVE: tl.constexpr, TABLE: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One program writes the whole schedule (module docstring; base = slots: no extra wave). The chunk-size search
    keeps c in [lo, hi] (_smallest_fit); none for a uniform batch. Slots → sequences: where the chunks fit SEQ_BLOCK
    slots, in registers (a histogram of the first chunks' slots, summed as it runs); otherwise through the table (−1
    everywhere, each sequence's number at its first chunk's slot, a running max), three passes of slots / threads
    stores, where a [sequences, chunks] tile of stores cost ~10 µs at B=1 (H100, session o). EXTRA_WAVE (slots > base)
    and TABLE (slots > SEQ_BLOCK) leave out the code of the extra wave's search and of the table where the plan
    cannot use them: 23 KB of SASS instead of 55 for most plans, since the decode after this kernel fetches its own
    code again, the more the bigger this kernel (~0.1 µs a KB, H200, NOTES, issue 6, session ae). USE_PDL: launched with
    programmatic dependent launch: starts while the kernel before it drains and waits for it (the lengths). It does
    not release the decode kernel after it early: that (the Gluon kernel's) takes a whole SM's registers a program,
    and dispatched while this program still held an SM it ran slower, 128 heads B=32 32k 596 against 572 µs released
    at this kernel's exit, short calls ±1 µs (H200, NOTES, issue 6, session ae)."""
    if USE_PDL:
        gdc_wait()
    i0 = tl.arange(0, SEQ_BLOCK)
    len0 = tl.load(len_ptr + i0, mask=i0 < batch, other=0).to(tl.int32)
    total = 0  # key tiles
    longest = 0
    shortest = 1 << 30
    b0 = 0
    while b0 < batch:
        i, lens = _block_lens(len_ptr, b0, batch, len0)
        total += tl.sum(tl.cdiv(lens, BLOCK_N), 0)
        longest = tl.maximum(longest, tl.max(lens, 0))
        shortest = tl.minimum(shortest, tl.min(tl.where(i < batch, lens, 1 << 30), 0))
        b0 += SEQ_BLOCK
    most = tl.cdiv(longest, BLOCK_N)
    floor = tl.maximum(min_tiles, tl.maximum(tl.cdiv(most, MAX_CHUNKS), 1))
    if longest == shortest:  # uniform: ⌈most / chunks each⌉ is the smallest chunk that fits; a short path (its code
        # is fetched cold)
        c = tl.maximum(floor, tl.cdiv(most, base // batch))
        c_all = tl.maximum(floor, tl.cdiv(most, slots // batch))
        cost = _busiest(c, batch * tl.maximum(tl.cdiv(most, c), 1), total, wave, SWITCH)
        c = tl.where(_busiest(c_all, batch * tl.maximum(tl.cdiv(most, c_all), 1), total, wave, SWITCH) < cost, c_all,
                     c)
        _uniform_slots(sched_ptr, i0, batch, slots, longest, c, tl.maximum(tl.cdiv(most, c), 1), BLOCK_N)
    else:
        lo = tl.maximum(floor, tl.cdiv(total, base))
        c = _smallest_fit(len_ptr, batch, len0, lo, tl.maximum(lo, tl.cdiv(most, base // batch)), base, K, BLOCK_N)
        if EXTRA_WAVE:  # (slots > base) the extra wave, where it can lower the busiest slot's work
            cost = c  # (wave = base: the base's chunks run at once)
            if wave < base:
                cost = _busiest(c, tl.max(_chunk_counts(len_ptr, batch, len0, tl.full([K], c, tl.int32), BLOCK_N),
                                          0), total, wave, SWITCH)
            lo = tl.maximum(floor, tl.cdiv(total, slots))
            # a smaller c makes more than base chunks (of ≥ total / slots tiles on average)
            if lo + (tl.cdiv(base + 1, wave) - 1) * (total // slots + SWITCH) < cost:
                c_all = _smallest_fit(len_ptr, batch, len0, lo, tl.maximum(lo, tl.cdiv(most, slots // batch)), slots,
                                      K, BLOCK_N)
                chunks = tl.max(_chunk_counts(len_ptr, batch, len0, tl.full([K], c_all, tl.int32), BLOCK_N), 0)
                c = tl.where(_busiest(c_all, chunks, total, wave, SWITCH) < cost, c_all, c)
        chunk_keys = c * BLOCK_N
        ok = i0 < batch
        n = tl.where(ok, tl.maximum(tl.cdiv(tl.cdiv(len0, BLOCK_N), c), 1), 0)  # (block 0)
        in_registers = (batch <= SEQ_BLOCK) & (tl.sum(n, 0) <= SEQ_BLOCK)
        # spare first: the slots past the first block (in registers), or every slot's sequence −1 (through the table:
        # a spare slot, or not a sequence's first chunk)
        s0 = tl.where(in_registers, SEQ_BLOCK, 0)
        while s0 < slots:
            tl.store(sched_ptr + (s0 + i0) * SCHEDULE_ROW, tl.full([SEQ_BLOCK], -1, tl.int32), mask=s0 + i0 < slots)
            s0 += SEQ_BLOCK
        if in_registers:  # every slot's sequence found in registers
            first = tl.cumsum(n, 0) - n
            merged = _list_merges(sched_ptr + SCHEDULE_ROW * slots, i0, first, n, ok, 0)
            tl.store(sched_ptr + SCHEDULE_ROW * slots, merged)
            # slot s: the number of sequences whose first chunk is at or before s, less one
            seq = tl.cumsum(tl.histogram(first, SEQ_BLOCK, mask=ok), 0) - 1
            seq = tl.where(i0 < tl.sum(n, 0), seq, -1)  # past the last chunk: spare
            own = tl.maximum(seq, 0)
            _store_slots(sched_ptr + i0 * SCHEDULE_ROW, seq, tl.gather(len0, own, 0), tl.gather(first, own, 0),
                         tl.gather(n, own, 0), i0, chunk_keys, i0 < slots)
        elif TABLE:  # (slots > SEQ_BLOCK: with fewer, every sequence fits the registers) each sequence's number
            # at its first chunk's slot, then a running max over the slots gives every slot its sequence
            tl.debug_barrier()  # (global stores are visible to the block's other threads after a barrier)
            done = 0  # slots taken by the sequences before this block
            merged = 0  # merge-list entries so far
            b0 = 0
            while b0 < batch:
                i, lens = _block_lens(len_ptr, b0, batch, len0)
                ok = i < batch
                n = tl.where(ok, tl.maximum(tl.cdiv(tl.cdiv(lens, BLOCK_N), c), 1), 0)
                first = done + tl.cumsum(n, 0) - n
                tl.store(sched_ptr + first * SCHEDULE_ROW, i, mask=ok)
                merged = _list_merges(sched_ptr + SCHEDULE_ROW * slots, i, first, n, ok, merged)
                done += tl.sum(n, 0)
                b0 += SEQ_BLOCK
            tl.store(sched_ptr + SCHEDULE_ROW * slots, merged)
            tl.debug_barrier()
            seq_before = -1  # the sequence and first chunk of the slot before this block
            first_before = 0
            s0 = 0
            while s0 < done:
                s = s0 + i0
                used = s < done
                # (.cg, from L2: other threads wrote these)
                mark = tl.load(sched_ptr + s * SCHEDULE_ROW, mask=used, other=-1, cache_modifier=".cg")
                seq = tl.maximum(tl.associative_scan(mark, 0, _max), seq_before)
                first = tl.maximum(tl.associative_scan(tl.where(mark >= 0, s, -1), 0, _max), first_before)
                seq_len = tl.load(len_ptr + seq, mask=used, other=0).to(tl.int32)
                _store_slots(sched_ptr + s * SCHEDULE_ROW, seq, seq_len, first,
                             tl.maximum(tl.cdiv(tl.cdiv(seq_len, BLOCK_N), c), 1), s, chunk_keys, used)
                seq_before = tl.max(seq, 0)
                first_before = tl.max(first, 0)
                s0 += SEQ_BLOCK


@triton.jit(do_not_specialize=["batch", "slots", "programs", "wave", "min_tiles"])
def _program_schedule_kernel(len_ptr, sched_ptr, batch, slots, programs, wave, min_tiles, BLOCK_N: tl.constexpr,
                             MAX_CHUNKS: tl.constexpr, BLOCK: tl.constexpr, K: tl.constexpr, CUT: tl.constexpr,
                             DRAM: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One program writes the schedule of a launch of `programs` programs (the Triton kernel's; module docstring) for
    ≤ BLOCK sequences and pieces, in registers: chunks (of c tiles, c the balanced split's over the programs as
    slots; chunk p to program p) or ranges (sequence i's tiles, ≥ 1 so that an
    empty one still writes its output, start at Cᵢ of the batch's tiles laid end to end; its pieces are the
    programs ⌊Cᵢ / L⌋ … ⌊(Cᵢ + tilesᵢ − 1) / L⌋), whichever leaves the busiest program less work by the cost rule of
    the module docstring; pieces numbered in sequence order; each program's row (its first slot, slot count, that
    slot's row). USE_PDL: as _schedule_kernel."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    i = tl.arange(0, BLOCK)
    ok = i < batch
    lens = tl.load(len_ptr + i, mask=ok, other=0).to(tl.int32)
    tiles = tl.where(ok, tl.maximum(tl.cdiv(lens, BLOCK_N), 1), 0)
    total = tl.sum(tiles, 0)
    most = tl.max(tiles, 0)
    lo = tl.maximum(tl.maximum(min_tiles, tl.cdiv(most, MAX_CHUNKS)), tl.maximum(tl.cdiv(total, programs), 1))
    c = _smallest_fit(len_ptr, batch, lens, lo, tl.maximum(lo, tl.cdiv(most, programs // batch)), programs, K,
                      BLOCK_N)
    size = tl.maximum(tl.maximum(min_tiles, tl.cdiv(total, programs)),
                      tl.maximum(tl.cdiv(most, MAX_CHUNKS - 1), 1))  # L: ≤ ⌈tiles / L⌉ + 1 pieces a sequence
    dram = total // DRAM
    share = tl.cdiv(programs, wave)  # programs sharing an SM
    ranges = tl.maximum((size + CUT) * share, dram) < tl.maximum(c * share, dram)
    start = tl.where(ranges, tl.cumsum(tiles, 0) - tiles, 0)  # Cᵢ (chunks: each sequence from 0 in steps of c)
    size = tl.where(ranges, size, c)
    first_prog = start // size
    n = tl.where(ok, (start + tiles - 1) // size - first_prog + 1, 0)
    first = tl.cumsum(n, 0) - n
    pieces = tl.sum(n, 0)
    tl.store(sched_ptr + SCHEDULE_ROW * slots, _list_merges(sched_ptr + SCHEDULE_ROW * slots, i, first, n, ok, 0))
    seq = tl.cumsum(tl.histogram(first, BLOCK, mask=ok), 0) - 1  # piece k's sequence (as _schedule_kernel's slots)
    used = i < pieces
    own = tl.maximum(seq, 0)
    c_own = tl.gather(start, own, 0)
    j = i - tl.gather(first, own, 0)  # piece i is piece j of its sequence
    t_own = tl.gather(tiles, own, 0)
    a = tl.maximum(c_own, (tl.gather(first_prog, own, 0) + j) * size) - c_own  # its tiles [a, b)
    b = tl.minimum(c_own + t_own, (tl.gather(first_prog, own, 0) + j + 1) * size) - c_own
    len_own = tl.gather(lens, own, 0)
    row = sched_ptr + i * SCHEDULE_ROW
    keep = i < slots
    tl.store(row, tl.where(used, seq, -1), mask=keep)
    tl.store(row + 1, len_own, mask=keep)
    tl.store(row + 2, a * BLOCK_N, mask=keep)
    tl.store(row + 3, tl.minimum(b * BLOCK_N, len_own), mask=keep)
    tl.store(row + 4, tl.gather(n, own, 0), mask=keep)
    tl.store(row + 5, tl.gather(first, own, 0), mask=keep)
    prog = tl.where(ranges, tl.gather(first_prog, own, 0) + j, i)  # piece i's program (chunks: ≤ one a program)
    # each program's row: its first slot and slot count, then that slot's row (so that a program reads one row,
    # not a table entry and then a row: a dependent load less before its first tile)
    p = tl.arange(0, BLOCK)
    count = tl.histogram(prog, BLOCK, mask=used)
    slot0 = tl.cumsum(count, 0) - count
    at = tl.minimum(slot0, BLOCK - 1)
    prow = (sched_ptr + SCHEDULE_ROW * slots + 1 + 3 * tl.maximum(tl.minimum(batch, slots - batch), 1)
            + p * PROGRAM_ROW_VALUES)
    mine = p < programs
    tl.store(prow, slot0, mask=mine)
    tl.store(prow + 1, count, mask=mine)
    tl.store(prow + 2, tl.gather(seq, at, 0), mask=mine)
    tl.store(prow + 3, tl.gather(len_own, at, 0), mask=mine)
    tl.store(prow + 4, tl.gather(a * BLOCK_N, at, 0), mask=mine)
    tl.store(prow + 5, tl.gather(tl.minimum(b * BLOCK_N, len_own), at, 0), mask=mine)
    tl.store(prow + 6, tl.gather(tl.gather(n, own, 0), at, 0), mask=mine)
    tl.store(prow + 7, tl.gather(tl.gather(first, own, 0), at, 0), mask=mine)


@triton.jit
def _uniform_slots(sched_ptr, i0, batch, slots, seq_len, c, n, BLOCK_N: tl.constexpr):
    """The schedule of a uniform batch: n chunks of c tiles per sequence, slot s takes chunk s % n of sequence s // n
    (spare past batch · n); every sequence in the merge list where n > 1."""
    s0 = 0
    while s0 < slots:
        s = s0 + i0
        seq = s // n
        _store_slots(sched_ptr + s * SCHEDULE_ROW, tl.where(seq < batch, seq, -1), seq_len, seq * n, n, s,
                     c * BLOCK_N, s < slots)
        s0 += i0.shape[0]
    b0 = 0
    while b0 < tl.where(n > 1, batch, 0):
        i = b0 + i0
        _list_merges(sched_ptr + SCHEDULE_ROW * slots, i, i * n, tl.full(i0.shape, n, tl.int32), i < batch, b0)
        b0 += i0.shape[0]
    tl.store(sched_ptr + SCHEDULE_ROW * slots, tl.where(n > 1, batch, 0))


@triton.jit
def _list_merges(list_ptr, i, first, n, ok, merged):
    """The sequences of several chunks among i into the merge list (after `merged` entries); returns its length."""
    several = (ok & (n > 1)).to(tl.int32)
    entry = list_ptr + 1 + 3 * (merged + tl.cumsum(several, 0) - several)
    tl.store(entry, i, mask=several > 0)
    tl.store(entry + 1, first, mask=several > 0)
    tl.store(entry + 2, n, mask=several > 0)
    return merged + tl.sum(several, 0)


@triton.jit
def _store_slots(row, seq, seq_len, first, n, slot, chunk_keys, mask):
    """The schedule rows of these slots: chunk slot − first of sequence seq (n chunks of chunk_keys keys)."""
    start = (slot - first) * chunk_keys
    tl.store(row, seq, mask=mask)
    tl.store(row + 1, seq_len, mask=mask)
    tl.store(row + 2, start, mask=mask)
    tl.store(row + 3, tl.minimum(start + chunk_keys, seq_len), mask=mask)
    tl.store(row + 4, n, mask=mask)
    tl.store(row + 5, first, mask=mask)


def build_schedule(seq_lens: torch.Tensor, block_n: int, slots: int, min_tiles: int, base: int = None,
                   wave: int = None, programs: int = 0) -> torch.Tensor:
    """The schedule of seq_lens [B] over `slots` chunk slots (≥ B) with key tiles of block_n: `base` of them the
    heuristic's (< slots: an extra wave for skewed batches, `wave` slots at once; module docstring); programs > 0:
    a launch of that many programs (chunks over them as slots, or ranges; slots = B + programs − 1)."""
    batch = seq_lens.shape[0]
    sched = torch.empty(schedule_size(batch, slots, programs), dtype=torch.int32, device=seq_lens.device)
    pdl = PDL and pdl_enabled(seq_lens.device)
    base = base or slots
    if programs:
        if slots != batch + programs - 1 or slots > RANGE_BLOCK or programs < batch:
            raise ValueError(f"a launch of programs takes programs ≥ batch and slots = batch + programs − 1 ≤ "
                             f"{RANGE_BLOCK}, got batch {batch}, slots {slots}, programs {programs}")
        # registers for the slots (≥ the sequences and the programs), not for RANGE_BLOCK: histograms and gathers
        # of 1024 took the kernel 16 µs at any batch (H100, NOTES, issue 6, session aa)
        block = max(RANGE_BLOCK_MIN, triton.next_power_of_2(slots + 1))
        _program_schedule_kernel[(1,)](seq_lens, sched, batch, slots, programs, wave or programs, min_tiles,
                                       BLOCK_N=block_n, MAX_CHUNKS=MAX_CHUNKS, BLOCK=block, K=CANDIDATES,
                                       CUT=RANGE_CUT_TILES, DRAM=DRAM_PROGRAMS, USE_PDL=pdl, num_warps=8,
                                       **({"launch_pdl": True} if pdl else {}))
        return sched
    # 8 warps: half a thread's share of each [SEQ_BLOCK, K] search tile (57 against 87 KB of SASS). Placed between two
    # 128-head decode calls on the H200 the kernel adds 10.0–11.4 µs to the call at 8 warps against 12.8–15.9 at 4,
    # though it takes 2.4–4.8 µs alone (session ad): the Gluon decode after it fetches its code cold again, ~7 µs after
    # 57–64 KB of another kernel's code, ~4 after 32 KB (session ae, NOTES, issue 6). A model's layers share one
    # schedule a step, so only call mode pays it
    _schedule_kernel[(1,)](seq_lens, sched, batch, slots, base, wave or base, min_tiles, BLOCK_N=block_n,
                           MAX_CHUNKS=MAX_CHUNKS, SEQ_BLOCK=SEQ_BLOCK, K=CANDIDATES, SWITCH=SWITCH_TILES,
                           EXTRA_WAVE=slots > base, TABLE=slots > SEQ_BLOCK, USE_PDL=pdl, num_warps=SCHEDULE_WARPS,
                           **({"launch_pdl": True} if pdl else {}))
    return sched


def split_schedule(seq_lens, block_n, slots, min_tiles, base=None, wave=None, max_chunks=MAX_CHUNKS):
    """The schedule's chunk size and chunks in plain Python, for the tests: (chunk size c in tiles,
    [(first chunk, chunks)] per sequence)."""
    tiles = [-(-int(n) // block_n) for n in seq_lens]
    base = base or slots
    wave = wave or base

    def used(c):
        return sum(max(1, -(-t // c)) for t in tiles)

    def smallest_fit(n_slots):  # c = the longest sequence always fits: slots ≥ batch
        most = max(tiles, default=0)
        lo = max(1, min_tiles, -(-sum(tiles) // n_slots), -(-most // max_chunks))
        hi = max(lo, -(-most // (n_slots // len(tiles))))
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if used(mid) <= n_slots else (mid + 1, hi)
        return lo

    def busiest(c):  # the busiest slot's work in tiles
        chunks = used(c)
        return c + (-(-chunks // wave) - 1) * (sum(tiles) // max(chunks, 1) + SWITCH_TILES)

    c = smallest_fit(base)
    if slots > base:  # the extra wave where the busiest slot's work drops
        c_all = smallest_fit(slots)
        c = c_all if busiest(c_all) < busiest(c) else c
    ranges, first = [], 0
    for t in tiles:
        n = max(1, -(-t // c))
        ranges.append((first, n))
        first += n
    return c, ranges


def program_split(seq_lens, block_n, programs, min_tiles, wave=None, max_chunks=MAX_CHUNKS):
    """The schedule of a launch of programs (_program_schedule_kernel) in plain Python, for the tests: (ranges: bool,
    tiles a chunk or range, [(first piece, pieces)] per sequence, [(sequence, first key, end key, program)] per
    piece)."""
    tiles = [max(1, -(-int(n) // block_n)) for n in seq_lens]
    total = sum(tiles)
    c, _ = split_schedule([t * block_n for t in tiles], block_n, programs, min_tiles, max_chunks=max_chunks)
    size = max(1, min_tiles, -(-total // programs), -(-max(tiles) // (max_chunks - 1)))
    dram = total // DRAM_PROGRAMS
    share = -(-programs // (wave or programs))
    ranges = max((size + RANGE_CUT_TILES) * share, dram) < max(c * share, dram)
    size = size if ranges else c
    spans, pieces, start = [], [], 0
    for i, t in enumerate(tiles):
        first = len(pieces)
        for p in range(start // size, (start + t - 1) // size + 1):
            a, b = max(start, p * size) - start, min(start + t, (p + 1) * size) - start
            pieces.append([i, a * block_n, min(b * block_n, int(seq_lens[i])), p])
        spans.append((first, len(pieces) - first))
        start += t if ranges else 0
    if not ranges:  # chunk k to program k (c fits the programs as slots)
        for k, piece in enumerate(pieces):
            piece[3] = k
    return ranges, size, spans, [tuple(x) for x in pieces]
