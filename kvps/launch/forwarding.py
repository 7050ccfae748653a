"""Running a Supervisor: the launcher's signals routed to it, and a list of specs run to their end."""

import contextlib
import signal
import threading

from .supervise import Supervisor

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def forwarding_signals(supervisor):
    """Route SIGINT/SIGTERM/SIGHUP to the supervisor while the job runs (main thread only).
    A signal ignored when the launcher started stays ignored: `nohup` (SIGHUP), a shell's
    background job (SIGINT)."""
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for signum in FORWARDED_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                saved[signum] = signal.signal(signum, supervisor.on_signal)
    try:
        yield supervisor
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def run_specs(specs, grace=5.0, shutdown_timeout=600.0, out=None, err=None):
    """Start every spec, supervise them and return the exit code (for tests and simple uses)."""
    supervisor = Supervisor(out=out, err=err, grace=grace)
    with forwarding_signals(supervisor):
        try:
            for spec in specs:
                if supervisor.start(spec) is None:
                    return supervisor.stopped
            return supervisor.supervise(shutdown_timeout)
        finally:
            supervisor.stop(supervisor.stopped if supervisor.stopped is not None else 1)
