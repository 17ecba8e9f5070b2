"""Communication inside one CP group: the group wrapper over ``torch.distributed`` (agreement,
collectives, bounded waits) and peer-mapped buffers. Imports no pool, runtime or plugin."""

from .group import Backend, CollectiveCheckError, CPGroup
from .peer import PeerAccessUnavailable, PeerBuffers, open_peer_buffers

__all__ = ["Backend", "CPGroup", "CollectiveCheckError", "PeerAccessUnavailable", "PeerBuffers",
           "open_peer_buffers"]
