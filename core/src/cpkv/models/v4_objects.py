"""The KV objects a DeepSeek-V4 layer keeps (contract rule 33) and their bytes.

Per layer, by kind:

* **compressed entries** (page-owned; one per ``m`` tokens): the main entry (``head_dim``) on
  CSA and HCA layers, the index key (``index_head_dim``) on CSA layers;
* **window rows** (a tail object): the last ``W - 1`` K = V rows (``head_dim``), every layer,
  the MTP draft layer's too when it runs (it is sliding-only: nothing else);
* **carry state** (a tail object): per compressor the open window's raw ``(kv, gate)`` rows
  (at most ``m - 1`` rows of the compressor's width, 2d on CSA), and on CSA the last complete
  window's Ca half (``m`` rows of ``(kv, gate)`` at ``d``).

The request's tail objects have one holder: the rank that computes the request's last token
(the owner of its last unit), which is the rank that has them after the forward (rule 36).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .v4_config import CSA, HCA, SWA, DeepseekV4Config

__all__ = [
    "V3_2_FP8_BYTES_PER_TOKEN",
    "V4_FLASH",
    "V4_PRO",
    "V4Object",
    "fp8_bytes_per_token",
    "v4_objects",
    "v4_per_token_bytes",
]

ObjectKind = Literal["entries", "window_rows", "carry_state"]


@dataclass(frozen=True)
class V4Object:
    """One KV object of one layer."""

    layer: int
    name: str  # "main", "index", "window", "carry.main", "carry.index"
    kind: ObjectKind
    rate: int  # tokens per entry (entries); 0 otherwise
    row_bytes: int  # bytes per entry / row at the pool's element size
    rows: int  # tail objects: rows held per request (0 for entries: they scale with length)

    def bytes_for(self, length: int) -> int:
        """Bytes of this object for a request of ``length`` tokens (entries: complete ones)."""
        if self.kind == "entries":
            return (length // self.rate) * self.row_bytes
        return self.rows * self.row_bytes


def v4_objects(cfg: DeepseekV4Config, elem_bytes: int = 4, mtp: bool = False
               ) -> tuple[V4Object, ...]:
    """Every layer's objects at ``elem_bytes`` per value (4: the fp32 pool the tests use);
    ``mtp``: the MTP draft layer's window rows too (layer ``num_hidden_layers``).

    The carry state is counted at its most (``m - 1`` open rows) and kept in fp32 whatever
    the pool (vLLM does the same: its pooling is a softmax over raw projections)."""
    out: list[V4Object] = []
    hd, w = cfg.head_dim, cfg.sliding_window
    for i, kind in enumerate(cfg.layer_types):
        out.append(V4Object(i, "window", "window_rows", 0, hd * elem_bytes, w - 1))
        comps: list[tuple[str, int, int, bool]] = []
        if kind == CSA:
            comps = [("main", cfg.compress_rate_csa, hd, True),
                     ("index", cfg.compress_rate_csa, cfg.index_head_dim, True)]
        elif kind == HCA:
            comps = [("main", cfg.compress_rate_hca, hd, False)]
        for name, m, d, overlap in comps:
            out.append(V4Object(i, name, "entries", m, d * elem_bytes, 0))
            width = 2 * d if overlap else d
            rows_state = 2 * width * (m - 1) + (2 * d * m if overlap else 0)  # kv and gate
            out.append(V4Object(i, f"carry.{name}", "carry_state", 0, 4, rows_state))
    if mtp:
        out.append(V4Object(cfg.num_hidden_layers, "window", "window_rows", 0, hd * elem_bytes,
                            w - 1))
    return tuple(out)


def v4_per_token_bytes(cfg: DeepseekV4Config, elem_bytes: int = 1) -> float:
    """Compressed-entry bytes per token of context over all layers (the part that grows with
    the length; 1 byte a value approximates the FP8 pool, without its scales)."""
    return sum(o.row_bytes / o.rate for o in v4_objects(cfg, elem_bytes) if o.kind == "entries")


#: the full models' schedules (a tiny checkpoint's dims are not the FP8 layout's)
V4_FLASH: tuple[str, ...] = (SWA,) * 2 + (CSA, HCA) * 20 + (CSA,)
V4_PRO: tuple[str, ...] = (HCA,) * 2 + (CSA, HCA) * 29 + (CSA,)
#: DeepSeek-V3.2's FP8 bytes per token of context: 61 layers of the 656-B latent and the 132-B
#: index key
V3_2_FP8_BYTES_PER_TOKEN = 61.0 * (656 + 132)


def fp8_bytes_per_token(layer_types: Sequence[str], csa: int = 4, hca: int = 128) -> float:
    """Compressed-entry bytes per token of context of a V4 schedule in the FP8 layout (per
    layer: the 584-B main entry over its rate, the 132-B index key over 4 on CSA layers)."""
    return sum(584 / csa + 132 / csa if t == CSA else 584 / hca if t == HCA else 0
               for t in layer_types)
