"""`python -m kvps.node`: run this process's scheduler or server role, as DMLC_ROLE says."""

import logging
import sys

from .allocator import keep_freed_memory
from .config import Config
from .errors import KVPSError


def run_role(config=None):
    """Run the scheduler or server loop to its end; return the exit code."""
    config = config or Config.from_env()
    logging.basicConfig(level=config.log_level.upper(),
                        format='%(asctime)s %(name)s %(levelname)s %(message)s')
    try:
        if config.role == 'scheduler':
            from .scheduler.loop import Scheduler
            return Scheduler(config).run()
        if config.role == 'server':
            from .server.loop import Server
            keep_freed_memory(config.malloc_trim_bytes)
            return Server(config).run()
    except KVPSError as exc:
        logging.getLogger('kvps').error('%s failed: %s', config.role, exc)
        return 1
    raise SystemExit(f'kvps.node runs the scheduler or a server; DMLC_ROLE={config.role!r}')


def main():
    sys.exit(run_role())


if __name__ == '__main__':
    main()
