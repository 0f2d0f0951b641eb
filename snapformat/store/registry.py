"""Open a store by URL: a local path (or ``file://``) today; object stores register here too."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlparse

from schemas.errors import StoreError
from snapformat.store.base import Store
from snapformat.store.local import LocalStore

_BACKENDS: dict[str, Callable[[str], Store]] = {}


def _open_s3(url: str) -> Store:
    from snapformat.store.s3 import S3Store  # imported on first use: s3fs is heavy

    return S3Store(url)


_BACKENDS["s3"] = _open_s3


def register(scheme: str, factory: Callable[[str], Store]) -> None:
    """Make ``scheme://...`` URLs open with ``factory(url)``."""
    _BACKENDS[scheme] = factory


def open_store(url: str) -> Store:
    """A :class:`Store` for ``url``: a local path, ``file:///path``, or a registered scheme."""
    if not isinstance(url, str) or not url:
        raise StoreError("store URL is empty")
    if "://" not in url:
        return LocalStore(url)
    scheme = urlparse(url).scheme
    if scheme == "file":
        return LocalStore(urlparse(url).path)
    if scheme in _BACKENDS:
        return _BACKENDS[scheme](url)
    known = ", ".join(["local paths", "file://"] + [f"{s}://" for s in sorted(_BACKENDS)])
    raise StoreError(f"{url}: no backend for '{scheme}://' URLs (known: {known})")
