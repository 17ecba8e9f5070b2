"""Progress notes of long work in tokens (:func:`cpkv.comm.note_progress`): a prefill batch's
tokens counted done layer by layer and row chunk by row chunk (:class:`BatchProgress`), and a
process's own notes handed to a sink while a block runs (:func:`relayed_progress`: the job's
reference, which runs in the caller's process, shows its progress as the rank processes do)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cpkv.comm import last_progress, latest_progress, note_progress

__all__ = ["BatchProgress", "relayed_progress"]


class BatchProgress:
    """A prefill batch's share of the work noted as tokens: ``tokens`` (the batch's extend
    tokens) spread over ``layers`` layers, each layer's share over its units (indexer row chunks,
    sparse-attention row chunks, the MLP). Host-side counters only, no device value is read
    (rule 22); on a GPU a note says what was launched, which runs a little ahead of the device.

    The batch starts from the progress noted before it (``done`` of ``total``, e.g. the job's
    prompt tokens); with no total noted (0: unknown) each unit is a bare note (the launcher's
    bound on silence still sees it)."""

    def __init__(self, tokens: int, layers: int) -> None:
        p = last_progress()
        self.base, self.total = p.done, p.total
        self.tokens, self.layers = tokens, max(1, layers)
        self.layer, self.units, self.unit = 0, 1, 0

    def start_layer(self, units: int) -> None:
        """A layer of ``units`` units of work starts."""
        self.units, self.unit = max(1, units), 0

    def step(self) -> None:
        """One unit of the current layer is done."""
        self.unit = min(self.unit + 1, self.units)
        self._note()

    def end_layer(self) -> None:
        """The current layer is done."""
        self.layer, self.unit = min(self.layer + 1, self.layers), 0
        self._note()

    @property
    def done(self) -> int:
        """Tokens counted done (the base included)."""
        frac = (self.layer + self.unit / self.units) / self.layers
        return min(self.total, self.base + int(self.tokens * frac))

    def _note(self) -> None:
        if self.total:
            note_progress(done=self.done)
        else:
            note_progress()


#: (rank, what, done, total): :data:`cpkv.runtime.launch.ProgressSink`
Sink = Callable[[int, str, int, int], None]


@contextmanager
def relayed_progress(sink: Sink | None, *, rank: int = 0, prefix: str = "",
                     every_s: float = 0.5) -> Iterator[None]:
    """While the block runs, hand this process's new progress notes to ``sink(rank, prefix +
    what, done, total)`` from a daemon thread (every ``every_s`` seconds at most), and when the
    block ends the last note of each piece of work (``what``) it did: work done in this process
    shows as a rank's does, and each piece's end is seen however short it was. Nothing when
    ``sink`` is None."""
    if sink is None:
        yield
        return
    stop = threading.Event()
    seen = {what: p.seq for what, p in latest_progress().items()}

    def relay() -> None:
        for what, p in latest_progress().items():
            if what and seen.get(what) != p.seq:
                seen[what] = p.seq
                sink(rank, prefix + what, p.done, p.total)

    def loop() -> None:
        while not stop.wait(every_s):
            relay()

    thread = threading.Thread(target=loop, daemon=True, name="cpkv-progress-relay")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        relay()
