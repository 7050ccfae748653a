"""The contract of kvps.kvstore.backend.Backend as checks that any backend of a one-worker job
must pass: LocalBackend in test_backend_conformance.py, DistClient inside a real job in
tests/cluster/test_backend_conformance_cluster.py (which puts this folder on the job's
PYTHONPATH). Each check takes a fresh or a used backend (its keys are its own) and returns
None, or a word naming which of two allowed behaviours it met."""

import inspect
import os
import traceback

import numpy as np

from kvps.errors import ConfigError, KVPSError
from kvps.kvstore.backend import Backend
from kvps.optimizer.kernels.common import bf16_to_f32, f32_to_bf16

F32 = np.dtype('float32')


def protocol_members():
    """``(data member names, {method name: signature})`` that Backend declares."""
    data = set(Backend.__annotations__)
    methods = {name: inspect.signature(value) for name, value in vars(Backend).items()
               if inspect.isfunction(value) and not name.startswith('_')}
    return data, methods


def signature_mismatches(cls):
    """Backend's methods that ``cls`` lacks or takes other parameters for (names, kinds and
    defaults must match: the store calls them by keyword too)."""
    _, methods = protocol_members()
    wrong = {}
    for name, declared in methods.items():
        got = getattr(cls, name, None)
        if not callable(got):
            wrong[name] = 'missing'
        elif _shape(inspect.signature(got)) != _shape(declared):
            wrong[name] = str(inspect.signature(got))
    return wrong


def _shape(signature):
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def _init(backend, key, value):
    """Initialize ``key`` with a copy of ``value``, as the store hands it over; returns the
    copy handed, to check that the backend never writes it."""
    handed = value.reshape(-1).copy()
    backend.init([(key, handed, value.shape, value.dtype.name)])
    return handed


def _pulled(backend, key, like):
    out = np.full(like.size, -7, like.dtype)
    backend.pull([(key, out, like.dtype.name)])
    return out.reshape(like.shape)


# -- checks, in the order a job runs them (optimizers last: they change what push means) ------
def check_identity(backend):
    """One worker of its own process: every data member the protocol declares is there."""
    assert isinstance(backend, Backend)
    assert (backend.rank, backend.num_workers, backend.sync) == (0, 1, True)
    assert backend.num_servers >= 1 and isinstance(backend.keys, dict)
    assert backend.num_hosts == 1   # (a job on loopback)
    assert backend.closed is False and backend.forked is False and backend.pid == os.getpid()


def check_init_then_pull_and_nothing_handed_is_written(backend):
    value = np.arange(12, dtype=F32)
    handed = _init(backend, 'c.init', value)
    assert (_pulled(backend, 'c.init', value) == value).all()
    assert (handed == value).all()


def check_a_push_replaces_the_value_and_the_next_pull_sees_it(backend):
    _init(backend, 'c.push', np.zeros(12, F32))
    handed = np.full(12, 3, F32)
    assert backend.push([('c.push', handed, 'float32')]) is None   # it does not wait
    assert (_pulled(backend, 'c.push', handed) == 3).all()          # no optimizer: replaced
    assert (handed == 3).all()


def check_a_begun_pull_lands_by_its_wait_and_never_after(backend):
    _init(backend, 'c.begin', np.ones(8, F32))
    out = np.zeros(8, F32)
    wait = backend.pull_begin([('c.begin', out, 'float32')])
    assert wait() is None and (out == 1).all()
    backend.push([('c.begin', np.full(8, 5, F32), 'float32')])
    assert (_pulled(backend, 'c.begin', out) == 5).all()
    assert (out == 1).all()     # the backend kept no hold on a target whose wait returned


def check_pushpull_pulls_what_it_pushed(backend):
    _init(backend, 'c.pushpull', np.zeros(6, F32))
    out = np.zeros(6, F32)
    backend.pushpull([[('c.pushpull', np.full(6, 2, F32), 'float32')]],
                     [('c.pushpull', out, 'float32')])
    assert (out == 2).all()


