"""A worker's API threads at once: the push window never makes one thread wait for another's
push, waits for every push whoever asks, and calls left when the I/O thread ends fail clearly."""

import threading

import pytest

from kvps.wire import protocol as P
from kvps.config import Config
from kvps.errors import RequestTimeout, StoreClosedError
from kvps.worker.loop import WorkerIO
from kvps.worker.pending import Completion, Operation, PushWindow, Request


def pushed_by_another_thread(window, nbytes):
    op = Operation('push of key 1', 1)
    thread = threading.Thread(target=window.add, args=(op, nbytes))
    thread.start()
    thread.join()
    return op


def test_a_full_window_does_not_hold_a_thread_back_for_another_threads_push():
    # In dist_sync that push may wait for a round that this thread's push completes on
    # another worker: waiting for it deadlocked workers whose threads pushed in other orders.
    window = PushWindow(limit=100)
    theirs = pushed_by_another_thread(window, 100)
    window.make_room(100, timeout=30)         # returns at once: nothing of ours is in flight
    mine = Operation('push of key 2', 1)
    window.add(mine, 100)
    with pytest.raises(RequestTimeout, match='push of key 2'):
        window.make_room(100, timeout=0.1)    # our own oldest push is what we wait for
    mine.part_done()
    theirs.part_done()
    window.make_room(100, timeout=30)
    assert window.nbytes == 0


class _Arrivals(threading.Event):
    """An Event that tells ``arrived`` (a Semaphore) each time a thread starts waiting on it."""

    def __init__(self, arrived):
        super().__init__()
        self.arrived = arrived

    def wait(self, timeout=None):
        self.arrived.release()
        return super().wait(timeout)


def test_every_thread_waiting_for_the_pushes_waits_until_they_are_done():
    # Two threads' barriers at once: the second once found the window emptied by the first
    # (which had taken the push out to wait for it) and returned before the push was applied.
    window, arrived = PushWindow(limit=1 << 20), threading.Semaphore(0)
    op = Operation('push of key 1', 1)
    op.done = _Arrivals(arrived)
    window.add(op, 10)
    saw = []

    def wait_all():
        window.wait_all(timeout=30)
        saw.append(op.done.is_set())
        arrived.release()     # returned without waiting: still one arrival

    threads = [threading.Thread(target=wait_all) for _ in range(2)]
    for thread in threads:
        thread.start()
    for _ in threads:
        arrived.acquire()     # each thread is waiting for the push, or has returned
    op.part_done()
    for thread in threads:
        thread.join()
    assert saw == [True, True]
    assert window.nbytes == 0


def test_a_completion_wakes_every_waiter_whenever_it_is_set():
    """An Operation's completion makes its Event only once a wait must block: waiters that
    block before the set, during it or after it all return."""
    done = Completion()
    assert done.wait(timeout=0.01) is False and not done.is_set()   # nobody set it
    woken, started = [], threading.Semaphore(0)

    def waiter():
        started.release()
        woken.append(done.wait(timeout=30))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for thread in threads:
        thread.start()
    for _ in threads:
        started.acquire()
    done.set()
    for thread in threads:
        thread.join()
    assert woken == [True] * 3 and done.is_set()
    done.set()                        # again: no harm
    finished = Completion()
    finished.set()
    assert finished.wait(timeout=0) is True and finished._event is None   # no Event made


def test_calls_fail_with_store_closed_once_the_io_thread_has_ended():
    """A call another thread makes while the worker closes, whether its request is queued,
    sent or made after the I/O thread stopped, fails at once instead of waiting for
    KVPS_TIMEOUT (or for ever: nobody would send it)."""
    io = WorkerIO(Config())
    try:
        queued, sent, late = (Operation(what, 1) for what in ('pull', 'barrier', 'push'))
        io.submit('server 0', {'op': P.PULL, 'keys': []}, (), Request(queued, 'server 0'))
        io._pending.add(Request(sent, 'server 0'))
        io._end()             # what the I/O thread does last
        io.submit('server 0', {'op': P.PUSH, 'keys': []}, (), Request(late, 'server 0'))
        for op in (queued, sent, late):
            with pytest.raises(StoreClosedError, match='left the job'):
                op.wait(timeout=0)
    finally:
        io._close()
