"""Split and gather of per-token rows (hidden states, new KV rows) across the CP group.

``RowLayout`` is built once per batch from the plan: the natural-order rows this rank computes
(split), the permutation that turns the rank-major padded all-gather back into natural order
(rerange, rule 8/24) and each local row's position. All are device tensors, expanded on the
device from one host entry per row block (:func:`expand_ranges`), so neither the batch's host
work nor the per-layer path grows with the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from cpkv.contracts import CPPlan

if TYPE_CHECKING:
    from cpkv.comm import CPGroup
    from cpkv.ops import OpTable

__all__ = ["Block", "RowLayout", "expand_ranges", "to_device_at_once"]


class Block(NamedTuple):
    """A run of one rank's local rows: request ``request``, absolute positions [start, end),
    local rows [row, row + end - start)."""

    request: int
    start: int
    end: int
    row: int


def to_device_at_once(host: Sequence[torch.Tensor], device: torch.device | str
                      ) -> list[torch.Tensor]:
    """1-D host tensors of one dtype on ``device`` in one copy (views of one buffer; on a CPU
    the tensors themselves): per-batch index tensors, without a copy per tensor. On a GPU the
    copy is from pinned memory and does not block the host: an engine preparing the next batch
    while the GPU runs this one does not wait for it (a pageable copy would, in stream order)."""
    device = torch.device(device)
    if device.type == "cpu":
        return list(host)
    sizes = [t.numel() for t in host]
    staged = torch.cat(list(host)) if len(host) > 1 else host[0]
    if device.type == "cuda":
        staged = staged.pin_memory()  # torch's caching host allocator: reused, kept until copied
    return list(torch.split(staged.to(device, non_blocking=True), sizes))


def expand_ranges(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``starts[b] + i`` for ``i < lengths[b]``, blocks concatenated: int64 [total] on their
    device (``total = lengths.sum()``, a host integer the caller knows: no host sync)."""
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=starts.device)
    before = torch.cumsum(lengths, 0) - lengths
    return (torch.repeat_interleave(starts - before, lengths, output_size=total)
            + torch.arange(total, dtype=torch.int64, device=starts.device))


@dataclass(frozen=True)
class RowLayout:
    """Where this rank's rows come from and how gathered rows go back to natural order."""

    rank: int
    cp_size: int
    num_local: int
    max_rank_len: int
    #: int64 [num_local]: natural-order row of each local row
    local_index: torch.Tensor
    #: int64 [num_tokens]: row of natural token n inside the rank-major padded gather
    perm: torch.Tensor
    #: int64 [num_local]: absolute position of each local row in its request
    positions: torch.Tensor
    #: this rank's row blocks in local order (host), and their lengths on the device
    blocks: tuple[Block, ...]
    block_lengths: torch.Tensor

    @classmethod
    def build(cls, plan: CPPlan, rank: int, device: torch.device | str = "cpu") -> RowLayout:
        """From the plan's row blocks, once per batch: the host builds one entry per block
        (one copy to the device) and the rows are expanded there, so the host work does not
        grow with the tokens (64K rows cost 3-14 ms of host tensor ops on a GPU machine's CPU
        before, most of it waking the CPU's worker threads). Equal to
        ``plan.local_row_indices(rank)`` and ``plan.gather_permutation()``."""
        offs = plan.natural_offsets()
        width = plan.max_rank_len
        per_rank: list[list[tuple[int, int, int]]] = [[] for _ in range(plan.cp_size)]
        for i, req in enumerate(plan.requests):  # (request, position) order within each rank
            for seg in req.segments:
                per_rank[seg.rank].append((i, seg.start, seg.end))
        nat: list[int] = []  # per block, rank-major: natural row of its first row
        slot: list[int] = []  # its first row in the padded gather
        lens: list[int] = []
        mine: list[Block] = []
        first = 0
        for r, blocks in enumerate(per_rank):
            if r == rank:
                first = len(lens)
            j = 0
            for i, start, end in blocks:
                nat.append(offs[i] - plan.requests[i].prefix_len + start)
                slot.append(r * width + j)
                lens.append(end - start)
                if r == rank:
                    mine.append(Block(i, start, end, j))
                j += end - start
        nb = len(lens)
        meta, = to_device_at_once([torch.tensor([*nat, *slot, *lens, *(b.start for b in mine)],
                                                dtype=torch.int64)], device)
        nat_d, slot_d, lens_d, mine_start = meta[:nb], meta[nb:2 * nb], meta[2 * nb:3 * nb], meta[3 * nb:]
        total = plan.num_tokens
        gathered_nat = expand_ranges(nat_d, lens_d, total)  # rank-major, every rank's rows
        perm = torch.empty(total, dtype=torch.int64, device=meta.device)
        perm[gathered_nat] = expand_ranges(slot_d, lens_d, total)
        num_local = sum(b.end - b.start for b in mine)
        # rank-major: this rank's rows follow the rows of the ranks before it
        before = sum(lens[:first])
        my_lens = lens_d[first:first + len(mine)]
        return cls(rank=rank, cp_size=plan.cp_size, num_local=num_local, max_rank_len=width,
                   local_index=gathered_nat[before:before + num_local],
                   perm=perm, positions=expand_ranges(mine_start, my_lens, num_local),
                   blocks=tuple(mine), block_lengths=my_lens)

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        """A per-block value (``values``: [blocks] on the device, in :attr:`blocks` order) for
        every local row: [num_local], no host sync."""
        return torch.repeat_interleave(values, self.block_lengths, output_size=self.num_local)

    def _check_local(self, local: torch.Tensor) -> None:
        if local.shape[0] != self.num_local:
            raise ValueError(f"rank {self.rank} has {self.num_local} local rows, got a tensor of "
                             f"{local.shape[0]}")

    def split(self, x: torch.Tensor, ops: OpTable) -> torch.Tensor:
        """This rank's rows of a natural-order tensor ``x`` [num_tokens, ...]."""
        return ops.page_gather(x, self.local_index)

    def gather(self, local: torch.Tensor, group: CPGroup, ops: OpTable) -> torch.Tensor:
        """Every rank's rows back in natural order: one all-gather, then one rerange pass (on a
        one-rank group the local rows are every row in natural order: ``local`` itself)."""
        self._check_local(local)
        if self.cp_size == 1:
            return local
        gathered = group.all_gather_rows(local, self.max_rank_len)
        return ops.rerange(gathered, self.perm)

    def gather_rows(self, local: torch.Tensor, rows: torch.Tensor, group: CPGroup) -> torch.Tensor:
        """The natural-order rows ``rows`` (int64 ``[m]`` on the group's device) of every rank's
        rows, without gathering the rest: ``gather(local)[rows]`` for ``m`` rows' bytes (a
        prefill's last rows: a few rows instead of the whole batch's hidden states).

        Each rank puts the selected rows it owns in an ``[m, ...]`` buffer (the others are never
        read), one all-gather moves ``size * m`` rows, and each row is taken from its owner's
        block: exact, device ops only (no host sync)."""
        self._check_local(local)
        if self.cp_size == 1:
            return local[rows]
        slot = self.perm[rows]  # row in the rank-major padded gather
        owner, at = slot // self.max_rank_len, slot % self.max_rank_len
        m = rows.numel()
        mine = local[at.clamp(max=max(self.num_local - 1, 0))] if self.num_local else \
            local.new_zeros((m, *local.shape[1:]))
        gathered = group.all_gather_rows(mine.contiguous(), m)
        return gathered[owner * m + torch.arange(m, device=rows.device)]
