"""Keeps glibc's malloc from handing message buffers back to the kernel between rounds, and
Python's cyclic garbage collector from scanning a server's round state many times a round.

Every round, zmq allocates a buffer per received array frame (and pyzmq one per frame it
copies on send) and frees it once the round is served. glibc gives the freed top of a heap
back to the kernel (trimming) as soon as it exceeds a small threshold (128 KiB, raised only
by frees of mmap'd chunks) and maps every chunk above its mmap threshold afresh, so the next
round's buffers are new pages: a page fault and a zeroed page per 4 KiB, in the loop thread.
On the socket path that cost more than the traffic itself (W2 S1, 40 keys of 100 KB:
31.7 ms a round before, 15.5 ms after). Raising both thresholds keeps a node's memory at its
peak working set (bounded by the workers' in-flight window) instead of faulting it in again.
"""

import ctypes
import gc
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20   # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
# Net new container objects (tuples, lists, leases) between two young-generation passes of the
# cyclic collector; Python's default is 700. A server holds thousands alive within a round of
# many keys (a token, a lease and a reply per key and worker), so by default it scanned them
# ~6 times a round and all its objects every ~20 rounds (10-20 ms a pass, in the loop), though
# the data path makes no cycles: W2 S1, 400 keys, SGD, 300 rounds: 2,000 passes, 660 ms ->
# 2 passes, 22 ms.
GC_YOUNG_THRESHOLD = 20_000
_RARELY = False   # True once this process collects rarely (a server)


def keep_freed_memory(trim_bytes):
    """Tell glibc to keep up to ``trim_bytes`` of freed memory per heap, and to serve chunks
    up to 32 MiB from its heaps. Returns whether it applied (False: not glibc, or off)."""
    if trim_bytes <= 0:
        return False
    libc = _glibc()
    if libc is None:
        return False
    mmap_ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    trim_ok = libc.mallopt(M_TRIM_THRESHOLD, min(trim_bytes, 2**31 - 1))
    if not (mmap_ok and trim_ok):
        log.info('glibc refused the malloc thresholds (mallopt returned %s, %s)',
                 mmap_ok, trim_ok)
        return False
    return True


def collect_garbage_rarely():
    """In a server process (not a user's): exempt what startup made (imports, settings) from
    every later collection, and run the young-generation pass only every GC_YOUNG_THRESHOLD
    net new objects. Cycles are still collected, later."""
    global _RARELY
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    _RARELY = True


def exempt_imported():
    """After a late import (torch, for the float16 casts, loads ~100,000 objects): in a
    process that collects rarely, exempt them too, or every full collection scans them
    (75 ms a pass with torch loaded, in a server's loop)."""
    if _RARELY:
        gc.freeze()


def _glibc():
    """The running C library when it is glibc (musl and others have no such thresholds)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (raises AttributeError outside glibc)
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None