def check_pushpull_takes_runs_as_they_come(backend):
    """Runs given as an iterable (encoded as the backend takes them), each pushing the next
    keys of the pulls: every key's pull sees its push."""
    keys = ['c.runs0', 'c.runs1', 'c.runs2']
    for key in keys:
        _init(backend, key, np.zeros(5, F32))
    outs = [np.zeros(5, F32) for _ in keys]
    runs = ([(key, np.full(5, 3 + i, F32), 'float32') for i, key in chunk]
            for chunk in ([(0, keys[0])], [(1, keys[1]), (2, keys[2])]))
    backend.pushpull(runs, [(key, out, 'float32') for key, out in zip(keys, outs)])
    assert [out.tolist() for out in outs] == [[3.0] * 5, [4.0] * 5, [5.0] * 5]



def check_a_compressed_pull_rounds_float_values_and_nothing_else(backend):
    """With a codec, float32 and float64 values come rounded to it (float16 beyond its range
    to inf), in a frame or in shared memory (the big key), and other dtypes as they are; the
    servers keep full precision."""
    small = np.array([1 / 3, 7e4, -2.5, 1e-9, 1 + 2 ** -9], F32)
    big = np.linspace(-3, 3, 1 << 16).astype(F32)
    with np.errstate(over='ignore'):
        halves = small.astype(np.float16)
    for key, value in [('c.round', small), ('c.round64', small.astype(np.float64) / 7),
                       ('c.roundbig', big), ('c.half', halves)]:
        _init(backend, key, value)
        with np.errstate(over='ignore'):   # 7e4: inf in float16
            half = value.astype(np.float16).astype(value.dtype)
        brain = bf16_to_f32(f32_to_bf16(value)).astype(value.dtype)
        out = np.zeros_like(value)
        backend.pull([(key, out, value.dtype.name)], codec='fp16')
        assert out.tobytes() == half.tobytes(), key
        backend.pull_begin([(key, out, value.dtype.name)], codec='bf16')()
        assert out.tobytes() == (value if value.dtype == np.float16 else brain).tobytes(), key
        double = value * 2   # a new value: what was rounded before is not answered again
        backend.pushpull([[(key, double.reshape(-1).copy(), value.dtype.name)]],
                         [(key, out, value.dtype.name)], codec='bf16')
        assert out.tobytes() == (double if value.dtype == np.float16 else bf16_to_f32(
            f32_to_bf16(double)).astype(value.dtype)).tobytes(), key
        assert _pulled(backend, key, value).tobytes() == double.tobytes(), key

def check_stage_gives_a_block_or_none_per_size(backend):
    sizes = [16, 1 << 20]
    blocks = backend.stage(sizes)
    assert len(blocks) == len(sizes)
    for block, size in zip(blocks, sizes):
        assert block is None or (block.dtype == np.uint8 and block.nbytes >= size
                                 and block.flags.writeable)


def check_parts_cover_a_key_in_order(backend):
    _init(backend, 'c.parts', np.zeros(1000, F32))
    parts = backend.parts('c.parts', 1000)
    assert [start for _, _, start, _ in parts] == [0] + [stop for *_, stop in parts[:-1]]
    assert parts[-1][3] == 1000
    assert all(0 <= server < backend.num_servers for server, *_ in parts)


def check_rows_asked_are_written_and_no_others(backend):
    value = np.arange(12, dtype=F32).reshape(6, 2)
    _init(backend, 'c.rows', value)
    table = np.full((6, 2), -1, F32)
    backend.pull_rows_begin([('c.rows', table, np.array([1, 4]), None)])()
    assert (table[[1, 4]] == value[[1, 4]]).all() and (table[[0, 2, 3, 5]] == -1).all()


def check_rows_changed_since_a_mark(backend):
    value = np.arange(12, dtype=F32).reshape(6, 2)
    _init(backend, 'c.marks', value)
    marks, table = {}, np.full((6, 2), -1, F32)
    backend.pull_rows_begin([('c.marks', table, None, marks)])()   # empty marks: every row
    assert (table == value).all() and marks
    table[...] = -1
    backend.pull_rows_begin([('c.marks', table, None, marks)])()   # nothing changed since
    assert (table == -1).all()


