"""Kept CUDA launches (cuda_launch.Round) without a GPU: a call list over the same keys runs
its launches as planned before, with new gradients and scalars uploaded only when they
changed; whatever would make a kept launch wrong plans the list anew."""

import types

import numpy as np
import pytest
from test_cuda_source import FAKE_CUPY, STREAM, DeviceLike, call, plan_of, recording, uploaded

from kvps.errors import DTypeError, ShapeError
from kvps.optimizer import create
from kvps.optimizer.kernels import cuda_kernels as C, cuda_launch as L, cuda_source as src
from kvps.optimizer.updater import Updater


@pytest.fixture
def gpu(monkeypatch):
    """Launches recorded; Rounds built and tables uploaded, counted."""
    log = types.SimpleNamespace(launches=recording(monkeypatch), rounds=0, uploads=[])

    def upload(host):
        log.uploads.append(uploaded(host))
        return log.uploads[-1]
    monkeypatch.setattr(L, 'cupy', lambda: types.SimpleNamespace(**{**vars(FAKE_CUPY),
                                                                    'asarray': upload}))

    class Counted(L.Round):
        def __init__(self, *args):
            log.rounds += 1
            super().__init__(*args)
    monkeypatch.setattr(L, 'Round', Counted)
    return log


SIZES = (10, 70000, 5, 300)


def sgd_keys(sizes=SIZES, momentum=0.9, dtype='float32'):
    return [call('sgd', ['mom'], dict(momentum=momentum), dtype, dtype, False, n)
            for n in sizes]


def again(calls, grads=True, **hyper):
    """The next round's calls over the same keys: new gradients (of as many arrays as
    before), ``hyper`` changed."""
    def new(grad):
        if type(grad) is tuple:
            return tuple(map(new, grad))
        return DeviceLike(grad.shape, grad.dtype) if grads else grad
    return [(name, (args[0], new(args[1]), *args[2:]), dict(kwargs, **hyper))
            for name, args, kwargs in calls]


def table(upload, nkeys, plan):
    """(rows of element counts and pointers, rows of scalars) of an uploaded table."""
    rows_at, width, scalars_at, count, _ = src.table_words(nkeys, len(plan.arrays),
                                                           len(plan.scalars))
    words = upload.host
    return (words[rows_at:scalars_at].reshape(nkeys, width),
            words[scalars_at:].view(np.float64).reshape(nkeys, count))


def test_a_round_over_the_same_keys_runs_its_kept_launches(gpu):
    calls = sgd_keys() + [call('adam', ['mean', 'var'], {}, 'float32', 'float32', False, 7)]
    kept = {}
    C.multi_update(calls, kept)
    assert gpu.rounds == 1 and len(gpu.uploads) == 1   # the sgd table; adam: one key, by value
    calls = again(calls)
    C.multi_update(calls, kept)
    assert gpu.rounds == 1 and len(gpu.uploads) == 2   # new gradients: new pointers
    rows, _ = table(gpu.uploads[-1], 4, plan_of(*calls[0]))
    assert list(rows[:, 2]) == [args[1].data.ptr for _, args, _ in calls[:4]]
    assert gpu.launches[-1][3][2] is calls[4][1][1]    # the adam key's grad, by value
    C.multi_update(again(calls, grads=False), kept)
    assert gpu.rounds == 1 and len(gpu.uploads) == 2   # nothing changed: nothing uploaded
    assert len(gpu.launches) == 6 and len(kept) == 1


def test_new_hyper_parameters_change_only_the_scalars(gpu):
    kept, calls = {}, sgd_keys()
    C.multi_update(calls, kept)
    plan = plan_of(*calls[0])
    for lr, uploads in ((0.2, 2), (0.2, 2), (0.0, 3), (-0.0, 4)):
        C.multi_update(again(calls, grads=False, lr=lr), kept)
        assert len(gpu.uploads) == uploads
        _, scalars = table(gpu.uploads[-1], 4, plan)
        assert np.array_equal(scalars[:, 0].view(np.int64),
                              np.full(4, lr).view(np.int64))   # -0.0 is not 0.0
    assert gpu.rounds == 1


def test_keys_of_other_hyper_parameters_take_their_own_rows(gpu):
    calls = sgd_keys()
    calls[2] = (calls[2][0], calls[2][1], dict(calls[2][2], lr=0.5))   # lr_mult, say
    C.multi_update(calls, {})
    _, scalars = table(gpu.uploads[-1], 4, plan_of(*calls[0]))
    assert list(scalars[:, 0]) == [0.05, 0.05, 0.5, 0.05]


def _reallocated(calls):
    name, args, kwargs = calls[1]
    calls[1] = (name, (DeviceLike(args[0].shape, args[0].dtype), *args[1:]), kwargs)
    return calls


