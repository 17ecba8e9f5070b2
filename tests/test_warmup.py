"""``cpkv.runtime.warmup.warm_up``: the warm-up prompts run on the session, in its chunks, and
leave nothing in the pool."""

from __future__ import annotations

import pytest
import torch

from cpkv.comm.group import CPGroup
from cpkv.models import load_model
from cpkv.runtime.session import PrefillSession
from cpkv.runtime.warmup import warm_up
from cpkv.settings import load_settings


def _session(chunk_tokens: int = 0) -> PrefillSession:
    model = load_model("tiny", dtype=torch.float32)
    settings = load_settings(cp={"size": 1}, kv={"page_size": 64, "pages_per_rank": 16},
                             runtime={"chunk_tokens": chunk_tokens})
    return PrefillSession(model, settings, CPGroup.single())


def test_warm_up_prefills_in_the_sessions_chunks_and_releases_its_prompts() -> None:
    session = _session(chunk_tokens=128)
    rep = warm_up(session, 300, chunk=64)
    assert rep.chunk == 128  # the session's chunk_tokens wins over the argument
    assert len(rep.chunk_seconds) == 3  # 299 tokens in chunks of 128
    assert rep.seconds >= sum(rep.chunk_seconds) > 0
    assert session.pool.footprint().pages_held == 0
    # the session serves afterwards
    res = session.prefill([("r", list(range(1, 70)))])
    assert res.last_logits.shape[0] == 1


def test_warm_up_refuses_a_chunk_off_the_pages() -> None:
    with pytest.raises(ValueError, match="multiple of the page size"):
        warm_up(_session(), 300, chunk=100)
