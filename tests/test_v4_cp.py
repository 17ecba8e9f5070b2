"""DeepSeek-V4 context-parallel prefill on Gloo (torch reference ops): CP2 zigzag and CP4
interleave equal the one-rank forward bit for bit and transformers within 2e-3 relative on
prompts whose lengths are multiples of no rate; one halo collective a layer and one full-view
collective a compressed layer; a prompt too short for zigzag on units falls back visibly;
chunked prefill (unit-aligned chunks, entries and tail objects carried) equals one piece bit
for bit, on one rank and on CP2 zigzag / CP4 interleave; per-rank bytes. With ranks as threads
of one process: CP == one rank bit for bit at any rows per rank (a hypothesis over lengths, CP
sizes, modes and chunkings), and several prompts as one batch (one halo and one full-view
collective a layer) equal each alone bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.comm import CPGroup
from cpkv.contracts import SplitMode
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.tiny import write_tiny_checkpoint
from cpkv.models.v4_reference import reference_forward
from cpkv.ops import v4_op_table
from cpkv.runtime import run_ranks
from cpkv.runtime.v4_prefill import v4_layout, v4_prefill_batch, v4_prefill_logits
from helpers import ThreadRanks

transformers = pytest.importorskip("transformers")

PAGE = 4  # unit = lcm(4, 4, 16) = 16 tokens: windows of 4 and 16 and the 7-row halo cross ranks


def _ids(length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length))


def _rank(group: CPGroup, path: str, length: int, mode: str,
          chunks: list[int] | None = None) -> dict[str, object]:
    model = DeepseekV4.load(path, ops=v4_op_table())
    ids = _ids(length, model.config.vocab_size)
    calls: list[int] = []
    gather = group.all_gather_rows

    def counted(local: torch.Tensor, max_rows: int, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        calls.append(max_rows)
        return gather(local, max_rows, out)

    group.all_gather_rows = counted  # type: ignore[method-assign]
    with torch.no_grad():
        logits = v4_prefill_logits(model, ids, group, page_size=PAGE, mode=mode, chunks=chunks)
    return {"logits": logits, "collectives": len(calls)}


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v4cp") / "tiny", seed=11,
                                 model_type="deepseek_v4")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "mode", "length"), [(2, "zigzag", 77), (4, "interleave", 53)])
def test_cp_equals_one_rank_and_transformers(tiny_v4: Path, cp: int, mode: str,
                                             length: int) -> None:
    results = run_ranks(_rank, cp, args=(str(tiny_v4), length, mode), timeout_s=120.0)
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    ids = _ids(length, model.config.vocab_size)
    with torch.no_grad():
        one = reference_forward(model, ids)
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_v4).eval()
        ref = hf(ids[None], use_cache=False).logits[0]
    compressed = sum(model.layer_kind(i) != "sliding_attention" for i in range(model.num_layers))
    for res in results:
        assert torch.equal(res.value["logits"], one), res.rank
        # per layer: the halo (every layer) + the full view (compressed layers); the logits
        assert res.value["collectives"] == model.num_layers + compressed + 1
    assert (one[-1] - ref[-1]).abs().max() <= 2e-3 * ref[-1].abs().max()
    assert int(one[-1].argmax()) == int(ref[-1].argmax())
    lay = v4_layout(model, length, cp, PAGE, mode)
    assert len({r for _, _, r in lay.plan.segments}) == cp  # every rank computes something


def test_short_zigzag_falls_back_to_interleave_visibly(tiny_v4: Path) -> None:
    from structlog.testing import capture_logs

    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    with capture_logs() as logs:
        lay = v4_layout(model, 40, 2, PAGE, SplitMode.ZIGZAG)  # 3 units < 2C = 4
    assert lay.plan.page_aligned
    # one event, saying what runs (not the planner's token-balanced split, which is re-planned)
    assert [e["op"] for e in logs if e.get("event") == "cpkv.fallback"] == ["v4_split_plan"]


@pytest.mark.parametrize(("cp", "mode", "length"), [(2, "zigzag", 77), (4, "interleave", 53),
                                                    (3, "zigzag", 200), (2, "interleave", 31)])
def test_kv_bytes_sum_to_replicated_plus_tail(tiny_v4: Path, cp: int, mode: str,
                                              length: int) -> None:
    from cpkv.models.v4_objects import v4_objects
    from cpkv.runtime.v4_prefill import v4_kv_bytes

    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    lay = v4_layout(model, length, cp, PAGE, mode)
    per, replicated = v4_kv_bytes(model, lay)
    tail = sum(o.bytes_for(length) for o in v4_objects(model.config) if o.kind != "entries")
    assert sum(per) == replicated + tail
    for m, owned in lay.entries.items():  # every complete entry computed by exactly one rank
        flat = sorted(w for r in owned for w in r)
        assert flat == list(range(length // m))


@pytest.mark.parametrize("chunks", [[16, 37], [32, 21], [16, 16, 21], [48, 5]])
def test_chunked_equals_one_piece_on_one_rank(tiny_v4: Path, chunks: list[int]) -> None:
    """Any unit-aligned chunking carries entries and tail objects (rule 37): the same logits
    bit for bit (an early chunk's shorter key axis adds only masked blocks)."""
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    ids = _ids(53, model.config.vocab_size)
    group = CPGroup.single()
    with torch.no_grad():
        whole = v4_prefill_logits(model, ids, group, page_size=PAGE)
        parts = v4_prefill_logits(model, ids, group, page_size=PAGE, chunks=chunks)
        one = reference_forward(model, ids)
    assert torch.equal(whole, one)
    assert torch.equal(parts, whole)


def test_chunks_off_the_unit_are_refused(tiny_v4: Path) -> None:
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    with pytest.raises(ValueError, match="not on an ownership unit boundary"):
        v4_prefill_logits(model, _ids(53, 256), CPGroup.single(), page_size=PAGE,
                          chunks=[20, 33])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "mode", "length", "chunks"), [
    (2, "zigzag", 150, [64, 86]), (4, "interleave", 77, [16, 32, 29])])
