"""The radix-select pieces the top-k kernels and the fused indexer top-k share: fp32 logits as
order-preserving int32 keys (:func:`ord_key`, its inverse :func:`key_value`), rounds of 8-bit
histograms (:func:`radix_digit`, :func:`radix_step`: 4 rounds find the k-th key), a round over
keys in memory and the copy of one 16-bit bin (``COMPACT``), a row's clipped range and the
listing of a row holding at most k keys."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bin_count", "copied_rounds", "copy_bin", "key_round", "key_value", "long_row",
           "ord_key", "pick_bin", "radix_digit", "radix_step", "row_range", "sample_floor",
           "sample_margin", "select_row", "take_ranked"]


@triton.jit
def ord_key(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 and 0.0 map alike; -inf is the
    smallest key of every non-NaN value)."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def key_value(s):
    """The fp32 whose order key (:func:`ord_key`) is ``s`` (the map is its own inverse on the
    bits; -0.0 comes back as 0.0)."""
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def pick_bin(hist, need, NB: tl.constexpr):
    """The bin holding the need-th largest key, and how many keys lie in higher bins."""
    above = tl.sum(hist, axis=0) - tl.cumsum(hist, 0)  # keys in higher bins
    hit = (above < need) & (above + hist >= need)  # exactly one bin
    b = tl.sum(tl.where(hit, tl.arange(0, NB), 0), axis=0)
    return b, tl.sum(tl.where(hit, above, 0), axis=0)


@triton.jit
def radix_digit(s, m, prefix, p: tl.constexpr):
    """Round p (0-3) of an 8-bit radix select over keys s: the digit, and the mask narrowed to
    the keys whose higher bits match the prefix found so far."""
    if p == 0:  # the sign bit flipped: digits ascend with the key
        d = ((s >> 24) & 255) ^ 128
    else:
        m = m & (((s ^ prefix) & -(1 << (32 - 8 * p))) == 0)
        d = (s >> (24 - 8 * p)) & 255
    return d, m


@triton.jit
def radix_step(hist, need, prefix, p: tl.constexpr):
    """After round p's histogram: keys still to take among those matching the longer prefix."""
    b, above = pick_bin(hist, need, 256)
    if p == 0:
        b = b ^ 128
    return need - above, prefix | (b << (24 - 8 * p))


@triton.jit
def row_range(ks_ptr, ke_ptr, row, T):
    ks = tl.load(ks_ptr + row)
    ke = tl.load(ke_ptr + row)
    start = tl.minimum(tl.maximum(ks, 0), T).to(tl.int32)
    end = tl.minimum(tl.maximum(ke, 0), T).to(tl.int32)
    return start, end


@triton.jit
def long_row(ks_ptr, ke_ptr, out_ptr, row, T, K, KP: tl.constexpr):
    """Whether a row holds more than K keys (its select is the caller's); a row holding at most
    K keys is listed here: its columns ascending, -1 padded."""
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    count = tl.maximum(end - start, 0)
    if count <= K:
        for s0 in range(0, K, KP):
            slot = s0 + tl.arange(0, KP)
            tl.store(out_ptr + row * K + slot, tl.where(slot < count, start + slot, -1),
                     mask=slot < K)
    return count > K


@triton.jit
def key_round(kptr, nk, prefix, p: tl.constexpr, RB: tl.constexpr, FLOATS: tl.constexpr):
    """Round p's histogram over ``nk`` order keys at ``kptr`` (int32; ``FLOATS``: fp32 values,
    keyed here)."""
    hist = tl.zeros([256], tl.int32)
    for c0 in range(0, nk, RB):
        i = c0 + tl.arange(0, RB)
        m = i < nk
        x = tl.load(kptr + i, mask=m, other=0)
        s = ord_key(x) if FLOATS else x
        d, m = radix_digit(s, m, prefix, p)
        hist += tl.histogram(d, 256, mask=m)
    return hist


@triton.jit
def copy_bin(kptr, nput, s, m, prefix):
    """Append the keys ``s`` (masked by m) whose top 16 bits are the prefix's to ``kptr`` from
    place ``nput``, in order; the new count."""
    put = m & (((s ^ prefix) & -65536) == 0)
    tl.store(kptr + nput + tl.cumsum(put.to(tl.int32), 0) - 1, s, mask=put)
    return nput + tl.sum(put.to(tl.int32), axis=0)


