"""A big key's numpy update split over threads (KVPS_UPDATE_THREADS) gives, bit for bit, what
one thread gives: every optimizer and dtype, grads as one array, as parts and read-only."""

import os

import numpy as np
import pytest

from kvps.optimizer.kernels import numpy_blocks as B, numpy_kernels as K
from kvps.config import Config
from kvps.errors import ConfigError
from kvps.server.storage import use_update_threads
from test_cuda_source import BASE, CASES, DTYPES, NEEDS_T, live_states, state_dtype

N = 5 * K.BLOCK + 123   # a short last block, and spans that end inside a thread's share


@pytest.fixture
def threads(monkeypatch):
    """Set the thread count for one run; keys of 2+ blocks split (SPLIT_MIN lowered), in
    blocks of another size than BLOCK (LAMB's reducing pass keeps BLOCK)."""
    monkeypatch.setattr(B, 'SPLIT_MIN', 2 * K.BLOCK)
    monkeypatch.setattr(B, 'SPLIT_BLOCK', K.BLOCK + 1000)
    yield K.set_threads
    K.set_threads(1)


def _store(x, dtype):
    return K.f32_to_bf16(x.astype(np.float32)) if dtype == 'bfloat16' else x.astype(dtype)


def _updated(name, states, hyper, wdt, gdt, mp, grad_as):
    """Weight, states and master after 3 steps on fresh copies of the same seeded data."""
    rng = np.random.default_rng(7)
    w = _store(rng.standard_normal(N), wdt)
    master = (K.bf16_to_f32(w) if wdt == 'bfloat16' else w.astype(np.float32)) if mp else None
    sdt = state_dtype(name, wdt, mp)
    live = live_states(name, states, hyper)
    st = {s: np.zeros(N, np.uint16 if sdt == 'bfloat16' else sdt) for s in live}
    for t in range(1, 4):
        g = _store(rng.standard_normal(N) * 1.5, gdt)
        if grad_as == 'parts':
            g = (g, g * 0.5, g * 0.25)
        elif grad_as == 'read-only':
            g.flags.writeable = False
        extra = {'t': t} if name in NEEDS_T else {}
        getattr(K, name + '_update')(w, g, *[st.get(s) for s in states], **BASE, **hyper,
                                     **extra, weight32=master)
    return [w, master, *st.values()]


@pytest.mark.parametrize('wdt,gdt,mp', DTYPES, ids=['-'.join(map(str, d)) for d in DTYPES])
@pytest.mark.parametrize('name,states,hyper,_', CASES,
                         ids=[f'{c[0]}-{i}' for i, c in enumerate(CASES)])
def test_split_update_is_bit_for_bit_one_threads(name, states, hyper, _, wdt, gdt, mp,
                                                  threads):
    grad_as = ['array', 'read-only', 'parts'][(len(name) + len(wdt)) % 3]
    if grad_as == 'parts' and (gdt != wdt or mp or wdt in ('float16', 'bfloat16')):
        grad_as = 'read-only'   # parts are arrays of the compute dtype
    threads(1)
    alone = _updated(name, states, hyper, wdt, gdt, mp, grad_as)
    threads(3)
    split = _updated(name, states, hyper, wdt, gdt, mp, grad_as)
    for a, b in zip(alone, split):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_small_keys_stay_in_the_callers_thread(threads):
    threads(4)
    spans = []
    blocks = (lambda lo, hi, step: spans.append((lo, hi, step)) or [hi - lo])
    assert B.split(blocks, B.SPLIT_MIN - 1, 5 * K.BLOCK) == [B.SPLIT_MIN - 1]
    assert spans == [(0, B.SPLIT_MIN - 1, K.BLOCK)]
    spans.clear()
    b = K.BLOCK
    n = 7 * b + 5   # 8 blocks over 4 threads: 2 each, the last one short
    assert sum(B.split(blocks, n, b)) == n
    assert sorted(spans) == [(0, 2 * b, b), (2 * b, 4 * b, b), (4 * b, 6 * b, b), (6 * b, n, b)]


def test_a_forked_child_gets_threads_of_its_own(threads):
    threads(2)
    w = np.ones(N, np.float32)
    K.test_update(w, np.ones(N, np.float32), lr=0.1, wd=0.0, rescale_grad=1.0,
                  clip_gradient=None)
    pid = os.fork()
    if pid == 0:   # the parent's pool has no threads here: a new one must serve the child
        try:
            K.test_update(w, np.ones(N, np.float32), lr=0.1, wd=0.0, rescale_grad=1.0,
                          clip_gradient=None)
            os._exit(0 if (w == 3).all() else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (w == 2).all()


def test_thread_counts_are_checked():
    with pytest.raises(ValueError, match='at least 1'):
        K.set_threads(0)
    assert Config.from_env({'KVPS_UPDATE_THREADS': '3'}).update_threads == 3
    assert Config.from_env({}).update_threads == 1
    assert Config.from_env({'KVPS_UPDATE_THREADS': 'auto'}).update_threads == 'auto'
    with pytest.raises(ConfigError, match='KVPS_UPDATE_THREADS'):
        Config.from_env({'KVPS_UPDATE_THREADS': '0'})
    try:
        assert 1 <= use_update_threads('auto') <= 4
        assert use_update_threads(2) == 2 and B._pool.threads == 2
    finally:
        K.set_threads(1)
