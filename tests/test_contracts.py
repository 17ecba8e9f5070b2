"""Contract models: the formats table, extents, owner maps, and messages that show the values."""

from __future__ import annotations

import pytest
from hypothesis import given
from pydantic import ValidationError

from cpkv.contracts import (
    Availability,
    FallbackReason,
    KVDtype,
    KVFormat,
    OwnerMap,
    PageExtent,
    cdiv,
    layer_formats,
)
from cpkv.testing.strategies import owner_maps, page_extents


def test_deepseek_v32_formats_table() -> None:
    fp8, bf16 = KVFormat.deepseek_v32("fp8"), KVFormat.deepseek_v32("bf16")
    assert (fp8.latent_bytes_per_token, fp8.index_bytes_per_token) == (656, 132)
    assert (bf16.latent_bytes_per_token, bf16.index_bytes_per_token) == (1152, 256)
    assert fp8.index_page_bytes == 8448  # "a 64-token index-K page is 8448 B"
    assert fp8.page_bytes == 64 * (656 + 132)
    # 61 layers: ~48 KB per token in fp8
    assert round(61 * fp8.bytes_per_token / 1000) == 48


@pytest.mark.parametrize("dtype", list(KVDtype))
def test_a_latent_only_layer_has_no_index_bytes(dtype: KVDtype) -> None:
    full = KVFormat.deepseek_v32(dtype)
    shared = full.latent_only()
    assert (shared.index_bytes_per_token, shared.index_page_bytes) == (0, 0)
    assert shared.bytes_per_token == shared.latent_bytes_per_token == full.latent_bytes_per_token
    assert shared.page_bytes == full.latent_page_bytes and shared.with_index() == full
    assert layer_formats(full, 3) == (full, full, full)
    assert layer_formats([full, shared], 2) == (full, shared)
    with pytest.raises(ValueError, match="2 layers, 1 formats"):
        layer_formats([full], 2)
    with pytest.raises(ValueError, match=r"layers \[1\] differ"):
        layer_formats([full, KVFormat.deepseek_v32(dtype, page_size=32)], 2)


def test_fp8_needs_whole_quant_blocks() -> None:
    with pytest.raises(ValidationError, match="kv_lora_rank=100, quant_block=128"):
        KVFormat(dtype=KVDtype.FP8, kv_lora_rank=100)
    assert KVFormat(dtype=KVDtype.BF16, kv_lora_rank=100).latent_bytes_per_token == 2 * 164


def test_formats_are_frozen_and_closed() -> None:
    f = KVFormat()
    with pytest.raises(ValidationError):
        f.page_size = 32  # type: ignore[misc]
    with pytest.raises(ValidationError, match="extra"):
        KVFormat(dtyp="fp8")  # type: ignore[call-arg]


@given(page_extents())
def test_extent_coverage_is_whole_pages(ext: PageExtent) -> None:  # rule 28
    assert ext.num_pages == cdiv(ext.valid_tokens, ext.page_size)
    if ext.num_pages:
        assert 0 < ext.tail_valid <= ext.page_size
    assert PageExtent.model_validate(ext.model_dump()) == ext


@pytest.mark.parametrize(("pages", "valid"), [(2, 64), (2, 129), (0, 3), (1, 0)])
def test_extent_rejects_valid_lengths_outside_its_last_page(pages: int, valid: int) -> None:
    with pytest.raises(ValidationError, match=f"valid_tokens={valid}"):
        PageExtent(page_size=64, num_pages=pages, valid_tokens=valid)


@given(owner_maps())
def test_owner_map_pages_partition(om: OwnerMap) -> None:
    pages = [p for r in range(om.cp_size) for p in om.pages_of(r)]
    assert sorted(pages) == list(range(len(om.owners)))


def test_owner_map_rejects_ranks_out_of_group() -> None:
    with pytest.raises(ValidationError, match=r"cp_size=2; \(page, rank\): \[\(1, 3\)\]"):
        OwnerMap(cp_size=2, owners=(0, 3))
    assert OwnerMap.interleaved(5, 2).owners == (0, 1, 0, 1, 0)


def test_unavailable_needs_a_reason() -> None:
    with pytest.raises(ValidationError, match="must say why"):
        Availability(available=False)


def test_fallback_reasons_are_stable_identifiers() -> None:
    values = [r.value for r in FallbackReason]
    assert len(set(values)) == len(values)
    assert all(v.isidentifier() and v == v.lower() for v in values)


def test_fp32_reference_format_is_four_bytes_per_value() -> None:
    f = KVFormat(dtype=KVDtype.FP32, kv_lora_rank=64, rope_dim=16, index_head_dim=32)
    assert (f.latent_bytes_per_token, f.index_bytes_per_token) == (4 * 80, 4 * 32)
