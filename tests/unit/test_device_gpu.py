"""Device stores and the Trainer on real GPUs: sums on the device, pulls onto every device, cupy
and torch through DLPack, bfloat16 sums, CUDA parameters against a CPU reference."""

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip('torch')
if not torch.cuda.is_available():
    pytest.skip('no CUDA device', allow_module_level=True)

import kvps
from kvps import devices  # noqa: E402
from kvps.errors import DTypeError  # noqa: E402
from kvps.kvstore import KVStore  # noqa: E402
from kvps.kvstore.local import LocalBackend  # noqa: E402

GPUS = [torch.device('cuda', i) for i in range(torch.cuda.device_count())]
HAS_CUPY = importlib.util.find_spec('cupy') is not None


def spread(n):
    """n devices, cycling over the GPUs present (with one GPU: n times cuda:0)."""
    return [GPUS[i % len(GPUS)] for i in range(n)]


def test_several_cuda_values_per_key_sum_exactly():
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(10001).astype(np.float32) for _ in range(4)]
    want = host[0].copy()
    for h in host[1:]:
        want += h                     # the store's order: first value, then each other
    values = [torch.from_numpy(h).to(d) for h, d in zip(host, spread(4))]
    kv = kvps.create('device')
    kv.init(0, torch.zeros(10001, device=GPUS[0]))
    kv.push(0, values)
    out = torch.zeros(10001, device=GPUS[0])
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out.cpu().numpy(), want)
    for v, h in zip(values, host):    # pushed values are never modified
        np.testing.assert_array_equal(v.cpu().numpy(), h)


def test_pull_lands_on_every_device():
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    kv = kvps.create('device')
    kv.init('w', w.to(GPUS[0]))
    targets = [torch.zeros(3, 4, device=d) for d in spread(3)]
    targets += [torch.zeros(4, 3, device=GPUS[-1]).t(), torch.zeros(3, 4)]
    pointers = [t.data_ptr() for t in targets]
    kv.pull('w', out=targets)
    assert [t.data_ptr() for t in targets] == pointers
    assert [t.device for t in targets] == spread(3) + [GPUS[-1], torch.device('cpu')]
    for t in targets:
        assert torch.equal(t.cpu(), w)


def test_bfloat16_values_sum_on_the_device():
    kv = kvps.create('device')
    kv.init(0, torch.zeros(8, dtype=torch.bfloat16, device=GPUS[0]))
    kv.push(0, [torch.full((8,), x, dtype=torch.bfloat16, device=d)
                for x, d in zip((1.5, 2.25, 4.0), spread(3))])
    out = torch.zeros(8, dtype=torch.bfloat16, device=GPUS[0])
    kv.pull(0, out=out)
    assert (out.float() == 7.75).all()


@pytest.mark.parametrize('name', ['local', 'dist_sync', 'dist_async'])
def test_non_device_stores_refuse_cuda_tensors(name):
    kv = KVStore(name, LocalBackend())
    with pytest.raises(DTypeError, match='cuda:0.*dist_sync_device'):
        kv.init(0, torch.zeros(3, device=GPUS[0]))


def test_pushes_are_staged_in_fresh_pinned_buffers(recording_backend):
    backend = recording_backend
    kv = KVStore('dist_sync_device', backend)
    kv.init(0, torch.zeros(4, device=GPUS[0]))
    for step in range(5):
        kv.push(0, [torch.full((4,), float(step), device=d) for d in spread(2)])
    assert [float(h[0]) for h in backend.held] == [2.0 * s for s in range(5)]
    assert all(h.base.is_pinned() for h in backend.held)


@pytest.mark.skipif(not HAS_CUPY, reason='cupy is not installed')
def test_cupy_and_torch_are_exchanged_through_dlpack_without_copies():
    import cupy as cp
    c = cp.arange(6, dtype=cp.float32)
    view = devices.as_torch(c)
    assert view.data_ptr() == c.data.ptr and view.device.index == c.device.id
    t = torch.arange(6, dtype=torch.bfloat16, device=GPUS[0])
    k = devices.kernel_view(t)
    assert k.data.ptr == t.data_ptr() and k.dtype == cp.uint16
    kv = kvps.create('device')
    kv.init(0, c)
    kv.push(0, [c, torch.ones(6, device=GPUS[-1])])
    c_out, t_out = cp.zeros(6, dtype=cp.float32), torch.zeros(6, device=GPUS[-1])
    kv.pull(0, out=[c_out, t_out])
    assert cp.asnumpy(c_out).tolist() == t_out.tolist() == [1, 2, 3, 4, 5, 6]
    assert cp.asnumpy(c).tolist() == [0, 1, 2, 3, 4, 5]


