"""MXNet's KVStore API: `create(name)`, the KVStore, and the backends it runs over."""

from .base import KVStoreBase
from .store import KVStore, create
from .types import KNOWN_TYPES, check_compression_type, parse_type

__all__ = ['create', 'KVStore', 'KVStoreBase', 'KNOWN_TYPES', 'parse_type',
           'check_compression_type']
