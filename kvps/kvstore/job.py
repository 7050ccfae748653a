"""A process's one membership in the job (shared by its distributed stores): joined once,
logged, left at exit."""

import atexit
import logging
import os
import sys
import threading

from ..config import LOG_FORMAT, Config
from ..errors import ConfigError, KVPSError, StoreClosedError
from ..timeline import recording
from ..wire.refusals import REFUSALS

_dist_lock = threading.Lock()
_dist_client = None      # one job membership per process, shared by every dist store


def dist_backend(sync):
    """This process's membership in the job, joined at its first distributed store."""
    global _dist_client
    with _dist_lock:
        if _dist_client is not None and _dist_client.closed:
            raise StoreClosedError(
                'this process already left the job (kv.close() or a failed start); a process '
                'joins a job once, as in ps-lite: create the store before closing it')
        if _dist_client is None:
            from ..worker.client import DistClient  # sockets load only for distributed stores
            config = Config.from_env()
            _worker_logging(config.log_level)
            REFUSALS.configure(config.log_refusals)
            recording.start(config.timeline, 'worker')
            _dist_client = DistClient(config, sync)
            atexit.register(_leave_job_at_exit, _dist_client)
        elif _dist_client.sync != sync:
            raise ConfigError('this process already joined the job with a '
                              f'{"sync" if _dist_client.sync else "async"} store; every store of '
                              'one process must use the same mode')
        return _dist_client


def _worker_logging(level):
    """KVPS_LOG_LEVEL for kvps's messages in a worker (the user's script): the level of the
    'kvps' logger, and below WARNING a handler of its own when the script has set up none
    (else Python shows warnings only). A script's own logging setup is left as it is."""
    logger = logging.getLogger('kvps')
    logger.setLevel(level.upper())
    if logger.level < logging.WARNING and not logger.handlers and \
            not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
        logger.propagate = False   # a later logging.basicConfig must not print each line twice


def _leave_job_at_exit(client):
    """Python ignores exceptions in atexit hooks; a worker that could not leave the job cleanly
    (pushes lost, scheduler gone) must not exit 0 as if nothing happened. A worker exiting on
    an uncaught exception does not finish (told it had finished, the others' rounds would fail
    at once, and they, not it, would look like the first failure): it aborts the job, which
    ends at once naming it and its exception (by hand, no launcher sees its exit)."""
    if client.forked:   # a forked child exiting: the job is its parent's
        return
    exc = getattr(sys, 'last_exc', None) or getattr(sys, 'last_value', None)
    if exc is not None:
        client.abandon(_uncaught(exc))   # the job ends now, naming it and why
        return
    try:
        client.close()
    except KVPSError as exc:
        sys.stderr.write(f'kvps: this worker did not finish cleanly: {exc}\n')
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def _uncaught(exc):
    """What the scheduler tells the others about a worker dying of ``exc``."""
    text = str(exc)
    return f'uncaught {type(exc).__name__}' + (f': {text}' if text else '')


def forked_message(owner):
    """Why a process forked from the worker ``owner`` cannot use the worker's store."""
    return (f'this process ({os.getpid()}) was forked from the worker that joined the job '
            f'({owner}); the store\'s sockets and I/O thread stay with that process, so a '
            'forked child cannot use it (it would wait for answers that never come): call '
            'kvps from the worker process')
