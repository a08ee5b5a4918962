"""NaN / Inf in keys and values a row cannot see (docs/api.md, "NaN and Inf in keys a row cannot see").

The dense kernels mask a score by replacing it with -inf, so a non-finite *key* never reaches a masked
entry of S. Values and the backward's key reads are different: inside a partially masked tile the MMAs
multiply P = 0 (forward O += P V, backward dP = dO V^T then dS = P (dP - D)) or dS = 0 (dQ += dS K) by
every row of the tile, and IEEE 0 * NaN = 0 * Inf = NaN. The one rule here, used by every kernel that
meets it:

1. ``scrub_rows``: before an MMA reads a shared-memory tile of keys / values, zero each non-finite element
   of the tile in place and record, per tile row (key), whether it had one (``flags``: 1 / 0).
2. Poison what should be poisoned: a query row whose *visible* P meets a flagged key gets NaN where the
   unscrubbed tile would have given a non-finite result (forward: its accumulator row before the tile's PV,
   ``visible_bits_sm90`` / ``flag_bits_sm90`` / ``row_poison_bits`` / ``poison_acc``;
   backward: S = NaN on a flagged key row before the mask, dS = NaN where P != 0 on a flagged value row).
   "Visible" is P != 0 after the mask; a visible weight that underflows to exactly 0 counts as not visible
   (docs/api.md).

Rows that cannot see a flagged key then get exactly the values they get with finite keys there (the
scrubbed element is multiplied by P = 0 or dS = 0 only). Tiles nobody masks are not scrubbed: every row
sees every key there, so the MMA's own NaN is the right answer.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr

COPY_BITS = 128


def exponent_mask(dtype) -> int:
    """Exponent bits of a 16-bit float (all set: Inf or NaN)."""
    if dtype is cutlass.BFloat16:
        return 0x7F80
    if dtype is cutlass.Float16:
        return 0x7C00
    raise TypeError(f"nonfinite: 16-bit float expected, got {dtype}")


def pair_constants(dtype) -> tuple[int, int]:
    """(exponent fields of both halves of a 32-bit word, their lowest bits): the SWAR test of ``scrub_rows``,
    ``((w & e) + one) & 0x80008000``, sets bit 15 of exactly the halves that are Inf or NaN (an all-ones
    exponent plus its lowest bit carries into the sign bit; a smaller one never does, and no carry crosses
    into the other half)."""
    e = exponent_mask(dtype)
    return e * 0x10001, (e & -e) * 0x10001


def threads_per_row(rows: int, cols: int, threads: int, dtype, bits: int = COPY_BITS) -> int:
    """Adjacent threads sharing one tile row in ``scrub_rows``: rows spread over the threads first (one
    thread may own several rows), then each row's 16-byte chunks over ``threads // rows`` threads."""
    chunks = cols * dtype.width // bits
    per_row = max(1, threads // rows)
    assert threads % per_row == 0 and rows % (threads // per_row) == 0, (rows, threads)
    assert chunks % per_row == 0 and per_row <= 32 and (per_row & (per_row - 1)) == 0, (cols, per_row)
    return per_row


@cute.jit
def scrub_rows(sX: cute.Tensor, flags: cute.Tensor, tid: Int32, threads: cutlass.Constexpr,
               per_row: cutlass.Constexpr, bits: cutlass.Constexpr = COPY_BITS, batch: cutlass.Constexpr = 1) -> Int32:
    """Zero every non-finite element of the shared-memory tile ``sX`` (rows, cols; any swizzle) in place and
    write ``flags[row]`` = 1 where row had one, else 0 (every row written: no clearing needed), by the
    ``threads`` threads ``tid`` in [0, threads) (whole warps; all of them must call), ``per_row`` adjacent
    threads to a row (``threads_per_row`` with the same ``bits``), ``bits`` per load. Returns 1 if this
    thread found one. The caller fences the async proxy and synchronises before an MMA or a reader of
    ``flags`` depends on it. ``batch``: chunks of a row loaded together before their test (a divisor of the
    thread's chunks per row; ``batch_for``): one shared-memory round trip per ``batch`` chunks instead of one per
    chunk, for ``batch`` times the registers."""
    dtype = sX.element_type
    elems = bits // dtype.width
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
    tiled = cute.make_tiled_copy_tv(atom, cute.make_layout((threads // per_row, per_row), stride=(per_row, 1)),
                                    cute.make_layout((1, elems)))
    thr = tiled.get_slice(tid)
    tXsX = thr.partition_S(sX)  # (CPY, M, N)
    pair_e, pair_one = pair_constants(dtype)
    # Python values only, fixed before the dynamic loop (a name it reads becomes a staged Int32 there).
    offsets = [1 << k for k in range(per_row.bit_length() - 1)]
    n_chunks = cute.size(tXsX, mode=[2])
    row_step = threads // per_row  # thread t's m-th row: m * row_step + t // per_row
    owner = tid % per_row == 0
    first_row = tid // per_row
    found = Int32(0)
    row_bad = Int32(0)
    assert n_chunks % batch == 0, (n_chunks, batch)
    groups = n_chunks // batch
    # One flat loop over (row, group of chunks), not unrolled: the SM100 scrub warps run it within 56 registers
    # (batch 1: loading a row's chunks together spilled there); the SM90 consumers call it between their wgmma turns.
    for i in cutlass.range(cute.size(tXsX, mode=[1]) * groups, unroll=1):
        m = i // groups
        g = i - m * groups
        frags = [cute.make_rmem_tensor(cute.make_layout(elems), dtype) for _ in range(batch)]
        for b in cutlass.range_constexpr(batch):
            cute.autovec_copy(tXsX[None, m, g * batch + b], frags[b])
        # SWAR: a half's exponent field all ones (Inf / NaN) plus its lowest bit carries into bit 15.
        hits = Uint32(0)
        for b in cutlass.range_constexpr(batch):
            words = cute.recast_tensor(frags[b], Uint32)
            for k in cutlass.range_constexpr(elems // 2):
                hits = hits | (((words[k] & Uint32(pair_e)) + Uint32(pair_one)) & Uint32(0x80008000))
        bad = Int32(0)
        if hits != Uint32(0):  # rare: zero the non-finite halves, write the chunks back
            for b in cutlass.range_constexpr(batch):
                words = cute.recast_tensor(frags[b], Uint32)
                for k in cutlass.range_constexpr(elems // 2):
                    h = ((words[k] & Uint32(pair_e)) + Uint32(pair_one)) & Uint32(0x80008000)
                    words[k] = words[k] & ~((h >> Uint32(15)) * Uint32(0xFFFF))
                cute.autovec_copy(frags[b], tXsX[None, m, g * batch + b])
            bad = Int32(1)
        row_bad = row_bad | bad
        if g == groups - 1:  # the row's last chunks (uniform across the threads: shuffles are safe)
            for k in cutlass.range_constexpr(len(offsets)):
                row_bad = row_bad | cute.arch.shuffle_sync_bfly(row_bad, offset=offsets[k])
            if owner:
                flags[m * row_step + first_row] = row_bad.to(flags.element_type)
            found = found | row_bad
            row_bad = Int32(0)
    return found


def batch_for(cols: int, per_row: int, dtype, most: int = 4, bits: int = COPY_BITS) -> int:
    """``scrub_rows``' ``batch`` for rows of ``cols`` elements, ``per_row`` threads to a row: the largest power of
    two <= ``most`` dividing the thread's chunks per row."""
    chunks = cols * dtype.width // bits // per_row
    b = 1
    while b * 2 <= most and chunks % (b * 2) == 0:
        b *= 2
    return b


def nan_seen_halves(x, pair_bits, u32):
    """A 32-bit word ``x`` of two 16-bit probabilities (bf16 / fp16; low half first) with NaN (0x7FFF) in each
    half that is non-zero (``P != +-0``: the key is seen) and whose key is flagged: bit 0 of ``pair_bits`` for the
    low half, bit 1 for the high one (higher bits ignored). What a seen, flagged key gives the row in the
    unscrubbed MMA. ``u32``: the 32-bit constructor (``Uint32`` in a kernel, ``numpy.uint32`` in the CPU test)."""
    nz = ((x & u32(0x7FFF7FFF)) + u32(0x7FFF7FFF)) & u32(0x80008000)
    hit = nz & (((pair_bits & u32(1)) << u32(15)) | (((pair_bits >> u32(1)) & u32(1)) << u32(31)))
    m = ((hit >> u32(15)) & u32(1)) * u32(0xFFFF) | (hit >> u32(31)) * u32(0xFFFF0000)
    return (x & ~m) | (u32(0x7FFF7FFF) & m)


@cute.jit
def visible_bits_sm90(p16: cute.Tensor) -> list:
    """Per register row r (0, 1) of this thread's 16-bit P fragment as the SM90 PV wgmma's A operand holds it
    (acc_S's element order: 32-bit word w = row w % 2, register columns 2 (w // 2) + {0, 1}): a word with bit c
    set where P[r, c] != 0, i.e. the keys the row sees (a weight that underflowed to 0 counts as not seen).
    Both halves of a word are tested at once: ``((w & 0x7FFF7FFF) + 0x7FFF7FFF) & 0x80008000`` sets bit 15 / 31
    exactly where the half is non-zero (+0 and -0 count as zero)."""
    words = cute.recast_tensor(p16, Uint32)
    out = [Uint32(0), Uint32(0)]
    for j in cutlass.range_constexpr(cute.size(words) // 2):
        for r in cutlass.range_constexpr(2):
            nz = ((words[2 * j + r] & Uint32(0x7FFF7FFF)) + Uint32(0x7FFF7FFF)) & Uint32(0x80008000)
            out[r] = (out[r] | (((nz >> Uint32(15)) & Uint32(1)) << Uint32(2 * j))
                      | ((nz >> Uint32(31)) << Uint32(2 * j + 1)))
    return out


@cute.jit
def flag_bits_sm90(flags: cute.Tensor, lane: Int32, tile_n: cutlass.Constexpr) -> Uint32:
    """This thread's key flags (one byte per key of the ``tile_n``-key tile) as a word in ``visible_bits_sm90``'s
    column order, for the SM90 wgmma accumulator: lane ``lane``'s register column c is tile column
    8 (c // 2) + 2 q + c % 2, q = lane % 4; one 16-bit load per column pair. (Four ballots over the flag words
    instead spilled 56-88 B at 240 registers, d 192.)"""
    f16 = cute.recast_tensor(flags, cutlass.Uint16)
    base = lane % 4
    bits = Uint32(0)
    for j in cutlass.range_constexpr(tile_n // 8):
        f = Uint32(f16[base + 4 * j])
        bits = bits | ((f & Uint32(1)) << Uint32(2 * j)) | (((f >> Uint32(8)) & Uint32(1)) << Uint32(2 * j + 1))
    return bits


@cute.jit
def row_poison_bits(vis: list, flagged: Uint32, quad: cutlass.Constexpr) -> Int32:
    """Bit r set where register row r sees a flagged key (``vis[r] & flagged``) in this thread or in any of the
    ``quad`` adjacent lanes that share the row. Warp-uniform call (shuffles)."""
    bits = Int32(0)
    for r in cutlass.range_constexpr(len(vis)):
        h = Int32(0) if (vis[r] & flagged) == Uint32(0) else Int32(1)
        for k in cutlass.range_constexpr(quad.bit_length() - 1):
            h = h | cute.arch.shuffle_sync_bfly(h, offset=1 << k)
        bits = bits | (h << r)
    return bits


@cute.jit
def poison_acc(acc_mn: cute.Tensor, bits: Int32):
    """NaN into this thread's part of accumulator row r for each bit r of ``bits`` (``row_poison_bits``); every
    later rescale and MMA keeps the row NaN."""
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        if (bits >> r) & 1 != 0:
            for d in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                acc_mn[r, d] = Float32.nan
