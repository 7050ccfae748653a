"""`python -m kvps.node`: run this process's scheduler or server role, as DMLC_ROLE says."""

import logging
import signal
import sys

from .allocator import collect_garbage_rarely, keep_freed_memory
from .config import LOG_FORMAT, Config
from .errors import KVPSError
from .timeline import recording
from .timeline.stderr import STDERR
from .wire.refusals import REFUSALS


def run_role(config=None):
    """Run the scheduler or server loop to its end; return the exit code."""
    config = config or Config.from_env()
    _end_cleanly_on_termination()
    # (through a thread of its own: a reader of stderr that stops stalls no loop, no heartbeat)
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT, stream=STDERR)
    REFUSALS.configure(config.log_refusals)
    try:
        recording.start(config.timeline, config.role)
        if config.role == 'scheduler':
            from .scheduler.loop import Scheduler
            return Scheduler(config).run()
        if config.role == 'server':
            # before joining: a plugin that fails stops this server at start, traceback logged
            from .optimizer.plugins import import_plugins
            import_plugins(config.server_plugins)
            from .server.loop import Server
            keep_freed_memory(config.malloc_trim_bytes)
            collect_garbage_rarely()
            return Server(config).run()
    except KVPSError as exc:
        logging.getLogger('kvps').error('%s failed: %s', config.role, exc)
        return 1
    finally:   # what a failing node recorded is written too, and what it refused is said
        REFUSALS.flush()
        recording.stop()
    raise SystemExit(f'kvps.node runs the scheduler or a server; DMLC_ROLE={config.role!r}')


def _end_cleanly_on_termination():
    """SIGTERM and SIGHUP (a batch system's kill, a dropped ssh session, the ssh and Slurm
    recipes' cleanup) end the role as Ctrl-C does: through its finally blocks, which unlink
    its shared memory. By default they end the process on the spot, leaving a server's
    arena (its weights) in /dev/shm for as long as the host runs (only kvps.launch sweeps)."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


def main():
    sys.exit(run_role())


if __name__ == '__main__':
    main()
