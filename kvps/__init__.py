"""kvps: a parameter server for data-parallel training with the MXNet KVStore API."""

from . import kvstore, optimizer
from .errors import (AuthError, ConfigError, DTypeError, DuplicateInitError, KeyNotInitializedError,
                     KeyTypeError, KVPSError, ParameterMismatchError, PeerLostError, ProtocolError,
                     RemoteError, RequestTimeout, ShapeError, StaleGradientError, TransportError)
from .kvstore import KVStore, create
from .trainer import Trainer

__version__ = '0.1.0'

__all__ = ['create', 'KVStore', 'Trainer', 'kvstore', 'optimizer', '__version__',
           'KVPSError', 'ConfigError', 'ProtocolError', 'TransportError', 'RequestTimeout',
           'PeerLostError', 'RemoteError', 'AuthError', 'KeyNotInitializedError',
           'DuplicateInitError', 'ShapeError', 'DTypeError', 'KeyTypeError',
           'ParameterMismatchError', 'StaleGradientError']


def _serve_if_server_role():
    """MXNet compatibility: cluster operators run the same command for every role, so importing
    kvps in a scheduler or server process runs that role and exits (as `import mxnet` does)."""
    from .config import Config
    config = Config.from_env()
    if config.role in ('scheduler', 'server'):
        import sys
        from .node import run_role
        sys.exit(run_role(config))


_serve_if_server_role()
