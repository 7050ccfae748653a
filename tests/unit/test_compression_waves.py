"""A compressed pushpull leaves in waves: each run of keys (kvps.kvstore.keys.ENCODE_WAVE_BYTES
of payload) is pushed, and its keys pulled, before the next is encoded, small keys
still share a run, and the values are those of one push of every key; a push is encoded whole
before it is sent."""

import numpy as np
import pytest

import kvps
from kvps.kvstore import KVStore
from kvps.kvstore.keys import ENCODE_WAVE_BYTES
from kvps.kvstore.local import LocalBackend

BIG = ENCODE_WAVE_BYTES // 2   # float32 elements whose fp16 payload fills a run alone


class Recording(LocalBackend):
    """A LocalBackend that notes each push and pull: its keys, and the key parts
    whose residuals the codec had made by then (what was encoded before the call)."""

    def __init__(self):
        super().__init__()
        self.calls, self.residuals = [], None

    def push(self, items, priority=0):
        self.calls.append(('push', [k for k, _, _ in items], sorted(self.residuals)))
        super().push(items, priority)

    def pull(self, items, priority=0, codec=None):
        self.calls.append(('pull', [k for k, _, _ in items], None))
        return super().pull(items, priority, codec)


def store(params):
    backend = Recording()
    kv = KVStore('dist_sync', backend)
    kv.set_gradient_compression(params)
    backend.residuals = kv._residuals
    return kv, backend


def test_a_pushpull_sends_each_big_key_before_the_next_is_encoded():
    kv, backend = store({'type': 'fp16'})
    kv.init([0, 1, 2], [np.zeros(BIG, np.float32)] * 3)
    values = [np.full(BIG, k + 0.5, np.float32) for k in range(3)]
    outs = [np.zeros(BIG, np.float32) for _ in range(3)]
    kv.pushpull([0, 1, 2], values, out=outs)
    assert [call for call in backend.calls if call[0] == 'push'] == [
        ('push', [0], [(0, 0)]), ('push', [1], [(0, 0), (1, 0)]),
        ('push', [2], [(0, 0), (1, 0), (2, 0)])]
    for k in range(3):   # (the caller's arrays are read in place, never written)
        assert values[k].tolist() == [k + 0.5] * BIG
        assert outs[k].tolist() == [k + 0.5] * BIG


def test_a_push_hands_every_key_at_once():
    """A push (its pulls come later, behind it on the socket) is encoded whole, then sent."""
    kv, backend = store({'type': 'fp16'})
    kv.init([0, 1, 2], [np.zeros(BIG, np.float32)] * 3)
    kv.push([0, 1, 2], [np.full(BIG, k + 0.5, np.float32) for k in range(3)])
    assert backend.calls == [('push', [0, 1, 2], [(0, 0), (1, 0), (2, 0)])]
    for k in range(3):
        out = np.zeros(BIG, np.float32)
        kv.pull(k, out=out)
        assert out.tolist() == [k + 0.5] * BIG


def test_small_keys_share_one_wave():
    kv, backend = store({'type': 'fp16'})
    keys = list(range(50))
    kv.init(keys, [np.zeros(100, np.float32)] * 50)
    outs = [np.zeros(100, np.float32) for _ in keys]
    kv.pushpull(keys, [np.full(100, k, np.float32) for k in keys], out=outs)
    assert [call[:2] for call in backend.calls] == [('push', keys), ('pull', keys)]
    assert [o.tolist() for o in outs] == [[k] * 100 for k in keys]


def test_a_pushpull_sends_each_waves_pulls_behind_it_and_lands_every_result():
    kv, backend = store({'type': 'bf16', 'pull': 'fp16'})
    sizes = [BIG, 10, 20, BIG, 30]
    kv.init(list(range(5)), [np.zeros(n, np.float32) for n in sizes])
    outs = [np.zeros(n, np.float32) for n in sizes]
    kv.pushpull(list(range(5)), [np.full(n, k + 1.0, np.float32) for k, n in
                                 enumerate(sizes)], out=outs)
    assert [call[:2] for call in backend.calls] == [
        ('push', [0]), ('pull', [0]), ('push', [1, 2, 3]), ('pull', [1, 2, 3]),
        ('push', [4]), ('pull', [4])]
    assert [o.tolist() for o in outs] == [[k + 1.0] * n for k, n in enumerate(sizes)]


def test_a_pushpull_into_the_pushed_arrays_and_a_strided_value():
    """out=None writes the results into the pushed values; a value that is not contiguous
    is encoded as its elements (read through a copy)."""
    kv, _ = store({'type': 'fp16'})
    kv.init(['a', 'b'], [np.zeros((4, 3), np.float32), np.zeros(BIG, np.float32)])
    strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    big = np.full(BIG, 2.0, np.float32)
    kv.pushpull(['a', 'b'], [strided, big])
    assert strided.tolist() == (np.arange(24).reshape(4, 6)[:, ::2]).tolist()
    assert big.tolist() == [2.0] * BIG


def test_nothing_is_sent_when_a_later_key_is_bad():
    """Every value is checked before the first wave is encoded or sent."""
    kv, backend = store({'type': 'fp16'})
    kv.init([0, 1], [np.zeros(BIG, np.float32), np.zeros(4, np.float32)])
    with pytest.raises(kvps.errors.ShapeError, match='key 1'):
        kv.pushpull([0, 1], [np.ones(BIG, np.float32), np.ones(5, np.float32)],
                    out=[np.zeros(BIG, np.float32), np.zeros(4, np.float32)])
    assert backend.calls == [] and not kv._residuals


def test_a_push_of_no_keys_reaches_the_backend_once():
    kv, backend = store({'type': 'fp16'})
    kv.push([], [])
    assert backend.calls == [('push', [], [])]
