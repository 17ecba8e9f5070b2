"""DeepSeek-V4 prefill -> decode transfer (:mod:`cpkv.disagg.v4_bundle`,
:mod:`cpkv.runtime.v4_transfer`): the pieces' bytes round-trip bit for bit; a request's image
covers its pages exactly once with every rank's part where it belongs, the tail on the last
token's rank; staged pages read back into the pieces; and on Gloo multi-process (CP2 / CP4 and
a decode rank, both transfer plugins) the decode rank assembles the state and decodes the
reference's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.disagg import registered_buffers
from cpkv.disagg.v4_bundle import (
    V4Image,
    V4Shapes,
    pack_owned,
    pack_tail,
    read_image,
    unpack_owned,
    unpack_tail,
    write_piece,
)
from cpkv.kv.v4_state import assemble_v4_state, split_v4_state
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.tiny import write_tiny_checkpoint
from cpkv.ops import v4_op_table
from cpkv.runtime.v4_decode import v4_empty_state, v4_extend
from cpkv.runtime.v4_prefill import v4_layout
from cpkv.runtime.v4_transfer import v4_stage_pool
from cpkv.settings import load_settings

PAGE = 4


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v4tx") / "tiny", seed=11,
                                 model_type="deepseek_v4")


@pytest.fixture(scope="module")
def model(tiny_v4: Path) -> DeepseekV4:
    return DeepseekV4.load(tiny_v4, ops=v4_op_table())


def _state(model: DeepseekV4, length: int):  # type: ignore[no-untyped-def]
    state = v4_empty_state(model)
    with torch.no_grad():
        v4_extend(model, state, torch.randint(0, 256, (length,),
                                              generator=torch.Generator().manual_seed(length)))
    return state


@pytest.mark.parametrize(("length", "cp"), [(3, 2), (21, 3), (53, 4)])
def test_pieces_round_trip_bit_for_bit(model: DeepseekV4, length: int, cp: int) -> None:
    state = _state(model, length)
    owners = v4_layout(model, length, cp, PAGE, "interleave").entries
    owned, tail = split_v4_state(state, owners)
    shapes = V4Shapes.of(model)
    back = [unpack_owned(shapes, pack_owned(shapes, o), owners, o.rank) for o in owned]
    raw = pack_tail(shapes, tail)
    assert raw.numel() == shapes.tail_nbytes(length)
    assert [pack_owned(shapes, o).numel() for o in owned] == [
        shapes.owned_nbytes(owners, r) for r in range(cp)]
    assert assemble_v4_state(back, unpack_tail(shapes, raw, length)).equal(state)
    with pytest.raises(ValueError, match="shapes take"):
        unpack_tail(shapes, raw[:-4], length)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 4), st.data())
def test_image_covers_its_pages_once(model: DeepseekV4, length: int, cp: int,
                                     data: st.DataObject) -> None:
    shapes = V4Shapes.of(model)
    lay = v4_layout(model, length, cp, PAGE, data.draw(st.sampled_from(["zigzag", "interleave"])))
    image = V4Image.plan("r", shapes, lay.entries, length, lay.tail_rank)
    m = image.manifest()  # validates: pages 0..n-1 each from exactly one rank
    first = image.first_pages()
    for part in m.parts:
        pages = part.logical_pages()
        assert len(pages) == image.local_pages(part.rank)
        own = image.pages(image.owned_bytes[part.rank])
        assert pages[:own] == list(range(first[part.rank], first[part.rank] + own))
        if part.rank == lay.tail_rank:
            assert pages[own:] == list(range(first[-1], m.num_pages))
        else:
            assert len(pages) == own


def test_staged_pages_read_back_into_the_state(model: DeepseekV4) -> None:
    """What a transfer does to the bytes, without a link: each rank stages its pieces, the
    pages land at their logical places, the decode side reads the image back."""
    length, cp = 77, 2
    state = _state(model, length)
    lay = v4_layout(model, length, cp, PAGE, "zigzag")
    owned, tail = split_v4_state(state, lay.entries)
    shapes = V4Shapes.of(model)
    image = V4Image.plan("r", shapes, lay.entries, length, lay.tail_rank)
    s = load_settings(backend={"preference": ["torch"]})
    decode = registered_buffers(v4_stage_pool(s, image.manifest().num_pages).store)
    for part in image.manifest().parts:
        bufs = registered_buffers(v4_stage_pool(s, image.local_pages(part.rank)).store)
        n = write_piece(bufs, 0, pack_owned(shapes, owned[part.rank]))
        if part.rank == lay.tail_rank:
            write_piece(bufs, n, pack_tail(shapes, tail))
        for run in part.runs:
            for k in range(run.num_pages):
                decode.kv[0][run.first_page + k] = bufs.kv[0][run.src_slot + k]
    got_owned, got_tail = read_image(decode, list(range(image.manifest().num_pages)), image,
                                     shapes)
    assert assemble_v4_state(got_owned, got_tail).equal(state)


def _job(tiny: Path, cp: int, plugin: str, chunk: int = 0) -> None:
    from cpkv.runtime.v4_job import run_v4_job

    gen = torch.Generator().manual_seed(cp)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (53, 37)]
    table: dict[str, object] = {"name": plugin, "timeout_s": 60}
    if plugin == "mooncake":
        table["mooncake"] = {"stage": "host"}
    s = load_settings(cp={"size": cp}, backend={"preference": ["torch"]}, debug=True,
                      transfer=table)
    rep = run_v4_job(str(tiny), prompts, cp, "zigzag", PAGE, chunk, 120.0, decode_tokens=12,
                     settings=s)
    assert rep.tokens_equal() == [True, True], (rep.tokens, rep.reference_tokens)
    assert [len(t) for t in rep.tokens] == [12, 12]
    assert rep.passed()
    # entries of both rates complete during the decode
    model = DeepseekV4.load(tiny, ops=v4_op_table())
    assert all(len(p) // 16 < (len(p) + 11) // 16 for p in prompts)
    shapes = V4Shapes.of(model)
    assert rep.bundle_bytes == [shapes.tail_nbytes(len(p)) for p in prompts]
    assert len(rep.bytes_sent) == cp and sum(rep.bytes_sent) > 0


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "chunk"), [(2, 0), (4, 0), (2, 32)])
def test_gloo_transfer_decodes_the_reference_tokens(tiny_v4: Path, cp: int, chunk: int) -> None:
    _job(tiny_v4, cp, "nccl", chunk)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.mooncake
def test_mooncake_transfer_decodes_the_reference_tokens(tiny_v4: Path) -> None:
    from cpkv_transfer_mooncake.plugin import probe

    avail = probe()
    if not avail.available:
        pytest.skip(f"mooncake: {avail.reason}")
    _job(tiny_v4, 2, "mooncake")
