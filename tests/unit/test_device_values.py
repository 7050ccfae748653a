"""Device store types on a machine without a GPU: host values as before, GPU values refused
by the other stores, staging buffers never reused in flight, and no cupy import."""

import importlib.util
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip('torch')

import kvps
from kvps import devices  # noqa: E402
from kvps.errors import DTypeError  # noqa: E402
from kvps.kvstore import KVStore  # noqa: E402
from kvps.kvstore.local import LocalBackend  # noqa: E402

DEVICE_NAMES = ['device', 'dist_sync_device', 'dist_device_sync', 'dist_async_device',
                'local_allreduce_device']


class CupyLike:
    """What the dispatch looks at for a cupy array, and nothing more: its type's module (cupy
    is recognised by that, never imported), shape, dtype and device id. It only reaches the
    refusal of non-device stores, which reads no data."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.device = type('Device', (), {'id': 0})()


CupyLike.__module__ = 'cupy._core.core'


@pytest.mark.parametrize('name', DEVICE_NAMES)
def test_device_types_sum_several_host_values_exactly(name):
    kv = KVStore(name, LocalBackend())
    kv.init([0, 1], [np.zeros((2, 3), np.float32), torch.zeros(4, dtype=torch.float64)])
    kv.push([0, 1], [[np.full((2, 3), v, np.float32) for v in (1, 2, 4)],
                     [torch.full((4,), v, dtype=torch.float64) for v in (0.5, 0.25)]])
    a, b = np.zeros((2, 3), np.float32), torch.zeros(4, dtype=torch.float64)
    kv.pull([0, 1], out=[a, b])
    assert (a == 7).all() and (b == 0.75).all()


def _strided_and_odd_shapes(kv):
    """Transposed views as values and targets, 0-d and empty keys, torch and numpy mixed;
    returns what every target holds after two pushes."""
    kv.init([0, 1, 2], [torch.zeros(2, 3, dtype=torch.float64), torch.tensor(0.0),
                        np.zeros((0, 3), np.float32)])
    for _ in range(2):
        kv.push([0, 1, 2], [[torch.arange(6.0, dtype=torch.float64).reshape(3, 2).t(),
                             np.arange(6.0).reshape(3, 2).T],
                            [np.array(0.5, np.float32), torch.tensor(0.25)],
                            [torch.zeros(0, 3), np.zeros((0, 3), np.float32)]])
    grid = [torch.zeros(3, 2, dtype=torch.float64).t(), np.zeros((3, 2)).T]
    scalar, empty = [torch.tensor(-1.0), np.array(-1.0, np.float32)], torch.zeros(0, 3)
    kv.pull([0, 1, 2], out=[grid, scalar, empty])
    return [np.asarray(g).tolist() for g in grid], [float(s) for s in scalar], empty.shape


@pytest.mark.parametrize('name', ['dist_sync_device', 'dist_async_device'])
def test_device_types_agree_with_local_on_strided_0d_and_empty_values(name):
    want = ([[[0.0, 4.0, 8.0], [2.0, 6.0, 10.0]]] * 2, [0.75, 0.75], (0, 3))
    assert _strided_and_odd_shapes(kvps.create('local')) == want
    assert _strided_and_odd_shapes(kvps.create('device')) == want
    assert _strided_and_odd_shapes(KVStore(name, LocalBackend())) == want


class InitRecorder(LocalBackend):
    """Records what each init asked of the servers' placement."""

    def __init__(self):
        super().__init__()
        self.asked = []

    def init(self, items, device=False):
        self.asked += [(key, device) for key, *_ in items]
        super().init(items, device)


@pytest.mark.parametrize('name, device', [('dist_sync_device', True), ('dist_async_device',
                                          True), ('dist_sync', False), ('dist_async', False)])
def test_device_side_stores_ask_servers_for_the_gpu(name, device):
    backend = InitRecorder()
    KVStore(name, backend).init([1, 2], [np.zeros(3), np.ones(2)])
    assert backend.asked == [(1, device), (2, device)]


def test_device_store_pull_lands_in_every_target():
    kv = kvps.create('device')
    kv.init('w', np.arange(6, dtype=np.float32).reshape(2, 3))
    targets = [np.zeros((2, 3), np.float32), torch.zeros(2, 3), torch.zeros(3, 2).t(),
               np.zeros((3, 2), np.float32).T]
    pointers = [t.data_ptr() for t in targets[1:3]]
    kv.pull('w', out=targets)
    for t in targets:
        assert np.asarray(t).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert [t.data_ptr() for t in targets[1:3]] == pointers