def test_chunked_cp_equals_one_rank(tiny_v4: Path, cp: int, mode: str, length: int,
                                    chunks: list[int]) -> None:
    results = run_ranks(_rank, cp, args=(str(tiny_v4), length, mode, chunks), timeout_s=120.0)
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    with torch.no_grad():
        one = reference_forward(model, _ids(length, model.config.vocab_size))
    for res in results:
        assert torch.equal(res.value["logits"], one), res.rank


@st.composite
def _runs(draw: st.DrawFn) -> tuple[int, int, str, list[int] | None]:
    length = draw(st.integers(1, 90))
    cp = draw(st.integers(1, 4))
    mode = draw(st.sampled_from(["zigzag", "interleave"]))
    chunks = None
    if draw(st.booleans()) and length > 16:
        chunks, left = [], length
        while left > 16 and draw(st.booleans()):
            n = 16 * draw(st.integers(1, max(1, (left - 1) // 16)))
            chunks.append(n)
            left -= n
        chunks.append(left)
    return length, cp, mode, chunks


def _threads_equal_one_rank(tiny_v4: Path, length: int, cp: int, mode: str,
                            chunks: list[int] | None) -> None:
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    ids = _ids(length, model.config.vocab_size)
    with torch.no_grad():
        one = reference_forward(model, ids)
        got = ThreadRanks(cp).run(lambda g: v4_prefill_logits(
            model, ids, cast(CPGroup, g), page_size=PAGE, mode=mode, chunks=chunks))
    for r, logits in enumerate(got):
        assert torch.equal(logits, one), (r, length, cp, mode, chunks)


@pytest.mark.parametrize(("length", "cp", "mode", "chunks"), [
    (51, 4, "interleave", None),  # 16, 16, 16 and 3 rows
    (37, 3, "zigzag", None),  # too short for zigzag: interleaved, 16, 16 and 5 rows
    (35, 2, "interleave", [16, 16, 3]),  # a 3-row last chunk
    (61, 4, "interleave", [32, 29])])
def test_ranks_of_few_rows_equal_one_rank_bit_for_bit(tiny_v4: Path, length: int, cp: int,
                                                      mode: str, chunks: list[int] | None
                                                      ) -> None:
    _threads_equal_one_rank(tiny_v4, length, cp, mode, chunks)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(_runs())
def test_cp_equals_one_rank_bit_for_bit_at_any_rows_per_rank(
        tiny_v4: Path, run: tuple[int, int, str, list[int] | None]) -> None:
    """Any length, CP size, mode and unit-aligned chunking: every rank's logits equal the
    one-rank forward bit for bit (ranks of 0 to a few rows included)."""
    _threads_equal_one_rank(tiny_v4, *run)


@pytest.mark.parametrize(("cp", "mode", "chunks"), [
    (2, "zigzag", None), (3, "interleave", None), (2, "interleave", [[16, 21], None, [16, 13]])])
def test_a_batch_equals_each_prompt_alone(tiny_v4: Path, cp: int, mode: str,
                                          chunks: list[list[int] | None] | None) -> None:
    """Three prompts (lengths multiples of no rate) as one CP batch: one halo and one full-view
    collective a layer for all of them (per chunk step), each prompt's logits the one-rank
    forward's bit for bit and transformers' within 2e-3 relative."""
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    prompts = [_ids(n, model.config.vocab_size) for n in (37, 53, 29)]
    threads = ThreadRanks(cp)
    with torch.no_grad():
        got = threads.run(lambda g: v4_prefill_batch(model, prompts, cast(CPGroup, g),
                                                     page_size=PAGE, mode=mode, chunks=chunks))
        alone = [reference_forward(model, p) for p in prompts]
        hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_v4).eval()
        ref = [hf(p[None], use_cache=False).logits[0, -1] for p in prompts]
    for r in range(cp):
        for j in range(len(prompts)):
            assert torch.equal(got[r][j], alone[j]), (r, j)
    for j in range(len(prompts)):
        assert (alone[j][-1] - ref[j]).abs().max() <= 2e-3 * ref[j].abs().max()
        assert int(alone[j][-1].argmax()) == int(ref[j].argmax())
    compressed = sum(model.layer_kind(i) != "sliding_attention" for i in range(model.num_layers))
    steps = max(len(c or [0]) for c in chunks) if chunks else 1
    assert threads.calls == [steps * (model.num_layers + compressed + 1)] * cp
