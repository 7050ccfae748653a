"""Compression as a store and a Trainer use it: every type's pushes through a store lose
nothing, residuals outlive a change of type, pulls with 'pull' set are the weights rounded
while the store keeps full precision, and compression_params reach the store."""

import numpy as np
import pytest

import kvps
from kvps.errors import DTypeError
from kvps.kvstore import KVStore
from kvps.kvstore.local import LocalBackend
from kvps.optimizer.kernels.common import bf16_to_f32, f32_to_bf16

TYPES = [{'type': 'fp16'}, {'type': 'bf16'}, {'type': '1bit'}, {'type': 'topk', 'ratio': 0.2}]


def adding_store(params=None, name='device'):
    """A store whose pushes add to the value (the 'test' optimizer: w += g)."""
    kv = KVStore(name, LocalBackend())
    kv.set_optimizer(kvps.optimizer.create('test', rescale_grad=1.0))
    if params is not None:
        kv.set_gradient_compression(params)
    return kv


def pulled(kv, key, like):
    out = np.zeros_like(like)
    kv.pull(key, out=out)
    return out


@pytest.mark.parametrize('params', TYPES, ids=lambda p: p['type'])
@pytest.mark.parametrize('name', ['device', 'dist_sync', 'dist_async_device'])
def test_what_a_store_applied_plus_what_it_holds_is_what_was_pushed(params, name):
    """Several values per push are summed first, then encoded (one residual per key part).
    On a grid of 2**-12 below 2 every sum is exact but 1bit's scale (a mean): to 1e-5."""
    kv = adding_store(params, name)
    kv.init('w', np.zeros(64, np.float32))
    rng = np.random.default_rng(1)
    pushed = np.zeros(64)
    for _ in range(40):
        values = [(rng.integers(-2 ** 12, 2 ** 12, 64) / 2 ** 12).astype(np.float32)
                  for _ in range(2)]
        kv.push('w', values)
        pushed += sum(v.astype(np.float64) for v in values)
    held = kv._residuals[('w', 0)]
    assert held.any()
    np.testing.assert_allclose(pulled(kv, 'w', np.zeros(64, np.float32)) + held.astype(float),
                               pushed, rtol=0, atol=1e-5 if params['type'] == '1bit' else 0)


def test_a_change_of_type_keeps_what_was_not_sent():
    kv = adding_store({'type': 'topk', 'ratio': 0.25})
    kv.init(0, np.zeros(4, np.float32))
    kv.push(0, np.array([1.0, 2.0, 0.5, 0.25], np.float32))     # 2.0 sent, the rest held
    kv.set_gradient_compression({'type': 'fp16'})
    kv.push(0, np.zeros(4, np.float32))                         # the held rest goes now
    assert pulled(kv, 0, np.zeros(4, np.float32)).tolist() == [1.0, 2.0, 0.5, 0.25]
    kv.set_gradient_compression({'type': '1bit'})
    kv.push(0, np.array([1.0, -1.0, 1.0, -1.0], np.float32))
    assert pulled(kv, 0, np.zeros(4, np.float32)).tolist() == [2.0, 1.0, 1.5, -0.75]


@pytest.mark.parametrize('kind', ['fp16', 'bf16', '1bit', 'topk'])
def test_integer_keys_are_refused_at_the_push_naming_the_type(kind):
    kv = adding_store({'type': kind})
    kv.init(0, np.zeros(4, np.int32))
    with pytest.raises(DTypeError, match=f"key 0: {kind} gradient compression.*not int32"):
        kv.push(0, np.ones(4, np.int32))


# -- pulls ------------------------------------------------------------------------------------
WEIGHTS = np.array([1 / 3, -2.5, 1e-9, 1 + 2 ** -9, 7e4], np.float32)


def as_pulled(values, pull):
    if pull == 'fp16':
        with np.errstate(over='ignore'):
            return values.astype(np.float16).astype(values.dtype)
    return bf16_to_f32(f32_to_bf16(values)).astype(values.dtype)


