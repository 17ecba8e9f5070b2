"""KV storage formats: bytes per token and per page for the latent and index-K buffers."""

from __future__ import annotations

from enum import StrEnum
from typing import Self

from pydantic import Field, model_validator

from ._base import Contract, PageSize

__all__ = ["KVDtype", "KVFormat"]


class KVDtype(StrEnum):
    BF16 = "bf16"
    FP8 = "fp8"
    #: reference format for exactness tests (not in the contract's table): values as float32
    FP32 = "fp32"


class MaterializeMode(StrEnum):
    """How a pool builds a layer's full view (chosen once, at pool construction).

    ``REPLICA``: every rank holds every page (``kv.shared = false``, the baseline); the view
    reads the pool in place. ``ALL_GATHER``: owners' pages move by one all-gather; the view reads
    the receive buffer in place. ``P2P``: pages live in peer-mapped memory and each view row is
    read from its owner in one pass. ``AUTO`` (a request, never a pool's mode): ``P2P`` on GPUs
    whose ranks map each other's memory, else ``ALL_GATHER`` (decided alike on every rank).
    """

    REPLICA = "replica"
    ALL_GATHER = "all_gather"
    P2P = "p2p"
    AUTO = "auto"


class KVFormat(Contract):
    """Byte layout of one token of one layer in the pool (the contract's formats table).

    bf16: latent = (kv_lora_rank + rope_dim) x 2 B, index-K = index_head_dim x 2 B.
    fp32 (reference format for exactness tests): the same with 4 B per value.
    fp8:  latent = kv_lora_rank x 1 B (e4m3) + kv_lora_rank / quant_block fp32 scales
          + rope_dim x 2 B (rope stays bf16); index-K = index_head_dim x 1 B + one fp32 scale.
    """

    dtype: KVDtype = KVDtype.BF16
    kv_lora_rank: int = Field(512, ge=1)
    rope_dim: int = Field(64, ge=0)
    index_head_dim: int = Field(128, ge=1)
    quant_block: int = Field(128, ge=1, description="fp8 latent: one fp32 scale per this many dims")
    page_size: PageSize = 64

    @model_validator(mode="after")
    def _check_blocks(self) -> Self:
        if self.dtype is KVDtype.FP8 and self.kv_lora_rank % self.quant_block:
            raise ValueError(
                f"fp8 latent needs kv_lora_rank divisible by quant_block, "
                f"got kv_lora_rank={self.kv_lora_rank}, quant_block={self.quant_block}"
            )
        return self

    @property
    def latent_bytes_per_token(self) -> int:
        if self.dtype is not KVDtype.FP8:
            return self._width * (self.kv_lora_rank + self.rope_dim)
        return self.kv_lora_rank + 4 * (self.kv_lora_rank // self.quant_block) + 2 * self.rope_dim

    @property
    def index_bytes_per_token(self) -> int:
        if self.dtype is not KVDtype.FP8:
            return self._width * self.index_head_dim
        return self.index_head_dim + 4

    @property
    def _width(self) -> int:
        return 4 if self.dtype is KVDtype.FP32 else 2

    @property
    def bytes_per_token(self) -> int:
        """Latent plus index-K bytes of one token of one layer."""
        return self.latent_bytes_per_token + self.index_bytes_per_token

    @property
    def latent_page_bytes(self) -> int:
        return self.latent_bytes_per_token * self.page_size

    @property
    def index_page_bytes(self) -> int:
        return self.index_bytes_per_token * self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer, latent and index-K together."""
        return self.bytes_per_token * self.page_size

    @classmethod
    def deepseek_v32(cls, dtype: KVDtype | str = KVDtype.FP8, page_size: int = 64) -> KVFormat:
        """DeepSeek-V3.2 dimensions: latent 512 + rope 64, index-K 128, 64-token pages."""
        return cls(dtype=KVDtype(dtype), page_size=page_size)