def _train(device, kvstore, update_on_kvstore):
    """Three SGD steps with known gradients (loss = sum(p * c)): the same numbers on any device."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 7, generator=gen).to(device))
    b = torch.nn.Parameter(torch.randn(7, generator=gen).to(device))
    kv = KVStore(kvstore, LocalBackend()) if kvstore else None
    trainer = kvps.Trainer([w, b], 'sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.01},
                           kvstore=kv, update_on_kvstore=update_on_kvstore)
    # with a store, w and b share one fused key on their device (packed by torch.cat there)
    assert [len(f.members) for f in trainer._layout.fused] == ([2] if kv is not None else [])
    for _ in range(3):
        cw, cb = torch.randn(5, 7, generator=gen), torch.randn(7, generator=gen)
        trainer.zero_grad()
        ((w * cw.to(device)).sum() + (b * cb.to(device)).sum()).backward()
        trainer.step(4)
    assert w.device == b.device == torch.device(device)
    return [w.detach().cpu(), b.detach().cpu()]


@pytest.mark.parametrize('kvstore, update_on_kvstore', [
    ('dist_sync_device', True), ('dist_sync_device', False), (None, None)])
def test_trainer_on_cuda_parameters_matches_the_cpu(kvstore, update_on_kvstore):
    if not update_on_kvstore and not HAS_CUPY:
        pytest.skip('local updates of CUDA parameters need cupy')
    want = _train('cpu', kvstore, update_on_kvstore)
    got = _train(GPUS[0], kvstore, update_on_kvstore)
    for g, w in zip(got, want):   # the CUDA kernels match numpy's bit for bit for SGD
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_trainer_refuses_cuda_parameters_on_host_stores():
    with pytest.raises(ValueError, match='dist_sync_device'):
        kvps.Trainer([torch.nn.Parameter(torch.ones(3, device=GPUS[0]))], 'sgd',
                     kvstore=KVStore('dist_sync', LocalBackend()))


@pytest.mark.skipif(not HAS_CUPY, reason='local updates of CUDA parameters need cupy')
def test_float16_autocast_under_a_grad_scaler_trains_as_torch_sgd_does():
    """docs/trainer.md's loop on a GPU: float16 autocast, GradScaler('cuda'), the sums from
    allreduce_grads(); an inf step is skipped on the Trainer as on torch's SGD."""
    def run(make):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)).to(GPUS[0])
        opt = make(net)
        scaler = torch.amp.GradScaler('cuda', init_scale=2.0 ** 12, growth_interval=2)
        scales = []
        for factor in [1.0, float('inf'), 2.0, 0.5]:
            opt.zero_grad()
            with torch.autocast('cuda', dtype=torch.float16):
                loss = net(torch.linspace(-1, 1, 64, device=GPUS[0]).reshape(4, 16)).sum()
            scaler.scale(loss.float() * factor).backward()
            if not isinstance(opt, torch.optim.Optimizer):
                opt.allreduce_grads()
            scaler.step(opt, *([] if isinstance(opt, torch.optim.Optimizer) else [1]))
            scaler.update()
            scales.append(scaler.get_scale())
        return [p.detach().cpu() for p in net.parameters()], scales
    want = run(lambda net: torch.optim.SGD(net.parameters(), lr=0.125))
    got = run(lambda net: kvps.Trainer(net, 'sgd', {'learning_rate': 0.125},
                                       kvstore=KVStore('dist_sync_device', LocalBackend()),
                                       update_on_kvstore=False))
    assert got[1] == want[1] == [4096.0, 2048.0, 2048.0, 4096.0]
    for g, w in zip(got[0], want[0]):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_a_torch_optimizer_trains_cuda_parameters_without_cupy():
    """Workers updating with torch's AdamW need no kvps kernel: the sums land in .grad on
    the GPU and torch applies them, as torch alone does."""
    def run(store):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)).to(GPUS[0])
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        t = kvps.Trainer(net, opt, kvstore=store) if store else None
        for step in range(3):
            (t or opt).zero_grad()
            net(torch.linspace(-1, 1, 64, device=GPUS[0]).reshape(4, 16) * step).sum().backward()
            if t is not None:
                t.step(1)
            else:
                opt.step()
        return [p.detach().cpu() for p in net.parameters()]
    got, want = run(KVStore('dist_sync_device', LocalBackend())), run(None)
    assert all(map(torch.equal, got, want))