@pytest.mark.parametrize('pull', ['fp16', 'bf16'])
def test_a_pull_with_pull_set_is_the_weight_rounded_and_the_store_keeps_full_precision(pull):
    kv = adding_store({'type': 'none', 'pull': pull})
    kv.init(0, WEIGHTS)
    got = pulled(kv, 0, WEIGHTS)
    assert got.tolist() == as_pulled(WEIGHTS, pull).tolist() and got.tolist() != WEIGHTS.tolist()
    kv.push(0, np.full(5, 2 ** -12, np.float32))     # exact pushes: type 'none'
    after = WEIGHTS + np.float32(2 ** -12)
    assert pulled(kv, 0, WEIGHTS).tolist() == as_pulled(after, pull).tolist()
    kv.set_gradient_compression(None)                # the store kept every bit
    assert pulled(kv, 0, WEIGHTS).tolist() == after.tolist()


def test_rounded_pulls_land_in_every_kind_of_target():
    """float64 and non-contiguous targets, torch tensors, several targets, and pushpull."""
    torch = pytest.importorskip('torch')
    kv = adding_store({'type': 'fp16', 'pull': 'fp16'})
    kv.init(0, WEIGHTS)
    want = as_pulled(WEIGHTS, 'fp16')
    wide, strided, tensor = np.zeros(5), np.zeros(10, np.float32)[::2], torch.zeros(5)
    kv.pull(0, out=[wide, strided, tensor])
    assert wide.tolist() == strided.tolist() == tensor.tolist() == want.tolist()
    out = np.zeros(5, np.float32)
    kv.pushpull(0, np.zeros(5, np.float32), out=out)
    assert out.tolist() == want.tolist()
    kv.pull_begin(0, out=out)()
    assert out.tolist() == want.tolist()


def test_pulls_of_other_dtypes_and_rows_stay_exact():
    kv = adding_store({'type': 'fp16', 'pull': 'bf16'})
    kv.init([0, 1, 2], [np.arange(4, dtype=np.int64) * 10 ** 12, np.float16([0.1, 3]),
                        WEIGHTS.reshape(5, 1)])
    assert pulled(kv, 0, np.zeros(4, np.int64)).tolist() == [0, 10 ** 12, 2 * 10 ** 12,
                                                             3 * 10 ** 12]
    assert pulled(kv, 1, np.zeros(2, np.float16)).tolist() == np.float16([0.1, 3]).tolist()
    rows = np.zeros((5, 1), np.float32)
    kv.row_sparse_pull(2, out=rows, row_ids=np.array([0, 3]))
    assert rows[[0, 3], 0].tolist() == WEIGHTS[[0, 3]].tolist()


# -- the Trainer --------------------------------------------------------------------------------
@pytest.mark.parametrize('params', [{'type': 'fp16', 'pull': 'fp16'}, {'type': 'bf16'},
                                    {'type': '1bit'}, {'type': 'topk', 'ratio': 0.5}],
                         ids=lambda p: p['type'])
def test_compression_params_reach_the_store_of_a_trainer(params):
    torch = pytest.importorskip('torch')
    kind, pull = params['type'], params.get('pull')
    grad = torch.tensor([1 / 3, -3.0, 2.0, -2.0])
    x = torch.nn.Parameter(torch.zeros(4))
    trainer = kvps.Trainer([x], 'sgd', {'learning_rate': 1.0},
                           kvstore=KVStore('dist_sync', LocalBackend()), compression_params=params)
    x.grad = grad.clone()
    trainer.step(1)                            # the servers get the decoded push, then SGD
    g = grad.numpy()
    if kind == 'fp16':
        want = -g.astype(np.float16).astype(np.float32)
    elif kind == 'bf16':
        want = -bf16_to_f32(f32_to_bf16(g))
    elif kind == '1bit':                       # the mean of 1/3 and 2, the mean of -3 and -2
        p, q = bf16_to_f32(f32_to_bf16(np.float32([(1 / 3 + 2) / 2, 2.5])))
        want = -np.float32([p, -q, p, -q])
    else:                                      # 2 of 4: -3, then 2 (ties -2: lower index)
        want = -np.float32([0.0, -3.0, 2.0, 0.0])
    if pull:
        want = as_pulled(want, pull)
    assert x.detach().numpy().tolist() == want.tolist()
    assert trainer.kvstore._codec.name == kind and trainer.kvstore._pull_codec == pull
