"""A GPU shard's copies (kvps.server.transfers) through a stand-in for cupy that records each
call: copies through host memory are waited for before answers, work on workers' device
blocks is only ordered (the server's event recorded on the stream, no synchronise), and
``settle`` waits for both (before a worker's segment is let go)."""

from types import SimpleNamespace

import numpy as np

from kvps.server.transfers import CupyTransfers


class FakeCupy:
    """cupy's stream and runtime as CupyTransfers uses them, each call recorded."""

    def __init__(self):
        calls = self.calls = []
        stream = SimpleNamespace(ptr=0x5000, synchronize=lambda: calls.append('synchronize'))
        runtime = SimpleNamespace(
            memcpyHostToDevice=1, memcpyDeviceToHost=2,
            memcpyAsync=lambda dst, src, n, kind, s: calls.append(('copy', kind, n, s)))
        self.cuda = SimpleNamespace(runtime=runtime, get_current_stream=lambda: stream)


class Event:
    def __init__(self, calls):
        self.calls = calls

    def record(self, stream=None):
        self.calls.append(('record', stream))


def device(nbytes):
    return SimpleNamespace(data=SimpleNamespace(ptr=0x9000), nbytes=nbytes)


def test_work_on_device_blocks_is_ordered_by_a_record_not_waited_for():
    cupy = FakeCupy()
    transfers, event = CupyTransfers(cupy), Event(cupy.calls)
    transfers.hold(device(64))   # a worker's block read in place, or a pull copied into one
    transfers.order(event)
    transfers.order(event)       # nothing new since: nothing recorded
    assert cupy.calls == [('record', 0x5000)]


def test_copies_through_host_memory_are_waited_for_before_answers():
    cupy = FakeCupy()
    transfers, event = CupyTransfers(cupy), Event(cupy.calls)
    host = np.zeros(16, np.float32)
    transfers.upload(device(64), host, [(0, 64)])   # a push from page-locked shared memory
    transfers.hold(device(64))
    transfers.order(event)
    assert cupy.calls == [('copy', 1, 64, 0x5000), 'synchronize', ('record', 0x5000)]
    cupy.calls.clear()
    transfers.download(host, device(64), [(0, 32), (32, 32)])   # a pull into one, in spans
    transfers.order(event)
    assert cupy.calls == [('copy', 2, 32, 0x5000), ('copy', 2, 32, 0x5000), 'synchronize']


def test_without_an_event_and_before_a_segment_goes_everything_is_waited_for():
    cupy = FakeCupy()
    transfers = CupyTransfers(cupy)
    transfers.hold(device(64))
    transfers.order(None)        # (a server no worker mapped a device segment of)
    assert cupy.calls == ['synchronize']
    transfers.hold(device(64))
    transfers.settle()
    transfers.settle()           # nothing out: no wait
    assert cupy.calls == ['synchronize', 'synchronize']


def test_work_waited_for_by_a_settle_is_still_recorded_before_its_answers():
    # (a worker's segment let go mid-burst settles; the answers of that burst's work on the
    # other workers' blocks go at its end, and those workers wait for a record)
    cupy = FakeCupy()
    transfers, event = CupyTransfers(cupy), Event(cupy.calls)
    transfers.hold(device(64))
    transfers.settle()
    transfers.order(event)
    assert cupy.calls == ['synchronize', ('record', 0x5000)]
