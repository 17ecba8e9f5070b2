"""What a DeepSeek-V4 CP prefill keeps for decode (:mod:`cpkv.runtime.v4_state`): every rank's
owned entries and the tail holder's bundle assemble into exactly (bit for bit) the one-rank
decode state, each entry with one owner, on CP2 zigzag and CP4 interleave, whole and chunked;
greedy decode from the assembled state equals the reference on the grown sequence; splitting
a state by owners and assembling it is the identity; a missing or doubly owned entry is an
error; the bundle's bytes stay within the tail objects' bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpkv.comm import CPGroup
from cpkv.kv.v4_state import V4OwnedEntries, assemble_v4_state, split_v4_state
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.tiny import write_tiny_checkpoint
from cpkv.models.v4_objects import v4_objects
from cpkv.models.v4_reference import reference_forward
from cpkv.ops import v4_op_table
from cpkv.runtime import run_ranks
from cpkv.runtime.v4_decode import v4_empty_state, v4_extend, v4_greedy
from cpkv.runtime.v4_prefill import v4_layout
from cpkv.runtime.v4_state import v4_prefill_state

PAGE = 4  # ownership unit lcm(4, 4, 16) = 16 tokens


def _ids(length: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length))


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v4state") / "tiny", seed=11,
                                 model_type="deepseek_v4")


def _rank(group: CPGroup, path: str, length: int, mode: str,
          chunks: list[int] | None) -> tuple[object, ...]:
    model = DeepseekV4.load(path, ops=v4_op_table())
    with torch.no_grad():
        logits, owned, tail = v4_prefill_state(model, _ids(length), group, page_size=PAGE,
                                               mode=mode, chunks=chunks)
    return logits[-1], owned, tail


@pytest.mark.parametrize(("length", "chunks"), [(53, None), (21, [16, 5])])
def test_one_rank_state_equals_the_decode_step_s_prefill(tiny_v4: Path, length: int,
                                                         chunks: list[int] | None) -> None:
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    _, owned, tail = _rank(CPGroup.single(), str(tiny_v4), length, "zigzag", chunks)
    assert isinstance(owned, V4OwnedEntries) and tail is not None
    state = assemble_v4_state([owned], tail)  # type: ignore[arg-type]
    with torch.no_grad():
        grown = v4_empty_state(model)
        v4_extend(model, grown, _ids(length))
    if chunks is None:
        assert state.equal(grown)
    else:  # an earlier chunk's shorter key axis rounds otherwise
        for a, b in zip(state.layers, grown.layers, strict=True):
            for n, c in a.compressors.items():
                torch.testing.assert_close(c.entries, b.compressors[n].entries,
                                           rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "mode", "length", "chunks"), [
    pytest.param(2, "zigzag", 77, None, marks=pytest.mark.slow),  # 7-8 s: spawned ranks
    pytest.param(4, "interleave", 53, None, marks=pytest.mark.slow),
    pytest.param(2, "zigzag", 150, [64, 86], marks=pytest.mark.slow),
    pytest.param(4, "interleave", 67, [64, 3], marks=pytest.mark.slow)])
def test_owned_pieces_assemble_the_one_rank_state(tiny_v4: Path, cp: int, mode: str,
                                                  length: int, chunks: list[int] | None) -> None:
    results = run_ranks(_rank, cp, args=(str(tiny_v4), length, mode, chunks), timeout_s=120.0)
    _, one_owned, one_tail = _rank(CPGroup.single(), str(tiny_v4), length, mode, chunks)
    one = assemble_v4_state([one_owned], one_tail)  # type: ignore[list-item, arg-type]
    tails = [r.value[2] for r in results if r.value[2] is not None]
    assert len(tails) == 1  # one tail holder: the rank of the last token
    lay = v4_layout(DeepseekV4.load(tiny_v4, ops=v4_op_table()), length, cp, PAGE, mode)
    assert results[lay.tail_rank].value[2] is tails[0]
    state = assemble_v4_state([r.value[1] for r in results], tails[0])
    assert state.equal(one)
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    bound = sum(o.bytes_for(length) for o in v4_objects(model.config) if o.kind != "entries")
    assert 0 < tails[0].nbytes <= bound
    steps = 12
    with torch.no_grad():
        tokens = v4_greedy(model, state, int(results[0].value[0].argmax()), steps)
        ref = reference_forward(model, torch.cat([_ids(length), torch.tensor(tokens)]))
    assert ref[length - 1:-1].argmax(-1).tolist() == tokens


def test_split_then_assemble_is_the_identity_and_checks_owners(tiny_v4: Path) -> None:
    model = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    length = 77
    with torch.no_grad():
        state = v4_empty_state(model)
        v4_extend(model, state, _ids(length))
    owners = v4_layout(model, length, 3, PAGE, "zigzag").entries
    owned, tail = split_v4_state(state, owners)
    assert assemble_v4_state(owned, tail).equal(state)
    key = (1, "main")
    ids, rows = owned[0].entries[key]
    owned[1].entries[key] = (owned[1].entries[key][0] + ids[:1],
                             torch.cat([owned[1].entries[key][1], rows[:1]]))
    with pytest.raises(ValueError, match="exactly once"):
        assemble_v4_state(owned, tail)
    owned[0].entries[key] = (ids[1:], rows[1:])
    owned[1].entries[key] = (owned[1].entries[key][0][:-2], owned[1].entries[key][1][:-2])
    with pytest.raises(ValueError, match="exactly once"):
        assemble_v4_state(owned, tail)
