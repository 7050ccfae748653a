"""The Trainer's fused keys: which parameters share a key, and that training, freezing and state files give exactly what separate keys give."""

import pytest

torch = pytest.importorskip('torch')

import kvps
from kvps import Trainer
from kvps.optimizer import states  # noqa: E402
from kvps.trainer.fusion import FUSE_BELOW_BYTES  # noqa: E402
from kvps.kvstore import KVStore  # noqa: E402
from kvps.kvstore.local import LocalBackend  # noqa: E402


def store(name='dist_sync'):
    """A store of the given type on the in-process backend (one worker, no sockets)."""
    return KVStore(name, LocalBackend())


def model(seed=0):
    """Small tensors of two dtypes and two lr_mults, a frozen one and one too big to fuse."""
    g = torch.Generator().manual_seed(seed)

    def p(*shape, dtype=torch.float32):
        return torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))
    params = [p(8, 4), p(8), p(4, 8, dtype=torch.float64), p(4, dtype=torch.float64), p(3, 3),
              p(FUSE_BELOW_BYTES // 4 + 1), p(6), p(5)]
    params[4].lr_mult = params[6].lr_mult = 0.5
    params[7].requires_grad_(False)
    return params


def loss(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return sum((torch.randn(p.shape, generator=g).to(p.dtype) * p * p).sum()
               for p in params if p.requires_grad)


def train(params, trainer, steps, start=0, freeze=None):
    for step in range(start, start + steps):
        if freeze is not None:
            freeze(params, step)
        trainer.zero_grad()
        loss(params, step).backward()
        trainer.step(1, ignore_stale_grad=True)


OPTIMIZERS = [('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.01}),
              ('adam', {'learning_rate': 0.01, 'wd': 0.001}),
              ('rmsprop', {'learning_rate': 0.01, 'centered': True, 'clip_gradient': 0.5})]


def keys_of(trainer):
    return sorted(trainer.kvstore._keys.meta)


def test_layout_groups_by_dtype_and_multiplier_and_leaves_the_rest_alone():
    params = model()
    t = Trainer(params, 'sgd', kvstore=store())
    fused = {f.key: [p.key for p in f.members] for f in t._layout.fused}
    # float32 with lr_mult 1 share key 8, float64 key 9, lr_mult 0.5 key 10; 5 is too big;
    # 7 was frozen at creation
    assert fused == {8: [0, 1], 9: [2, 3], 10: [4, 6]}
    assert keys_of(t) == [5, 7, 8, 9, 10]
    packed = torch.empty(9 + 6)
    t.kvstore.pull(10, out=packed)
    assert torch.equal(packed, torch.cat([params[i].detach().reshape(-1) for i in (4, 6)]))


def test_a_fused_key_holds_parameters_of_one_device():
    """CUDA parameters are fused as CPU ones are, one device per key (torch.cat packs them);
    the meta device stands in for a GPU here: Layout reads only sizes, dtypes and devices."""
    from kvps.trainer.fusion import Layout
    from kvps.trainer.params import Param
    devices = ['cpu', 'meta', 'cpu', 'meta', 'meta']
    params = [Param(i, f'p{i}', torch.nn.Parameter(torch.ones(4, device=d)))
              for i, d in enumerate(devices)]
    layout = Layout(params, kvps.optimizer.create('sgd'), 1 << 20, True, False)
    assert [(f.key, [p.key for p in f.members], f.weight.device.type) for f in layout.fused] \
        == [(5, [0, 2], 'cpu'), (6, [1, 3, 4], 'meta')]
    # what every worker must agree on: which parameters share which key, not the devices
    on_cpu = [Param(i, f'p{i}', torch.nn.Parameter(torch.ones(4))) for i in range(5)]
    assert layout.digest() != Layout(on_cpu, kvps.optimizer.create('sgd'), 1 << 20, True,
                                     False).digest()
    moved = [Param(p.key, p.name, torch.nn.Parameter(torch.ones(4, device=d)))
             for p, d in zip(params, ['meta', 'cpu', 'meta', 'cpu', 'cpu'])]
    assert Layout(moved, kvps.optimizer.create('sgd'), 1 << 20, True, False).digest() \
        == layout.digest()


def test_the_cap_splits_keys_and_nothing_is_fused_without_a_cap_or_with_fuse_false():
    params = [torch.nn.Parameter(torch.zeros(256)) for _ in range(5)]     # 1 KiB each
    t = Trainer(params, 'sgd', kvstore=store(), bucket_bytes=2048)
    assert [[p.key for p in f.members] for f in t._layout.fused] == [[0, 1], [2, 3]]
    assert keys_of(t) == [4, 5, 6]
    for kwargs in ({'bucket_bytes': 0}, {'fuse': False}):
        t = Trainer(params, 'sgd', kvstore=store(), **kwargs)
        assert t._layout.fused == [] and keys_of(t) == [0, 1, 2, 3, 4]


class AcrossHosts(LocalBackend):
    num_hosts = 2   # (what a job whose workers and servers formed on two hosts is told)


def fused_bytes(trainer):
    return [sum(p.tensor.numel() * 4 for p in f.members) for f in trainer._layout.fused]


@pytest.mark.parametrize('backend, cap', [(LocalBackend, 4 << 20), (AcrossHosts, 1 << 20)])
def test_fused_keys_and_buckets_are_smaller_when_the_job_spans_hosts(backend, cap):
    params = [torch.nn.Parameter(torch.zeros(64 << 10)) for _ in range(16)]   # 256 KiB each
    t = Trainer(params, 'sgd', kvstore=KVStore('dist_sync', backend()))
    assert fused_bytes(t) == [cap] * ((4 << 20) // cap) and t._exchange._bucket._cap == cap
    # bucket_bytes given is the user's, on one host or several
    t = Trainer(params, 'sgd', kvstore=KVStore('dist_sync', backend()), bucket_bytes=2 << 20)
    assert fused_bytes(t) == [2 << 20] * 2 and t._exchange._bucket._cap == 2 << 20


def test_whole_tensor_optimizers_are_not_fused_on_the_servers_only():
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    assert Trainer(params, 'lamb', kvstore=store())._layout.fused == []
    t = Trainer(params, 'lamb', kvstore=store(), update_on_kvstore=False)
    assert len(t._layout.fused) == 1     # the servers only sum: LAMB runs per parameter


@pytest.mark.parametrize('name', ['lamb', 'lars', 'lans', 'sgld'])
def test_workers_update_a_fused_key_member_by_member_for_whole_tensor_optimizers(name):
    # LAMB's norms (LARS's, LANS's) and SGLD's noise by element would read the packed
    # members as one weight: their gradients still go fused, their updates per member.
    (fused, t), (alone, _) = fused_and_alone(name, {'learning_rate': 0.01}, uok=False)
    assert [f.updated_whole for f in t._layout.fused] == [False, False, False]
    for a, b in zip(fused, alone):
        assert torch.equal(a, b)


def fused_and_alone(name, kwargs, uok, freeze=None):
    """The same training with fused keys and without: ((params, trainer), (params, trainer)).
    With ``freeze``: two steps of every parameter, then five under ``freeze``."""
    runs = []
    for fuse in (True, False):
        params = model()
        t = Trainer(params, name, dict(kwargs), kvstore=store(), update_on_kvstore=uok,
                    fuse=fuse)
        assert bool(t._layout.fused) is fuse
        train(params, t, 2 if freeze else 4)
        if freeze:
            train(params, t, 5, start=2, freeze=freeze)
        runs.append((params, t))
    return runs


@pytest.mark.parametrize('name, kwargs', OPTIMIZERS)
@pytest.mark.parametrize('uok', [True, False])
def test_fused_training_is_bit_for_bit_unfused_training(name, kwargs, uok):
    (fused, t), (alone, _) = fused_and_alone(name, kwargs, uok)
    for a, b in zip(fused, alone):
        assert torch.equal(a, b)
    if not uok:   # workers update a fused key in one pass when its multipliers are 1
        assert [f.updated_whole for f in t._layout.fused] == [True, True, False]
        assert {key for key, _, _ in t._local.updater.get_states()['states']} == {5, 8, 9, 4, 6}


@pytest.mark.parametrize('name, kwargs', [
    ('lamb', {'learning_rate': 0.01, 'wd': 0.01}),
    ('test_py_dcasgd', {'learning_rate': 0.05, 'momentum': 0.5})])   # reads rows: a plugin's
def test_updates_that_read_weights_whole_run_per_member_of_a_fused_key(name, kwargs, plugin):
    """The workers' sums still travel fused; LAMB's norms, or an update in Python that sees
    each parameter in its shape, then run per member, as without fusion."""
    (fused, t), (alone, _) = fused_and_alone(name, kwargs, False)
    assert t._layout.fused and not any(f.updated_whole for f in t._layout.fused)
    for a, b in zip(fused, alone):
        assert torch.equal(a, b)


def gan(params, step):
    """Alternate halves, as README's GAN recipe does: the split runs through fused keys 8
    ([0, 1]) and 10 ([4, 6])."""
    for i, p in enumerate(params[:7]):
        p.requires_grad_((i in (0, 4)) == (step % 2 == 0))


@pytest.mark.parametrize('name, kwargs', OPTIMIZERS[:2])
@pytest.mark.parametrize('uok', [True, False])
def test_partly_frozen_fused_keys_train_exactly_as_separate_keys(name, kwargs, uok):
    (fused, t), (alone, _) = fused_and_alone(name, kwargs, uok, freeze=gan)
    for a, b in zip(fused, alone):
        assert torch.equal(a, b)
    if uok:   # the servers update whole keys: the split ones were given keys of their own
        assert [[p.key for p in f.members] for f in t._layout.fused] == [[2, 3]]
        assert {0, 1, 4, 6} <= set(keys_of(t))
    else:     # the workers' sums keep them fused (zeros for the frozen); the update of the
        # split one runs per member, with the state it had under the fused key
        assert [f.updated_whole for f in t._layout.fused] == [False, True, False]


def test_allreduce_grads_lands_fused_sums_in_each_trainable_grad():
    params = model()
    t = Trainer(params, 'sgd', kvstore=store(), update_on_kvstore=False)
    params[1].requires_grad_(False)
    loss(params, 0).backward()
    expected = [p.grad.clone() if p.grad is not None else None for p in params]
    t.allreduce_grads()                   # one worker: the sum is its own gradient
    for p, grad in zip(params, expected):
        assert (p.grad is None) if grad is None else torch.equal(p.grad, grad)


@pytest.mark.parametrize('save_fuse, save_uok, load_fuse, load_uok', [
    (True, True, False, True), (True, True, True, False), (False, True, True, True),
    (True, True, True, True), (True, False, True, True), (True, False, False, False),
    (True, False, True, False), (False, False, True, False)])
def test_state_files_are_per_parameter_whoever_fused(tmp_path, save_fuse, save_uok, load_fuse,
                                                     load_uok):
    name, kwargs = OPTIMIZERS[1]
    params = model()
    t = Trainer(params, name, dict(kwargs), kvstore=store(), update_on_kvstore=save_uok,
                fuse=save_fuse)
    train(params, t, 3)
    t.save_states(tmp_path / 's')
    saved = states.read_file(tmp_path / 's')
    assert [key for key, _, _ in saved['keys']] == list(range(7))
    assert saved['optimizer']['lr_mult'] == {4: 0.5, 6: 0.5}     # no fused key's
    at3 = [p.detach().clone() for p in params]
    train(params, t, 2, start=3)
    # another job resumes from the weights and the file of step 3
    again = model()
    with torch.no_grad():
        for p, w in zip(again, at3):
            p.copy_(w)
    t2 = Trainer(again, name, dict(kwargs), kvstore=store(), update_on_kvstore=load_uok,
                 fuse=load_fuse)
    t2.load_states(tmp_path / 's')
    train(again, t2, 2, start=3)
    for a, b in zip(again, params):
        assert torch.equal(a, b)


def test_a_file_missing_some_members_starts_their_key_afresh(caplog):
    merged = {'format': states.FILE_FORMAT, 'num_update': 3, 'keys': [
        [0, 3, {'m': {'dtype': 'float32', 'shape': [2], 'data': bytes(8)}}]]}
    fused = {9: [(0, 0, 2), (1, 2, 5)]}
    assert states.fuse(merged, fused)['keys'] == []
    assert 'left out' in caplog.text
    whole = {'m': {'dtype': 'float32', 'shape': [5], 'data': bytes(range(20))}}
    split = states.unfuse({**merged, 'keys': [[9, 4, whole]]}, fused)
    assert [(k, c, w['m']['shape']) for k, c, w in split['keys']] == [(0, 4, [2]), (1, 4, [3])]
    assert states.fuse(split, fused)['keys'] == [[9, 4, whole]]
    with pytest.raises(kvps.ConfigError, match='not a kvps optimizer-state file'):
        states.fuse([1, 2], fused)


def test_gradients_bucketed_from_several_threads_each_leave_once():
    """Hooks of parameters on several GPUs run on one autograd thread per device: every
    gradient they add leaves in exactly one push."""
    import sys
    import threading
    from kvps.trainer.fusion import PushBucket
    from kvps.trainer.params import Param

    class Recording:
        def __init__(self):
            self.pushed = []

        def push(self, keys, values, priority):
            assert priority == -min(keys)   # the first parameter's the highest
            self.pushed.extend(keys)
    kv = Recording()
    bucket = PushBucket(kv, cap=64)   # 4 gradients of 16 bytes fill it
    start = threading.Barrier(4)

    def hook_thread(first):
        start.wait()
        for key in range(first, first + 500):
            bucket.add(key, torch.ones(4), Param(key, f'p{key}', None))
    threads = [threading.Thread(target=hook_thread, args=(i * 500,)) for i in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads often: between any two bytecodes
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    bucket.flush()
    assert sorted(kv.pushed) == list(range(2000))
