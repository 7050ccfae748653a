"""Store type names as MXNet parses them (by substring), and which types may compress."""

from ..errors import ConfigError

# Type names are parsed by substring as in MXNet; these are the words a name may be built from.
_WORDS = {'local', 'device', 'dist', 'sync', 'async', 'update', 'cpu', 'allreduce'}
KNOWN_TYPES = ('local', 'device', 'dist', 'dist_sync', 'dist_async', 'dist_sync_device',
               'dist_device_sync', 'dist_async_device', 'local_update_cpu',
               'local_allreduce_cpu', 'local_allreduce_device')
CAPABILITIES = ('optimizer',)


def parse_type(name):
    """Return (distributed, sync, device) for a store type name; raise for unknown names."""
    if not isinstance(name, str):
        raise TypeError(f'kvstore type must be a str, got {type(name).__name__}')
    words = set(name.lower().split('_'))
    if not words <= _WORDS or not words & {'local', 'device', 'dist'}:
        raise ConfigError(f'unknown kvstore type {name!r}; known types: {", ".join(KNOWN_TYPES)}')
    return 'dist' in words, 'async' not in words, 'device' in words


def check_compression_type(name):
    """Refuse gradient compression on a store type that cannot have it. MXNet's rule: only
    'device' and 'dist*' stores compress (what they send between devices or machines); a
    'local' store has nothing to send."""
    distributed, _, device = parse_type(name)
    if not (distributed or device):
        raise ConfigError(f'gradient compression is not supported for a {name!r} store (as in '
                          "MXNet): only 'device' and 'dist*' stores compress pushes ('device', "
                          "'local_allreduce_device', 'dist_sync', 'dist_async', "
                          "'dist_sync_device', ...)")
