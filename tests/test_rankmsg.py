"""The launcher's rank messages: frozen values that travel by pickle and keep their fields."""

from __future__ import annotations

import dataclasses
import pickle
import typing

import pytest

from cpkv.contracts import FallbackEvent, FallbackReason
from cpkv.runtime import rankmsg

EVENT = FallbackEvent(op="split_plan", requested="a", selected="b",
                      reason=FallbackReason.SHORT_EXTEND)
MESSAGES = [rankmsg.LogEvent(1, {"event": "x", "n": 2}), rankmsg.Progressed(0, "layer 3", 5, 10),
            rankmsg.Waiting(2, "all_gather"), rankmsg.Waiting(2, None), rankmsg.Ready(0),
            rankmsg.Finished(1, {"v": [1, 2]}, [EVENT], 1.5, 0.25),
            rankmsg.Failed(0, "ValueError", "bad", "Traceback ...", 12.0)]


def test_every_message_kind_is_covered() -> None:
    assert {type(m) for m in MESSAGES} == set(typing.get_args(rankmsg.RankMessage))


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_pickles_by_value_and_is_frozen(msg: rankmsg.RankMessage) -> None:
    back = pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == msg and type(back) is type(msg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.rank = 9  # type: ignore[misc]