@pytest.mark.parametrize('name', ['device', 'local'])
def test_several_bfloat16_values_sum_in_float32_as_torch_sum_does(name):
    # 1 + 2**-8 + 2**-8: step by step in bfloat16 each add ties back to 1.0; in float32 the
    # sum is 1.0078125, exactly a bfloat16, which is what torch.stack(...).sum(0) gives too.
    values = [torch.tensor([1.0, 3.0, -2.0]), torch.tensor([2.0 ** -8, 0.5, 1.0]),
              torch.tensor([2.0 ** -8, 0.25, 1.0])]
    values = [v.to(torch.bfloat16) for v in values]
    kv = kvps.create(name)
    kv.init(0, torch.zeros(3, dtype=torch.bfloat16))
    kv.push(0, values)
    out = torch.zeros(3, dtype=torch.bfloat16)
    kv.pull(0, out=out)
    assert out.tolist() == [1.0078125, 3.75, 0.0]
    assert out.tolist() == torch.stack(values).sum(0).tolist()
    assert values[1].tolist() == [2.0 ** -8, 0.5, 1.0]      # pushed values are only read


def test_host_sum_of_bfloat16_tensors_matches_the_host_path():
    from kvps import devices
    values = [torch.full((4,), x, dtype=torch.bfloat16) for x in (1.0, 2.0 ** -8, 2.0 ** -8)]
    total = devices.host_sum(values)
    assert total.dtype == np.uint16
    assert torch.from_numpy(total.view(np.int16)).view(torch.bfloat16).tolist() == [1.0078125] * 4
    assert values[0].tolist() == [1.0] * 4


@pytest.mark.parametrize('name', ['local', 'dist_sync', 'dist_async'])
def test_non_device_stores_name_the_device_types_for_gpu_values(name):
    kv = KVStore(name, LocalBackend())
    with pytest.raises(DTypeError, match=r"cuda:0.*'local'.*dist_sync_device.*CPU"
                       if name == 'local' else 'dist_async_device'):
        kv.init(0, CupyLike((3,), np.float32))
    kv.init(0, np.zeros(3, np.float32))
    with pytest.raises(DTypeError, match='device store type'):
        kv.push(0, [np.ones(3, np.float32), CupyLike((3,), np.float32)])
    with pytest.raises(DTypeError, match='device store type'):
        kv.pull(0, out=[np.zeros(3, np.float32), CupyLike((3,), np.float32)])
    kv.push(0, np.ones(3, np.float32))   # the store is still usable
    out = np.zeros(3, np.float32)
    kv.pull(0, out=out)
    assert (out == 1).all()


def test_gpu_dispatch_reads_the_type_module_only():
    assert devices.on_gpu(CupyLike((1,), np.float32)) and devices.is_value(CupyLike((1,), 'f4'))
    assert not devices.on_gpu(np.zeros(1)) and not devices.on_gpu(torch.zeros(1))
    assert not devices.on_gpu(torch.zeros(1, device='meta')) and not devices.is_value([1.0])


def test_pushed_buffers_are_never_reused_before_acknowledged(recording_backend):
    backend = recording_backend
    kv = KVStore('device', backend)
    kv.init(0, np.zeros(5, np.float32))
    given = []
    for step in range(6):
        values = [np.full(5, step, np.float32), torch.full((5,), 10.0 * step)]
        given += values
        kv.push(0, values if step % 2 else values[:1])
    want = [11 * s if s % 2 else s for s in range(6)]
    assert [float(b[0]) for b in backend.held] == want
    for i, held in enumerate(backend.held):
        assert not any(np.shares_memory(held, other) for other in backend.held[i + 1:])
        assert not any(np.shares_memory(held, np.asarray(v)) for v in given)


def test_host_sum_stages_into_a_fresh_buffer_each_time():
    """The GPU staging function, run on host tensors: the caller's memory is only read, and a
    buffer handed out stays untouched by later sums while it is referenced."""
    held = []
    for step in range(1, 5):
        values = [torch.full((2, 2), float(step), dtype=torch.bfloat16),
                  torch.full((4,), 0.5, dtype=torch.bfloat16)]
        held.append(devices.host_sum(values))
        assert (values[0] == step).all()       # the first value is not the accumulator
    for step, buf in enumerate(held, start=1):
        assert buf.dtype == np.uint16 and buf.shape == (4,)
        assert (torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16) == step + 0.5).all()
    single = torch.arange(6.0).reshape(2, 3).t()  # non-contiguous: flattened in logical order
    assert devices.host_sum([single]).tolist() == [0, 3, 1, 4, 2, 5]


def test_land_writes_every_target_and_kernel_view_shares_memory():
    targets = [torch.zeros(2, 2), np.zeros((2, 2), np.float32)]
    host = devices.pull_buffer(targets, 'float32')
    assert not host.is_pinned() and host.shape == (4,)
    host.copy_(torch.arange(4.0))
    devices.land(host, targets)
    assert targets[0].tolist() == targets[1].tolist() == [[0, 1], [2, 3]]
    p = torch.nn.Parameter(torch.ones(3))
    view = devices.kernel_view(p)
    view[0] = 5
    assert float(p.detach()[0]) == 5