def _retyped(calls):
    calls[1] = call('sgd', ['mom'], dict(momentum=0.9), 'float64', 'float64', False, SIZES[1])
    return calls


def _strided(calls):
    calls[3][1][1].flags = types.SimpleNamespace(c_contiguous=False)
    return calls


def _grad_as(dtype):
    def change(calls):
        name, args, kwargs = calls[0]
        calls[0] = (name, (args[0], DeviceLike(args[0].shape, dtype), *args[2:]), kwargs)
        return calls
    return change


def _two_grads(calls):
    """The first key's grad as two arrays (a sync round's last pushes)."""
    name, args, kwargs = calls[0]
    calls[0] = (name, (args[0], (args[1], DeviceLike(args[1].shape, args[1].dtype)),
                       *args[2:]), kwargs)
    return calls


def _restream(calls):
    STREAM.ptr = 7
    return calls


# what a round may bring -> (the kernels it runs, Rounds now kept)
CHANGES = {
    'a weight reallocated (copy-on-write)': (_reallocated, ['kvps_sgd_mom_f32_f32_f32_f32_multi'],
                                             1),
    'a key added': (lambda calls: calls + sgd_keys((3,)),
                    ['kvps_sgd_mom_f32_f32_f32_f32_multi'], 2),
    'a dtype changed': (_retyped, ['kvps_sgd_mom_f32_f32_f32_f32_multi',
                                   'kvps_sgd_mom_f64_f64_f64_f64'], 1),
    'nesterov turned on': (lambda calls: again(calls, nesterov=True),
                           ['kvps_nag_mom_f32_f32_f32_f32_multi'], 1),
    'a gradient of another dtype': (_grad_as('float16'), ['kvps_sgd_mom_f32_f32_f16_f32',
                                                          'kvps_sgd_mom_f32_f32_f32_f32_multi'],
                                    1),
    'a strided gradient (copied)': (_strided, ['kvps_sgd_mom_f32_f32_f32_f32_multi'], 1),
    'another stream': (_restream, ['kvps_sgd_mom_f32_f32_f32_f32_multi'], 1),
    'a gradient of two arrays': (_two_grads, ['kvps_sgd_mom_f32_f32_f32x2_f32',
                                              'kvps_sgd_mom_f32_f32_f32_f32_multi'], 1),
}


@pytest.mark.parametrize('change', CHANGES)
def test_what_makes_a_kept_round_wrong_plans_it_anew(gpu, change):
    kept, (made, kernels, count), first = {}, CHANGES[change], sgd_keys()
    C.multi_update(first, kept)
    calls = made(again(first))
    del gpu.launches[:]
    C.multi_update(calls, kept)
    assert gpu.rounds == 2 and len(kept) == count
    assert [name for name, *_ in gpu.launches] == kernels
    assert_table_holds(gpu.uploads[-1], calls)
    C.multi_update(again(calls), kept)
    assert gpu.rounds == 2                  # and kept again


def assert_table_holds(upload, calls):
    """The last key's launch points at the arrays of its calls (a strided gradient's copy
    aside)."""
    plans = [plan_of(*c) for c in calls]
    plans = [p for p in plans if p.signature() == plans[-1].signature()]
    rows, _ = table(upload, len(plans), plans[0])
    fixed = [[arr.data.ptr for name, arr in p.arrays if name != 'g'] for p in plans]
    assert [list(np.delete(row[1:], 1)) for row in rows] == fixed


def test_keys_with_two_grads_take_a_pointer_column_for_each_and_a_kernel_of_their_own(gpu):
    calls = [call('sgd', ['mom'], dict(momentum=0.9), 'float32', 'float32', False, n,
                  grads=2) for n in SIZES]
    kept = {}
    C.multi_update(calls, kept)
    assert [name for name, *_ in gpu.launches] == ['kvps_sgd_mom_f32_f32_f32x2_f32_multi']
    plan = plan_of(*calls[0])
    assert [name for name, _ in plan.arrays] == ['w', 'g', 'g2', 'mom']
    rows, _ = table(gpu.uploads[-1], 4, plan)
    assert [list(row[1:]) for row in rows] == [
        [args[0].data.ptr, args[1][0].data.ptr, args[1][1].data.ptr, args[2].data.ptr]
        for _, args, _ in calls]
    calls = again(calls)
    C.multi_update(calls, kept)
    assert gpu.rounds == 1 and len(gpu.uploads) == 2     # kept: new pointers uploaded
    rows, _ = table(gpu.uploads[-1], 4, plan)
    assert [list(row[2:4]) for row in rows] == [[g.data.ptr for g in args[1]]
                                                for _, args, _ in calls]
    calls[2] = (calls[2][0], (calls[2][1][0], calls[2][1][1][0], calls[2][1][2]), calls[2][2])
    del gpu.launches[:]
    C.multi_update(calls, kept)                          # one key's grad now one array
    assert gpu.rounds == 2 and [name for name, *_ in gpu.launches] == [
        'kvps_sgd_mom_f32_f32_f32x2_f32_multi', 'kvps_sgd_mom_f32_f32_f32_f32']


