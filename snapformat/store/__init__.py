"""Storage backends behind one interface (see ``base.Store``)."""

from snapformat.store.base import ObjectInfo, Store
from snapformat.store.local import LocalStore
from snapformat.store.registry import open_store, register

__all__ = ["LocalStore", "ObjectInfo", "Store", "open_store", "register"]
