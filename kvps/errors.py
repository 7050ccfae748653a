"""The kvps exception tree: every error kvps raises is a KVPSError."""


class KVPSError(Exception):
    """Base of every error raised by kvps."""


class ConfigError(KVPSError, ValueError):
    """A setting (environment variable, argument, type name) is missing or invalid."""


class KeyNotInitializedError(KVPSError, KeyError):
    """A key was pushed or pulled before `init`."""

    def __str__(self):  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ''


class DuplicateInitError(KVPSError, ValueError):
    """`init` was called twice for the same key."""


class ShapeError(KVPSError, ValueError):
    """A value's shape does not match the key's initialized shape."""


class DTypeError(KVPSError, TypeError):
    """A value's dtype does not match the key's initialized dtype, or is unsupported."""


class StoreClosedError(KVPSError, RuntimeError):
    """The store was closed (``kv.close()`` or interpreter exit) and takes no more calls."""


class ProtocolError(KVPSError):
    """A message on the wire is malformed, oversized or of an unknown kind."""


class AuthError(KVPSError):
    """A peer failed authentication."""


class TransportError(KVPSError):
    """A message could not be delivered or answered."""


class RequestTimeout(TransportError, TimeoutError):
    """No answer came within the configured bound."""


class PeerLostError(TransportError):
    """A node of the job died or went silent; names the node (role, rank, host)."""

    def __init__(self, message, role=None, rank=None, host=None):
        super().__init__(message)
        self.role, self.rank, self.host = role, rank, host


class RemoteError(KVPSError):
    """An exception raised on a server or the scheduler, carried back to the caller."""

    def __init__(self, message, remote_type='Exception', remote_traceback='', node=''):
        super().__init__(f'{remote_type} on {node}: {message}' if node else message)
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.node = node


class ParameterMismatchError(KVPSError, ValueError):
    """Workers of one job hold different parameter tables (names, shapes, dtypes or order)."""


class StaleGradientError(KVPSError, UserWarning):
    """A parameter's gradient was not produced by backward since the last step (MXNet raises
    UserWarning here; this is one, and a KVPSError)."""


class KeyTypeError(KVPSError, TypeError):
    """Keys of one store mix kinds (int and str), or a key is neither."""


def from_remote(type_name, message, traceback_text='', node=''):
    """Rebuild a peer's exception: kvps's own types keep their class, others become RemoteError."""
    cls = globals().get(type_name)
    where = f' (on {node})' if node else ''
    if isinstance(cls, type) and issubclass(cls, KVPSError) and cls not in (
            RemoteError, PeerLostError):
        exc = cls(f'{message}{where}')
        exc.node, exc.remote_traceback = node, traceback_text
        return exc
    return RemoteError(message, type_name, traceback_text, node)
