"""A server's optimizer plugins: the modules named in KVPS_SERVER_PLUGINS, installed on its host
and imported at its start, whose registered optimizers it may then run (none is ever sent)."""

import importlib
import logging

from ..errors import ConfigError

log = logging.getLogger('kvps.server')

_loaded = None   # the plugins this process imported as a server (None: it is not one)


def import_plugins(names):
    """Import the modules ``names`` (a server, before it joins the job), in order. One that
    fails is logged with its traceback and raised as a ConfigError naming it: the server
    must stop at start, not refuse its optimizer later in the job."""
    global _loaded
    _loaded = []
    for name in names or ():
        try:
            importlib.import_module(name)
        except BaseException as exc:   # SystemExit or KeyboardInterrupt of its code, too
            if isinstance(exc, KeyboardInterrupt):
                raise
            log.error('KVPS_SERVER_PLUGINS: importing %r failed', name, exc_info=True)
            raise ConfigError(f'KVPS_SERVER_PLUGINS: the optimizer plugin {name!r} failed to '
                              f'import ({type(exc).__name__}: {exc}); this server stops before '
                              'joining the job (its traceback is above)') from None
        _loaded.append(name)
        log.info('optimizer plugin %r imported', name)


def loaded():
    """The plugins this server imported, or None in a process that is not a server."""
    return None if _loaded is None else list(_loaded)
