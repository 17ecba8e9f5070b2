"""Fixed-capacity per-batch decode metadata, for decode steps captured in CUDA graphs.

A captured graph replays with the tensors it was captured with: the metadata lives in buffers
of fixed shape allocated once (``max_requests`` x ``max_pages``) and each step writes the new
values into them in place (:meth:`DecodeMetadata.fill`: one host-to-device copy per buffer, no
new tensor, no sync). Unused entries are padding the kernels mask: block table ``-1``, sequence
length 0; a padded write row is ``pad_row``, a token row of a scratch page the engine keeps out
of its allocator, so that a captured ``cpkv::put_bytes`` over all ``max_requests`` rows writes
the padding there and nowhere else (a ``-1`` row would index the last page).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["DecodeMetadata"]


class DecodeMetadata:
    """Block table, sequence lengths and this step's KV write rows of up to ``max_requests``
    requests of up to ``max_pages`` pages each (decode: one new token per request).

    Attributes:
        block_table: int32 [max_requests, max_pages]: request r's page k's slot, -1 padded.
        seq_lens: int32 [max_requests]: keys of request r after this step's token, 0 padded.
        write_rows: int64 [max_requests]: token row (slot x ps + offset) the new token's KV
            goes to, ``pad_row`` padded (the ``rows`` of ``cpkv::put_bytes``).
        num_requests: requests of the last :meth:`fill` (host int).
    """

    def __init__(self, max_requests: int, max_pages: int, page_size: int,
                 device: torch.device | str = "cpu", *, pad_row: int) -> None:
        if max_requests < 1 or max_pages < 1 or page_size < 1 or pad_row < 0:
            raise ValueError(f"need positive capacities and a scratch row >= 0, got "
                             f"max_requests={max_requests}, max_pages={max_pages}, "
                             f"page_size={page_size}, pad_row={pad_row}")
        self.pad_row = pad_row
        self.max_requests, self.max_pages, self.page_size = max_requests, max_pages, page_size
        self.block_table = torch.full((max_requests, max_pages), -1, dtype=torch.int32,
                                      device=device)
        self.seq_lens = torch.zeros(max_requests, dtype=torch.int32, device=device)
        self.write_rows = torch.full((max_requests,), -1, dtype=torch.int64, device=device)
        self.num_requests = 0

    def fill(self, slots: Sequence[Sequence[int]], seq_lens: Sequence[int]) -> None:
        """This step's values, in place: per request its page slots (logical order) and its
        keys after the new token (the new token is at position ``seq_len - 1``).

        Raises:
            ValueError: more requests or pages than the capacity, or pages that do not cover
                a request's keys (nothing written).
        """
        n, ps = len(slots), self.page_size
        if n != len(seq_lens) or n > self.max_requests:
            raise ValueError(f"{n} requests ({len(seq_lens)} lengths) for a capacity of "
                             f"{self.max_requests}")
        for r, (s, length) in enumerate(zip(slots, seq_lens, strict=True)):
            if len(s) > self.max_pages or length < 1 or len(s) * ps < length:
                raise ValueError(f"request {r}: {len(s)} pages for {length} keys (capacity "
                                 f"{self.max_pages} pages of {ps})")
        table = torch.full((self.max_requests, self.max_pages), -1, dtype=torch.int32)
        lens = torch.zeros(self.max_requests, dtype=torch.int32)
        rows = torch.full((self.max_requests,), self.pad_row, dtype=torch.int64)
        for r, (s, length) in enumerate(zip(slots, seq_lens, strict=True)):
            table[r, :len(s)] = torch.tensor(list(s), dtype=torch.int32)
            lens[r] = length
            rows[r] = s[(length - 1) // ps] * ps + (length - 1) % ps
        nb = self.block_table.device.type == "cuda"
        self.block_table.copy_(table, non_blocking=nb)
        self.seq_lens.copy_(lens, non_blocking=nb)
        self.write_rows.copy_(rows, non_blocking=nb)
        self.num_requests = n