def check_rows_of_the_last_push(backend):
    _init(backend, 'c.live', np.zeros((6, 2), F32))
    backend.push([('c.live', np.full(12, 4, F32), 'float32')])
    sink = []
    backend.pull_live_begin([('c.live', 2, F32, sink)])()
    ids = np.concatenate([got for got, _ in sink])
    values = np.concatenate([rows for _, rows in sink])
    assert ids.tolist() == list(range(6)) and (values == 4).all()   # a dense push: every row


def check_barrier_and_wait_pushes(backend):
    _init(backend, 'c.barrier', np.zeros(2, F32))
    backend.push([('c.barrier', np.ones(2, F32), 'float32')])
    assert backend.wait_pushes() is None
    assert (_pulled(backend, 'c.barrier', np.zeros(2, F32)) == 1).all()
    assert backend.barrier() == [] and backend.barrier(b'\x01' * 32) == []   # one worker


def check_placement_hints_take_effect_for_later_keys(backend):
    assert backend.balance_keys(10_000) is None
    assert backend.keep_keys_whole() is None
    assert backend.scale_rounds() is None   # (a fixed job: its rounds never change size)
    assert backend.joining is False
    _init(backend, 'c.whole', np.zeros(10_000, F32))
    assert len(backend.parts('c.whole', 10_000)) == 1


def check_an_optimizer_its_states_and_a_refused_share(backend):
    _init(backend, 'c.opt', np.zeros(4, F32))
    try:
        backend.set_optimizer({'name': 'no_such_optimizer'})
        raise AssertionError('an unknown optimizer was taken')
    except ConfigError:
        pass
    backend.set_optimizer({'name': 'sgd', 'params': {'learning_rate': 1.0, 'momentum': 0.5}})
    backend.push([('c.opt', np.ones(4, F32), 'float32')])
    assert (_pulled(backend, 'c.opt', np.zeros(4, F32)) == -1).all()
    before = backend.get_states(False)
    assert len(before) == backend.num_servers
    backend.set_states(before)                        # a round trip is taken
    try:
        backend.set_states([{'format': 'not a state'}] * backend.num_servers)
        raise AssertionError('a malformed state was taken')
    except ConfigError:
        pass
    assert backend.get_states(False) == before        # and changed nothing


def check_a_failed_update_is_raised_by_the_push_or_the_next_wait(backend):
    _init(backend, 'c.ints', np.zeros(4, np.int32))   # no optimizer updates int32 weights
    backend.set_optimizer({'name': 'sgd', 'params': {'learning_rate': 1.0}})
    try:
        backend.push([('c.ints', np.ones(4, np.int32), 'int32')])
        backend.wait_pushes()
        raise AssertionError('a failed update was not raised')
    except KVPSError as exc:
        assert 'int32' in str(exc), exc
    backend.wait_pushes()                             # raised once; the backend serves on
    assert (_pulled(backend, 'c.ints', np.zeros(4, np.int32)) == 0).all()


def check_a_python_updater_runs_here_or_is_refused(backend):
    """'runs' in this process, or 'refused' where the servers run elsewhere."""
    _init(backend, 'c.updater', np.zeros(3, F32))
    seen = []
    try:
        backend.set_updater(lambda key, merged, stored: seen.append(key))
    except ConfigError as exc:
        assert 'never sends code' in str(exc), exc
        return 'refused'
    backend.push([('c.updater', np.ones(3, F32), 'float32')])
    assert seen == ['c.updater']
    try:
        backend.get_states(False)
        raise AssertionError('a Python updater has no state to save')
    except ConfigError:
        return 'runs'


def check_close_is_idempotent(backend):
    backend.close()
    backend.close()
    assert backend.closed is True


CHECKS = [check for name, check in list(globals().items()) if name.startswith('check_')]


def run_all(backend):
    """Every check in order on one backend: {name: its word, None, or the failure}."""
    found = {}
    for check in CHECKS:
        try:
            found[check.__name__] = check(backend)
        except Exception:   # noqa: BLE001 (reported, so the test names every failure)
            found[check.__name__] = 'FAILED ' + traceback.format_exc(limit=4)
    return found
