"""glibc keeps freed message buffers for the next round instead of faulting them in again."""

import ctypes
import subprocess
import sys
import textwrap

import pytest

from kvps import allocator
from kvps.config import Config

# Runs in a fresh interpreter: mallopt changes the whole process, and the figures need a heap
# that the test runner has not shaped. Prints how a freed 4 MiB chunk was held: bytes still
# mapped as their own region while in use (hblkhd) and free bytes kept in the heap after free.
PROBE = textwrap.dedent('''
    import ctypes, sys
    from kvps.allocator import keep_freed_memory

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks',
                    'hblkhd', 'usmblks', 'fsmblks', 'uordblks', 'fordblks', 'keepcost')]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    applied = keep_freed_memory(int(sys.argv[1]))
    before = libc.mallinfo2()
    chunk = libc.malloc(4 << 20)
    own_map = libc.mallinfo2().hblkhd - before.hblkhd
    libc.free(chunk)
    print(int(applied), own_map, libc.mallinfo2().fordblks - before.fordblks)
''')


def _glibc_with_mallinfo2():
    libc = allocator._glibc()
    return libc is not None and hasattr(libc, 'mallinfo2')


def _probe(trim_bytes):
    out = subprocess.run([sys.executable, '-c', PROBE, str(trim_bytes)], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    return [int(x) for x in out]


def test_nothing_is_changed_when_turned_off(monkeypatch):
    monkeypatch.setattr(allocator, '_glibc', lambda: pytest.fail('looked for glibc'))
    assert allocator.keep_freed_memory(0) is False


def test_default_keeps_a_gibibyte_and_zero_turns_it_off():
    assert Config.from_env({}).malloc_trim_bytes == 1 << 30
    assert Config.from_env({'KVPS_MALLOC_TRIM_BYTES': '0'}).malloc_trim_bytes == 0


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason='needs glibc 2.33+ (mallinfo2)')
def test_a_freed_buffer_stays_in_the_heap_for_the_next_round():
    applied, own_map, kept = _probe(1 << 30)
    assert applied == 1
    assert own_map == 0              # served from the heap, not mapped (and faulted) afresh
    assert kept > 3 << 20            # and still there, free, for the next allocation


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason='needs glibc 2.33+ (mallinfo2)')
def test_without_it_glibc_maps_and_unmaps_every_big_buffer():
    applied, own_map, kept = _probe(0)
    assert applied == 0
    assert own_map >= 4 << 20        # its own mapping: new pages every time
    assert kept < 1 << 20            # given back on free


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.setattr(allocator, '_glibc', lambda: None)
    assert allocator.keep_freed_memory(1 << 30) is False


def test_glibc_is_found_where_it_runs():
    libc = ctypes.CDLL(None)
    if hasattr(libc, 'gnu_get_libc_version'):
        assert allocator._glibc() is not None


GC_PROBE = textwrap.dedent('''
    import gc
    from kvps.allocator import GC_YOUNG_THRESHOLD, collect_garbage_rarely

    class Node:
        pass

    before = gc.get_threshold()
    collect_garbage_rarely()
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:]), gc.get_threshold()
    assert gc.get_freeze_count() > 0        # startup's objects are never scanned again
    a, b = Node(), Node()                     # a cycle made afterwards is still collected
    a.other, b.other = b, a
    del a, b
    print(gc.collect())
''')


def test_a_server_scans_for_cycles_rarely_but_still_collects_them():
    out = subprocess.run([sys.executable, '-c', GC_PROBE], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 2


LATE_IMPORT_PROBE = textwrap.dedent('''
    import gc, sys
    from kvps.allocator import collect_garbage_rarely
    from kvps.compression import f16

    assert 'torch' not in sys.modules
    collect_garbage_rarely()
    frozen = gc.get_freeze_count()
    assert f16.loaded(120)              # a server's first float16 cast loads torch
    print(gc.get_freeze_count() - frozen)
''')


def test_what_a_server_imports_late_is_exempt_too():
    """torch, loaded at a server's first float16 cast, is left out of later collections
    (otherwise each full pass scans its objects: 75 ms with torch loaded)."""
    out = subprocess.run([sys.executable, '-c', LATE_IMPORT_PROBE], capture_output=True,
                         text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 10_000
