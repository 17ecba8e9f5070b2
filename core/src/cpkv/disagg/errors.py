"""The kinds of transfer failure, as exception types: the core and the plugins raise and catch
them by type, never by their message text."""

from __future__ import annotations

__all__ = ["TransferError", "TransferFenced", "TransferRefused"]


class TransferError(RuntimeError):
    """A transfer failed or did not check out; nothing of it was published."""


class TransferRefused(TransferError):
    """The decode refused a request before anything moved (its pool is full, the offers do not
    agree, the manifest does not continue the request): nothing was reserved, nothing moved."""


class TransferFenced(TransferError):
    """A sender stopped writing a part because the decode had given its grant up (the fence):
    some of the part's bytes may have landed in the (quarantined) slots, none will any more.
    Not a failure of the link itself: a one-sided plugin keeps its engine."""
