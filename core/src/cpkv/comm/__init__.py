"""Communication inside one CP group: the group wrapper over ``torch.distributed`` (agreement,
collectives, bounded waits) and peer-mapped buffers. Imports no pool, runtime or plugin."""

from ._waits import Progress, current_wait, last_progress, latest_progress, note_progress, waiting_in
from .group import Backend, CollectiveCheckError, CPGroup
from .peer import PeerAccessUnavailable, PeerBuffers, open_peer_buffers
from .placement import GpuPlacement, rank_gpu, shared_gpus_line

__all__ = ["Backend", "CPGroup", "CollectiveCheckError", "GpuPlacement", "PeerAccessUnavailable",
           "PeerBuffers", "Progress", "current_wait", "last_progress", "latest_progress",
           "note_progress", "open_peer_buffers", "rank_gpu", "shared_gpus_line", "waiting_in"]
