"""KV storage formats: bytes per token and per page for the latent and index-K buffers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Self

from pydantic import Field, model_validator

from ._base import Contract, PageSize

__all__ = ["BufferLayout", "KVDtype", "KVFormat", "LayerFormats", "layer_formats", "pages_nbytes"]


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


class PageLayout(StrEnum):
    """How a page's bytes are ordered (a page is always one block of ``page_bytes``).

    ``TOKEN_MAJOR``: each token's latent bytes then its index-K bytes (one row per token: token
    rows are uniform, every token-row op addresses them directly). ``PART_MAJOR``: the page's
    ``page_size`` latent rows, then its ``page_size`` index-K rows: the latent of a page is one
    contiguous [page_size, latent bytes] block, the layout FlashMLA's fp8 sparse decode reads in
    place (a 64-token fp8 page: 64 x 656 latent then 64 x 132 index-K, 50,432 B).
    """

    TOKEN_MAJOR = "token_major"
    PART_MAJOR = "part_major"


class BufferLayout(StrEnum):
    """How a layer's page bytes lie in its tensors (``kv.layout``; :mod:`cpkv.kv.buffers`).

    ``TOKEN_MAJOR`` / ``PART_MAJOR``: cpkv's one-tensor layouts (one uint8 ``[pages, ps, B]``
    tensor per layer, a page one block in that :class:`PageLayout`). ``TWO_PART``: the engines'
    layout (SGLang's ``NSATokenToKVPool``, vLLM's ``DeepseekV32IndexerCache``): per layer a
    latent tensor ``[pages, ps, latent bytes]`` and an index-K tensor ``[pages, ps x index
    bytes]`` in DeepGEMM's page order (the page's ``ps x D`` values, then its ``ps`` scales); a
    layer without index-K has the latent tensor only.
    """

    TOKEN_MAJOR = "token_major"
    PART_MAJOR = "part_major"
    TWO_PART = "two_part"

    @property
    def page_layout(self) -> PageLayout | None:
        """cpkv's one-tensor :class:`PageLayout` of this layout (None for ``two_part``)."""
        return None if self is BufferLayout.TWO_PART else PageLayout(self.value)


class KVFormat(Contract):
    """Byte layout of one token of one layer in the pool (the contract's formats table).

    bf16: latent = (kv_lora_rank + rope_dim) x 2 B, index-K = index_head_dim x 2 B.
    fp32 (reference format for exactness tests): the same with 4 B per value.
    fp8:  latent = kv_lora_rank x 1 B (e4m3) + kv_lora_rank / quant_block fp32 scales
          + rope_dim x 2 B (rope stays bf16); index-K = index_head_dim x 1 B + one fp32 scale.

    ``index_k = False`` is a layer that caches no index-K (a GLM-5 shared-indexer layer reuses
    the previous full layer's top-k selection): its index bytes are 0, a token is its latent only.
    A pool holds one format per layer (:func:`layer_formats`).
    """

    dtype: KVDtype = KVDtype.BF16
    kv_lora_rank: int = Field(512, ge=1)
    rope_dim: int = Field(64, ge=0)
    index_head_dim: int = Field(128, ge=1)
    quant_block: int = Field(128, ge=1, description="fp8 latent: one fp32 scale per this many dims")
    page_size: PageSize = 64
    index_k: bool = Field(True, description="the layer caches index-K (False: latent only)")

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
        if not self.index_k:
            return 0
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

    def latent_only(self) -> KVFormat:
        """This format without index-K (a shared-indexer layer's)."""
        return self.model_copy(update={"index_k": False})

    def with_index(self) -> KVFormat:
        """This format with index-K (a full layer's)."""
        return self.model_copy(update={"index_k": True})

    @classmethod
    def deepseek_v32(cls, dtype: KVDtype | str = KVDtype.FP8, page_size: int = 64) -> KVFormat:
        """DeepSeek-V3.2 dimensions: latent 512 + rope 64, index-K 128, 64-token pages."""
        return cls(dtype=KVDtype(dtype), page_size=page_size)


#: one stored format per KV layer, in layer order (:func:`layer_formats`)
LayerFormats = tuple[KVFormat, ...]


def layer_formats(fmt: KVFormat | Sequence[KVFormat], num_layers: int) -> LayerFormats:
    """One format per layer: ``fmt`` for every layer, or the sequence given (one per layer).

    The layers of one pool differ only in whether they cache index-K: dtype, latent and index
    dimensions and page size are the pool's.

    Raises:
        ValueError: a sequence whose length is not ``num_layers``, or whose formats differ in
            anything but ``index_k``.
    """
    if isinstance(fmt, KVFormat):
        return (fmt,) * num_layers
    fmts = tuple(fmt)
    if len(fmts) != num_layers:
        raise ValueError(f"need one KV format per layer: {num_layers} layers, {len(fmts)} formats")
    if fmts:
        base = fmts[0].with_index()
        odd = [i for i, f in enumerate(fmts) if f.with_index() != base]
        if odd:
            raise ValueError(f"the layers of one pool differ only in index_k; layers {odd[:8]} "
                             f"differ from layer 0 ({base!r})")
    return fmts


def pages_nbytes(fmts: Sequence[KVFormat], num_pages: int,
                 layers: Iterable[int] | None = None) -> int:
    """Bytes of ``num_pages`` pages of every layer (or of ``layers``), each layer in its own
    format (latent and index-K; a layer without index-K its latent only): what a pool holds per
    page, what a transfer part moves."""
    lays = range(len(fmts)) if layers is None else layers
    return num_pages * sum(fmts[layer].page_bytes for layer in lays)
