"""kvps: a parameter server for data-parallel training with the MXNet KVStore API."""

from .errors import (AuthError, ConfigError, DTypeError, DuplicateInitError,
                     KeyNotInitializedError, KeyTypeError, KVPSError, ParameterMismatchError,
                     PeerLostError, ProtocolError, RemoteError, RequestTimeout, ShapeError,
                     StaleGradientError, StoreClosedError, TransportError)
from . import kvstore, optimizer, timeline
from .kvstore import KVStore, create
from .rows import RowSparse
from .trainer import Trainer

__version__ = '0.1.0'

__all__ = ['create', 'KVStore', 'Trainer', 'RowSparse', 'kvstore', 'optimizer', 'timeline',
           '__version__',
           'KVPSError', 'ConfigError', 'ProtocolError', 'TransportError', 'RequestTimeout',
           'PeerLostError', 'RemoteError', 'AuthError', 'KeyNotInitializedError',
           'DuplicateInitError', 'ShapeError', 'DTypeError', 'KeyTypeError',
           'ParameterMismatchError', 'StaleGradientError', 'StoreClosedError']


def _serve_if_server_role():
    """MXNet compatibility: cluster operators run the same command for every role, so importing
    kvps in a scheduler or server process runs that role and exits (as `import mxnet` does).
    Not in `python -m kvps.launch`, whose shell may hold a stale role: it sets the roles."""
    import sys
    from .config import Config
    argv = list(getattr(sys, 'orig_argv', ()))
    if any(a == '-m' and (b == 'kvps.launch' or b.startswith('kvps.launch.'))
           for a, b in zip(argv, argv[1:])):
        return
    if Config.from_env(fields={'role'}).role not in ('scheduler', 'server'):
        return   # a worker, or no role: the other settings are read when a store is created
    from .node import run_role
    sys.exit(run_role(Config.from_env()))


_serve_if_server_role()