@pytest.mark.parametrize('grad, error', [((), 'two or more'), ('three', 'at most 2'),
                                         ('float16', 'must all be float32')])
def test_a_grad_of_parts_the_kernels_cannot_add_is_refused_before_any_launch(gpu, grad,
                                                                            error):
    name, args, kwargs = sgd_keys((10,))[0]
    parts = {(): (args[1],), 'three': (args[1],) * 3,
             'float16': (args[1], DeviceLike(10, 'float16'))}[grad]
    with pytest.raises((ShapeError, DTypeError), match=error):
        C.multi_update(sgd_keys((5,)) + [(name, (args[0], parts, *args[2:]), kwargs)])
    assert gpu.launches == []


def test_a_state_created_plans_the_round_anew(gpu):
    calls, kept = sgd_keys(momentum=0.0), {}
    C.multi_update(calls, kept)
    assert gpu.launches[-1][0] == 'kvps_sgd_f32_f32_f32_multi'
    calls = [(name, (*args[:2], DeviceLike(args[0].shape, 'float32')), dict(kwargs, momentum=0.9))
             for name, args, kwargs in calls]
    C.multi_update(calls, kept)
    assert gpu.rounds == 2 and gpu.launches[-1][0] == 'kvps_sgd_mom_f32_f32_f32_f32_multi'
    assert_table_holds(gpu.uploads[-1], calls)


def test_keys_with_master_weights_are_described_once_per_set_of_values(gpu, monkeypatch):
    """The updater gives each key with a master copy its own kwargs dict, of values it
    shares with the other keys of one count, lr and wd."""
    calls = [call('adam', ['mean', 'var'], {}, 'float16', 'float16', True, n) for n in SIZES]
    shared = dict(calls[0][2], weight32=None)
    calls = [(name, args, dict(shared, weight32=kwargs['weight32']))
             for name, args, kwargs in calls]
    kept, described = {}, []
    C.multi_update(calls, kept)
    real = L.describe
    monkeypatch.setattr(L, 'describe', lambda *a: described.append(a) or real(*a))
    C.multi_update(again(calls), kept)
    assert len(described) == 1 and gpu.rounds == 1


def test_calls_that_pass_arrays_by_keyword_are_planned_every_time(gpu):
    calls = [(name, args[:2], dict(kwargs, mom=args[2])) for name, args, kwargs in sgd_keys()]
    kept = {}
    C.multi_update(calls, kept)
    C.multi_update(again(calls), kept)
    assert gpu.rounds == 2 and kept == {} and len(gpu.launches) == 2


def test_at_most_rounds_kept_call_lists_are_kept(gpu, monkeypatch):
    monkeypatch.setattr(L, 'ROUNDS_KEPT', 2)
    lists, kept = [sgd_keys((n,)) for n in (3, 4, 5)], {}
    for calls in lists + lists[2:]:
        C.multi_update(calls, kept)
    assert gpu.rounds == 3 and len(kept) == 2   # the first list's Round went first


class CupyLike(DeviceLike):
    __module__ = 'cupy._stand_in'   # kernels_for takes it for a cupy array


def test_the_updater_keeps_its_launches_and_drops_them_with_its_states(gpu, monkeypatch):
    monkeypatch.setattr(L, 'cupy', lambda: types.SimpleNamespace(
        **{**vars(FAKE_CUPY), 'zeros': CupyLike, 'empty': CupyLike}))
    updater = Updater(create('adam', learning_rate=0.1, multi_precision=True))
    weights = {key: CupyLike(n, 'float16') for key, n in enumerate(SIZES)}
    monkeypatch.setattr(C, 'widen', lambda w: CupyLike(w.shape, 'float32'))
    for _ in range(3):
        updater.update_many([(key, 0, w, CupyLike(w.shape, 'float16'))
                             for key, w in weights.items()])
    assert gpu.rounds == 1 and len(gpu.launches) == 3
    updater.install((updater.optimizer, {}, {}, 0, 0))
    assert updater._launches == {}       # they held the states just replaced
    updater.update_many([(key, 0, w, CupyLike(w.shape, 'float16'))
                         for key, w in weights.items()])
    assert gpu.rounds == 2
