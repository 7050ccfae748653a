"""MXNet 2.0's custom-store protocol: KVStoreBase, which a store of one's own (Horovod's and
BytePS's, in MXNet) subclasses, and the registry of such stores that ``create`` reads."""

import warnings

from ..errors import ConfigError
from .types import KNOWN_TYPES, parse_type


class KVStoreBase:
    """A key-value store for data-parallel training, as MXNet 2.0 declares it.

    A subclass registered with ``KVStoreBase.register`` is made by ``kvps.kvstore.create(its
    name)`` (the class name, lower-cased), and ``kvps.Trainer`` takes it as Gluon 2.0 does:
    ``broadcast`` gives every worker rank 0's initial weights, ``pushpull`` sums each
    gradient (and, for a store that ``is_capable('optimizer')``, updates and returns the
    weights), ``save_optimizer_states``/``load_optimizer_states`` back ``save_states``. Values
    are what the caller holds (torch tensors for the Trainer). kvps's own KVStore is one too.
    """

    OPTIMIZER = 'optimizer'
    kv_registry = {}     # lower-cased class name -> registered subclass

    def broadcast(self, key, value, out, priority=0):
        """Write rank 0's ``value`` of ``key`` into ``out`` (an array, or a list) everywhere."""
        raise NotImplementedError()

    def pushpull(self, key, value, out=None, priority=0):
        """Sum ``value`` (an array, or a list of them) over every worker into ``out`` (into
        ``value`` itself when None); a store that runs an optimizer returns the weights."""
        raise NotImplementedError()

    def set_optimizer(self, optimizer):
        """Run ``optimizer`` on every later pushpull (a store capable of 'optimizer')."""
        raise NotImplementedError()

    def is_capable(self, capability):
        """Whether the store supports ``capability`` (MXNet knows 'optimizer')."""
        raise NotImplementedError()

    def save_optimizer_states(self, fname, dump_optimizer=False):
        raise NotImplementedError()

    def load_optimizer_states(self, fname):
        raise NotImplementedError()

    @property
    def type(self):
        raise NotImplementedError()

    @property
    def rank(self):
        raise NotImplementedError()

    @property
    def num_workers(self):
        raise NotImplementedError()

    @staticmethod
    def register(klass):
        """Class decorator: make a KVStoreBase subclass creatable by ``kvps.kvstore.create``
        under its lower-cased class name (MXNet's rule). A name kvps's own types are parsed
        from ('local', 'dist_sync', ...) is refused: ``create`` would otherwise answer it
        with one store or the other depending on the order of imports."""
        if not isinstance(klass, type):
            raise TypeError(f'KVStoreBase.register takes a class, got {klass!r}')
        if not issubclass(klass, KVStoreBase):
            raise TypeError(f'KVStoreBase.register takes a subclass of '
                            f'kvps.kvstore.KVStoreBase, got {klass.__name__}')
        name = klass.__name__.lower()
        if _is_kvps_type(name):
            raise ConfigError(
                f'KVStoreBase.register: {klass.__name__!r} is a kvps store type (names made of '
                f'{", ".join(KNOWN_TYPES)}): rename the class, which is registered under its '
                'lower-cased name')
        old = KVStoreBase.kv_registry.get(name)
        if old is not None and old is not klass:
            warnings.warn(f'kvstore {name!r}: {klass.__module__}.{klass.__name__} replaces '
                          f'{old.__module__}.{old.__name__}', stacklevel=2)
        KVStoreBase.kv_registry[name] = klass
        return klass


def _is_kvps_type(name):
    try:
        parse_type(name)
    except ConfigError:
        return False
    return True


def registered(name):
    """The KVStoreBase subclass registered under ``name`` (any case), or None."""
    return KVStoreBase.kv_registry.get(name.lower()) if isinstance(name, str) else None