def test_host_paths_never_import_cupy():
    """cupy may be installed; importing kvps and running host values through every store
    kind and the Trainer must still not import it (it takes seconds and GPU memory)."""
    code = textwrap.dedent('''
        import sys
        tried = []

        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] == 'cupy':
                    tried.append(name)
                return None

        sys.meta_path.insert(0, Watch())
        import numpy as np, torch, kvps
        for name in ('local', 'device'):
            kv = kvps.create(name)
            kv.init(0, np.zeros(3, np.float32))
            kv.push(0, [np.ones(3, np.float32), torch.ones(3)])
            kv.pull(0, out=[np.zeros(3, np.float32), torch.zeros(3)])
        p = torch.nn.Parameter(torch.ones(3))
        trainer = kvps.Trainer([p], 'sgd', {'learning_rate': 0.5}, kvstore='device')
        p.sum().backward()
        trainer.step(1)
        assert tried == [] and 'cupy' not in sys.modules, tried
        print('ok')
    ''')
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == 'ok', done.stderr[-2000:]


def test_trainer_refuses_cuda_parameters_it_could_not_move_or_update():
    """The checks read only where each tensor lives, so a stand-in that says 'cuda:0' is
    exactly what they see; the real GPU path is in test_device_gpu.py."""
    from types import SimpleNamespace
    from kvps.trainer.params import Param, check_devices
    on_gpu = [Param(0, 'w', SimpleNamespace(device=torch.device('cuda', 0),
                                            requires_grad=True))]
    for name in ('dist_sync', 'dist_async', 'local'):
        with pytest.raises(ValueError, match=r"w lives on cuda:0.*dist_sync_device"):
            check_devices(on_gpu, KVStore(name, LocalBackend()), True)
    check_devices(on_gpu, KVStore('dist_sync_device', LocalBackend()), True)
    check_devices([Param(0, 'w', torch.ones(1))], KVStore('dist_sync', LocalBackend()), False)
    if importlib.util.find_spec('cupy') is None:
        with pytest.raises(ImportError, match=r'kvps\[cuda\]'):
            check_devices(on_gpu, None, False)
    with pytest.raises(ValueError, match='CPU and CUDA'):
        kvps.Trainer([torch.nn.Parameter(torch.ones(3, device='meta'))], 'sgd')


def send_host_tensors_down_the_gpu_path(monkeypatch):
    """torch runs the GPU path's sums and copies on host tensors too, leaving out only pinning
    and stream synchronisation; forcing host tensors down it checks the stores' and the
    Trainer's plumbing of that path on every machine (test_device_gpu.py runs it for real).
    Returns the list of keys' targets that landed through it."""
    monkeypatch.setattr(devices, 'on_gpu', kvps.arrays.is_torch)
    landed, land = [], devices.land
    monkeypatch.setattr(devices, 'land', lambda host, targets: (landed.append(targets),
                                                                land(host, targets)))
    return landed


def test_device_path_sums_bfloat16_and_lands_everywhere(monkeypatch, recording_backend):
    landed = send_host_tensors_down_the_gpu_path(monkeypatch)
    backend = recording_backend
    kv = KVStore('dist_sync_device', backend)
    kv.init(0, torch.zeros(2, 3, dtype=torch.bfloat16))
    given = [torch.full((2, 3), x, dtype=torch.bfloat16) for x in (1.5, 2.25, 4.0)]
    kv.push(0, given)
    kv.push(0, given[:1])
    assert [float(torch.from_numpy(h.view(np.int16)).view(torch.bfloat16)[0])
            for h in backend.held] == [7.75, 1.5]
    assert [float(g[0, 0]) for g in given] == [1.5, 2.25, 4.0]
    kv.push(0, given[1:])
    targets = [torch.zeros(2, 3, dtype=torch.bfloat16),
               torch.zeros(3, 2, dtype=torch.bfloat16).t()]
    kv.pull(0, out=targets)
    assert all((t == 6.25).all() for t in targets) and len(landed) == 1


def test_device_path_refuses_a_read_only_host_target_before_writing(monkeypatch):
    """A pull with GPU targets also copies into the host targets beside them: a read-only
    one (an array over immutable bytes) must be refused as the host path refuses it, not
    written through torch.from_numpy."""
    send_host_tensors_down_the_gpu_path(monkeypatch)
    kv = KVStore('dist_async_device', LocalBackend())
    kv.init(0, torch.zeros(2))
    kv.push(0, torch.ones(2))
    frozen = np.frombuffer(bytes(8), np.float32)
    on_device = torch.zeros(2)
    with pytest.raises(ValueError, match='read-only'):
        kv.pull(0, out=[on_device, frozen])
    assert frozen.tolist() == [0.0, 0.0] and on_device.tolist() == [0.0, 0.0]


def test_trainer_through_the_device_path_matches_the_host_path(monkeypatch):
    def train():
        gen = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(5, 7, generator=gen))
        trainer = kvps.Trainer([w], 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                               kvstore=KVStore('dist_sync_device', LocalBackend()))
        for _ in range(3):
            trainer.zero_grad()
            (w * torch.randn(5, 7, generator=gen)).sum().backward()
            trainer.step(4)
        return w.detach()
    want = train()
    landed = send_host_tensors_down_the_gpu_path(monkeypatch)
    assert torch.equal(train(), want)
    assert len(landed) == 4   # the initial broadcast, then three steps' weights