@triton.jit
def copied_rounds(kptr, nk, need, prefix, RB: tl.constexpr):
    """Radix rounds 2 and 3 over the ``nk`` keys a select copied to ``kptr`` (:func:`copy_bin`),
    between the barriers that make the copy visible to every thread and keep the output from
    overwriting it before every thread has read it: need, prefix and round 3's histogram."""
    tl.debug_barrier()
    for p in tl.static_range(2, 4):
        hist = key_round(kptr, nk, prefix, p, RB, False)
        need, prefix = radix_step(hist, need, prefix, p)
    tl.debug_barrier()
    return need, prefix, hist


@triton.jit
def bin_count(hist, prefix, p: tl.constexpr):
    """How many keys round p's histogram put in the bin the prefix chose (the keys matching
    the prefix's top ``8 (p + 1)`` bits)."""
    b = (prefix >> (24 - 8 * p)) & 255
    return tl.sum(tl.where(tl.arange(0, 256) == b, hist, 0), axis=0)


@triton.jit
def take_ranked(orow, wpos, eq_seen, s, m, vals, prefix, need):
    """A select's last pass over one block of keys ``s`` (mask ``m``, in column order): the keys
    above the k-th key ``prefix`` and the first ``need`` equal to it (``eq_seen`` of them in
    earlier blocks), their ``vals`` written in order from ``orow + wpos``; the new ``wpos`` and
    ``eq_seen``."""
    eq = m & (s == prefix)
    eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), 0)  # 1-based among equal keys
    take = ((m & (s > prefix)) | (eq & (eq_rank <= need))).to(tl.int32)
    tl.store(orow + wpos + tl.cumsum(take, 0) - 1, vals, mask=take != 0)
    return wpos + tl.sum(take, axis=0), eq_seen + tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def select_row(keys, src, start, end, orow, need, BLOCK: tl.constexpr, FLAG_A: tl.constexpr,
               FLAG_B: tl.constexpr):
    """The exact select over a row's columns ``[start, end)``, BLOCK a step, its keys
    recomputed in every pass as ``keys(src, cols, mask, FLAG_A, FLAG_B)`` (int32 order keys;
    the flags: compile-time options of ``keys``): 4 radix rounds find the need-th largest key,
    then the columns of the keys above it and of the first ones equal to it are written in
    column order from ``orow``."""
    prefix = tl.zeros([], tl.int32)  # the need-th key's bits found so far
    for p in tl.static_range(4):
        hist = tl.zeros([256], tl.int32)
        for c0 in range(start, end, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < end
            d, m = radix_digit(keys(src, cols, m, FLAG_A, FLAG_B), m, prefix, p)
            hist += tl.histogram(d, 256, mask=m)
        need, prefix = radix_step(hist, need, prefix, p)
    wpos = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    for c0 in range(start, end, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        m = cols < end
        s = keys(src, cols, m, FLAG_A, FLAG_B)
        wpos, eq_seen = take_ranked(orow, wpos, eq_seen, s, m, cols, prefix, need)


@triton.jit
def sample_margin(est):
    """The margin around a sample's estimated place of the k-th key (``est`` sample keys at or
    above it): 4 standard deviations of the estimate, plus 8."""
    return (4.0 * tl.sqrt(est.to(tl.float32) + 1.0)).to(tl.int32) + 8


@triton.jit
def sample_floor(s, valid, est, n, ROUNDS: tl.constexpr):
    """A row's candidates' floor from the order keys ``s`` of its sample (mask ``valid``, ``n``
    of them inside the row's range): the sample key :func:`sample_margin` below the k-th key's
    estimated place ``est`` (descending), by ROUNDS radix rounds (fewer than 4 lower it: its low
    bits cleared); -inf when the sample has no key at that place."""
    place = est + sample_margin(est)  # 0-based, descending
    need = place + 1  # the floor is the need-th largest sample key
    prefix = tl.zeros([], tl.int32)
    for p in tl.static_range(ROUNDS):
        d, m = radix_digit(s, valid, prefix, p)
        need, prefix = radix_step(tl.histogram(d, 256, mask=m), need, prefix, p)
    return tl.where(place < n, key_value(prefix), float("-inf"))
