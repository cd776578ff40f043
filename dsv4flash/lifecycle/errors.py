"""Errors of the adapter lifecycle: each names the revision, policy, file or tensor it is about."""

from __future__ import annotations

__all__ = [
    "LifecycleError",
    "AdapterFormatError",
    "BaseMismatchError",
    "RevisionNotFoundError",
    "PolicyNotFoundError",
    "HeadConflictError",
    "IntegrityError",
    "ReferencedRevisionError",
    "StoreNotFoundError",
    "CatalogUnreadableError",
    "BlobStoreUnreachableError",
]


class LifecycleError(RuntimeError):
    """Base class of every lifecycle error."""


class AdapterFormatError(LifecycleError, ValueError):
    """An adapter file or tensor set does not have the layout it claims (names the file/tensor)."""


class BaseMismatchError(LifecycleError):
    """An adapter revision was trained on a different base than the resident one."""


class RevisionNotFoundError(LifecycleError, KeyError):
    """No registered revision matches the given id, prefix or reference."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "revision not found"


class PolicyNotFoundError(LifecycleError, KeyError):
    """No policy record has the given name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "policy not found"


class HeadConflictError(LifecycleError):
    """A publish expected the policy head at one revision but another writer moved it."""


class IntegrityError(LifecycleError):
    """Stored bytes do not hash to their content address (corruption or a foreign write)."""


class ReferencedRevisionError(LifecycleError):
    """A revision cannot be retired because a tag or a policy head still points at it."""


class StoreNotFoundError(LifecycleError):
    """No store at the given root (creating one is explicit: `AdapterStore.open(..., create=True)` / `init`)."""


class CatalogUnreadableError(LifecycleError):
    """The catalog database cannot be opened or read (not a database, corrupt, unreachable)."""


class BlobStoreUnreachableError(LifecycleError):
    """The object store behind a store location cannot be reached, or refuses the request (names the URL)."""


class SlotQueueFull(LifecycleError):
    """Every device slot is held and the bounded queue for one is full (backpressure: retry after a while)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
