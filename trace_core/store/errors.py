"""The store's errors: each message names the URI and never a credential."""

from __future__ import annotations


class StoreError(OSError):
    """A storage call failed; the message names the URI and never a credential."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """No such object, prefix or bucket."""


class BucketNotFound(ObjectNotFound):
    """The URI's bucket does not exist."""


class AccessDenied(StoreError, PermissionError):
    """Credentials missing, unknown or not allowed to do this."""


class StoreUnavailable(StoreError, ConnectionError):
    """The server could not be reached or kept failing after every retry."""
