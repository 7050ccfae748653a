"""2-bit gradient compression: MXNet's quantization with error feedback, the wire payload, the
server's decoding and its checks, and set_gradient_compression on a store."""

import numpy as np
import pytest

import kvps
from kvps import compression
from kvps.kvstore import KVStore
from kvps.kvstore.local import LocalBackend
from kvps.wire import protocol as P
from kvps.errors import ConfigError, DTypeError, ProtocolError


def reference(grads, t):
    """A plain transcription of the rule: per element, residual += g; send +t if the residual
    is >= t (and take t off it), -t if <= -t (and add t back), else 0."""
    residual = np.zeros(len(grads[0]), np.float32)
    sent = []
    for g in grads:
        out = np.zeros_like(residual)
        for i, value in enumerate(np.asarray(g, np.float32)):
            residual[i] += value
            if residual[i] >= np.float32(t):
                out[i], residual[i] = t, residual[i] - np.float32(t)
            elif residual[i] <= -np.float32(t):
                out[i], residual[i] = -t, residual[i] + np.float32(t)
        sent.append(out)
    return sent, residual


def send(codec, grads, key='k', dtype=np.float32):
    """What the server receives for each push of ``grads`` through ``codec``."""
    got = []
    for g in grads:
        g = np.asarray(g, dtype)
        out = np.empty(P.nbytes('2bit', g.size), np.uint8)
        payload = codec.encode(key, 0, g, out)
        got.append(compression.decode('2bit', memoryview(payload), g.size, str(g.dtype)))
    return got


@pytest.mark.parametrize('n', [1, 3, 4, 5, 17, 1000])
def test_quantization_follows_the_rule_and_loses_nothing(n):
    rng = np.random.default_rng(n)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(6)]
    codec = compression.parse({'type': '2bit', 'threshold': 0.5}).push
    got = send(codec, grads)
    want, residual = reference(grads, 0.5)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # delayed, never dropped: what was sent plus what is held back is what was pushed
    np.testing.assert_allclose(sum(got) + residual, sum(grads), rtol=1e-5, atol=1e-5)


def test_float64_gradients_keep_a_float64_residual_as_mxnet_does():
    """MXNet's residual has the gradient's dtype. 0.5 - 2**-30 is below a 0.5 threshold, so
    nothing is sent; a float32 residual rounds it up to 0.5 and sends +0.5 at once, and what
    is held back is no longer what was pushed minus what was sent."""
    codec = compression.parse({'type': '2bit', 'threshold': 0.5}).push
    below = 0.5 - 2.0 ** -30
    got = send(codec, [[below, -below, 0.25]] * 3, dtype=np.float64)
    assert [g.tolist() for g in got] == [[0.0, 0.0, 0.0], [0.5, -0.5, 0.5],
                                         [0.5, -0.5, 0.0]]
    held = codec._residuals[('k', 0)]
    assert held.tolist() == [3 * below - 1.0, 1.0 - 3 * below, 0.25]


def test_each_key_part_keeps_its_own_residual():
    codec = compression.parse({'type': '2BIT', 'threshold': 1.0}).push
    for key in ('a', 'b'):
        assert send(codec, [[0.6]], key=key)[0].tolist() == [0.0]
    assert send(codec, [[0.6]], key='a')[0].tolist() == [1.0]      # 1.2 held by 'a' only
    assert send(codec, [[0.3]], key='b')[0].tolist() == [0.0]


@pytest.mark.parametrize('dtype', ['float16', 'float32', 'float64'])
def test_decoding_gives_the_keys_dtype_with_exactly_plus_minus_threshold(dtype):
    codec = compression.parse({'type': '2bit', 'threshold': 0.25}).push
    got, = send(codec, [[1.0, -1.0, 0.1, 0.25, -0.25]], dtype=dtype)
    assert got.dtype == np.dtype(dtype) and got.tolist() == [0.25, -0.25, 0.0, 0.25, -0.25]


def test_the_payload_is_a_float32_threshold_then_four_codes_a_byte():
    codec = compression.parse({'type': '2bit', 'threshold': 2.0}).push
    out = np.empty(P.nbytes('2bit', 5), np.uint8)
    payload = codec.encode('k', 0, np.array([3, -3, 0, 3, -3], np.float32), out)
    assert P.nbytes('2bit', 5) == 4 + 2
    assert payload[:4].view('<f4')[0] == 2.0
    assert payload[4:].tolist() == [0b11_00_10_11, 0b10]


@pytest.mark.parametrize('params, error', [
    ({'type': '3bit'}, "type '3bit' is not supported; kvps has 2bit, fp16, bf16, 1bit, topk"),
    ({'type': '2bit', 'threshold': 0}, 'threshold > 0, got 0'),
    ({'type': '2bit', 'threshold': -1}, 'threshold > 0, got -1'),
    ({'type': '2bit', 'threshold': float('nan')}, 'threshold > 0, got nan'),
    ({'type': '2bit', 'threshold': True}, 'threshold > 0, got True'),
    ({'type': '2bit', 'thresh': 1}, "unknown parameter.*'thresh' for 2bit.*takes type, "
                                    'threshold, pull'),
    ({'type': 'topk', 'ratio': 0}, r'ratio in \(0, 1\].*got 0'),
    ({'type': 'topk', 'ratio': -0.1}, r'ratio in \(0, 1\].*got -0.1'),
    ({'type': 'topk', 'ratio': 1.5}, r'ratio in \(0, 1\].*got 1.5'),
    ({'type': 'topk', 'ratio': float('nan')}, r'ratio in \(0, 1\].*got nan'),
    ({'type': 'topk', 'ratio': '0.1'}, r"ratio in \(0, 1\].*got '0.1'"),
    ({'type': 'topk', 'k': 10}, "unknown parameter.*'k' for topk.*takes type, ratio, pull"),
    ({'type': 'fp16', 'threshold': 0.5}, "unknown parameter.*'threshold' for fp16.*takes type, "
                                         'pull'),
    ({'type': '1bit', 'threshold': 0}, "'threshold' for 1bit.*it has no threshold"),
    ({'type': '1bit', 'chunk': 0}, r'chunk .*an int from 1 to 4294967295, got 0'),
    ({'type': '1bit', 'chunk': 2.5}, r'chunk .*an int from 1 to 4294967295, got 2.5'),
    ({'type': '1bit', 'chunk': True}, r'chunk .*an int from 1 to 4294967295, got True'),
    ({'type': '1bit', 'chunk': 2 ** 32}, r'chunk .*got 4294967296'),
    ({'type': 'bf16', 1: 2}, "unknown parameter.*1 for bf16"),
    ({'type': 'fp16', 'pull': 'int8'}, "pull compression 'int8' is not supported; pulls may "
                                       "travel as 'fp16' or 'bf16'"),
    ({'type': 'none', 'ratio': 0.1, 'bogus': 1}, "unknown parameter.*'bogus' for none"),
    ('2bit', 'must be a dict'),
])
def test_bad_parameters_are_refused_at_the_call_naming_what_is_wrong(params, error):
    with pytest.raises((ValueError, TypeError), match=error):
        compression.parse(params)
    kv = kvps.create('device')   # the store's call raises the same, before anything changes
    with pytest.raises((ValueError, TypeError), match=error):
        kv.set_gradient_compression(params)


def test_parameters_are_read_as_mxnet_scripts_pass_them():
    """Names are case-insensitive; without a type, MXNet's example scripts still pass a
    threshold ({'type': args.gc_type, 'threshold': ...} with gc_type 'none'): taken, unused."""
    assert compression.parse({'type': 'none', 'threshold': 0.5}) == (None, None)
    assert compression.parse({'type': 'NONE', 'pull': 'FP16'}) == (None, 'fp16')
    assert compression.parse({'type': 'TopK', 'ratio': np.float32(0.5)}).push.ratio == 0.5
    assert compression.parse({'type': '2bit'}).push.threshold == 0.5        # MXNet's default
    assert compression.parse({'type': 'topk'}).push.ratio == 0.01
    assert compression.parse({'type': 'bf16', 'pull': None}).pull is None


def test_none_and_type_none_turn_compression_off():
    assert compression.parse(None) == compression.parse({'type': 'none'}) == (None, None)


@pytest.mark.parametrize('payload, message', [
    (np.array(0.5, '<f4').tobytes() + bytes(3), 'expected 6'),
    (np.array(np.nan, '<f4').tobytes() + bytes(2), 'threshold'),
    (np.array(-1.0, '<f4').tobytes() + bytes(2), 'threshold'),
    (np.array(np.inf, '<f4').tobytes() + bytes(2), 'threshold'),
])
def test_the_server_refuses_malformed_payloads(payload, message):
    with pytest.raises(ProtocolError, match=message):
        compression.decode('2bit', payload, 5, 'float32')


def test_the_unused_code_decodes_to_zero():
    payload = np.array(1.0, '<f4').tobytes() + bytes([0b01_01_01_01])
    assert compression.decode('2bit', payload, 4, 'float32').tolist() == [0.0] * 4


def test_a_store_pushes_compressed_values_and_pulls_exact_ones():
    kv = kvps.create('device')
    kv.init([0, 1], [np.zeros(4, np.float32), np.zeros(3)])
    kv.set_optimizer(kvps.optimizer.create('test', rescale_grad=1.0))   # w += g
    kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    for _ in range(3):
        kv.push([0, 1], [[np.full(4, 0.2, np.float32)] * 2, np.array([1.0, -0.3, 0.0])])
    a, b = np.zeros(4, np.float32), np.zeros(3)
    kv.pull([0, 1], out=[a, b])
    # 0.4 a push (two values summed first): 0, 0.5 (0.3 held), 0.5 (0.2 held); 1.0 a push:
    # 0.5 each time (the rest held back); -0.3 a push: nothing until -0.9
    assert a.tolist() == [1.0] * 4 and b.tolist() == [1.5, -0.5, 0.0]
    kv.set_gradient_compression(None)
    kv.push(1, np.array([0.25, 0.25, 0.25]))
    kv.pull(1, out=b)
    assert b.tolist() == [1.75, -0.25, 0.25]


def test_setting_compression_again_keeps_what_was_not_sent():
    """MXNet's residual buffers outlive set_gradient_compression: a second call (same
    threshold or not), or turning it off and on, loses nothing held back."""
    kv = kvps.create('device')
    kv.init(0, np.zeros(2, np.float32))
    kv.set_optimizer(kvps.optimizer.create('test', rescale_grad=1.0))   # w += g
    out = np.zeros(2, np.float32)
    kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    kv.push(0, np.full(2, 0.3, np.float32))        # nothing sent, 0.3 held
    kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    kv.push(0, np.full(2, 0.3, np.float32))        # 0.6: 0.5 sent, 0.1 held
    kv.pull(0, out=out)
    assert out.tolist() == [0.5, 0.5]
    kv.set_gradient_compression(None)
    kv.push(0, np.full(2, 0.25, np.float32))       # uncompressed: exactly what is pushed
    kv.set_gradient_compression({'type': '2bit', 'threshold': 0.25})
    kv.push(0, np.full(2, 0.2, np.float32))        # 0.1 + 0.2: 0.25 sent
    kv.pull(0, out=out)
    assert out.tolist() == [1.0, 1.0]


def bf16(values):
    from kvps.optimizer.kernels.common import f32_to_bf16
    return f32_to_bf16(np.asarray(values, np.float32))


def widened(array):
    from kvps.optimizer.kernels.common import bf16_to_f32
    return bf16_to_f32(array) if array.dtype == np.uint16 else array.astype(np.float32)


@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
def test_low_precision_keys_get_the_threshold_they_can_hold_and_lose_nothing(dtype):
    # 0.3 is 0.2998 in float16 and 0.30078 in bfloat16: the worker quantizes with the value
    # the server will add, so sent + held back is what was pushed (with 0.3 itself, each
    # send would drift the two apart by the rounding error).
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(50).astype(np.float32) for _ in range(8)]
    grads = [bf16(g) if dtype == 'bfloat16' else g.astype(np.float16) for g in grads]
    codec = compression.parse({'type': '2bit', 'threshold': 0.3}).push
    t = compression.sent_threshold(0.3, dtype)
    assert t != np.float32(0.3) and t == widened(bf16([0.3]) if dtype == 'bfloat16'
                                                  else np.float16([0.3]))[0]
    got = []
    for g in grads:
        out = np.empty(P.nbytes('2bit', g.size), np.uint8)
        got.append(compression.decode('2bit', memoryview(codec.encode('k', 0, g, out)), g.size,
                                          dtype))
    assert all(a.dtype == (np.uint16 if dtype == 'bfloat16' else np.float16) for a in got)
    assert set(np.concatenate([widened(a) for a in got]).tolist()) <= {0.0, t, -t}
    held = codec._residuals[('k', 0)]
    np.testing.assert_allclose(sum(widened(a) for a in got) + held,
                               sum(widened(g) for g in grads), atol=2e-6)


def test_a_threshold_a_key_cannot_hold_is_refused():
    with pytest.raises(ValueError, match='float16'):
        compression.sent_threshold(1e-9, 'float16')


def test_integer_keys_are_not_compressed():
    kv = kvps.create('device')
    kv.init(0, np.zeros(4, np.int32))
    kv.set_gradient_compression({'type': '2bit'})
    with pytest.raises(DTypeError, match='2bit.*int32'):
        kv.push(0, np.ones(4, np.int32))


def test_a_store_compresses_bfloat16_pushes():
    torch = pytest.importorskip('torch')
    kv = kvps.create('device')
    kv.init(0, torch.zeros(4, dtype=torch.bfloat16))
    kv.set_optimizer(kvps.optimizer.create('test', rescale_grad=1.0))   # w += g
    kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    for _ in range(3):
        kv.push(0, torch.tensor([0.2, 1.0, -0.3, 0.0], dtype=torch.bfloat16))
    out = torch.zeros(4, dtype=torch.bfloat16)
    kv.pull(0, out=out)
    # bfloat16 0.2 is 0.2001953125: 0, 0.5, 0 (0.1005859375 held); 1.0: 0.5 each time;
    # -0.3 (-0.30078125): 0, -0.5, 0
    assert out.tolist() == [0.5, 1.5, -0.5, 0.0]


def test_2bit_is_a_push_dtype_only():
    push = {'op': P.PUSH, 'id': 1, 'sync': True, 'keys': [[0, 0, '2bit', 5, None, 0]]}
    P.validate_header(push)
    with pytest.raises(ProtocolError, match='dtype'):
        P.validate_header({'op': P.INIT, 'id': 1, 'keys': [[0, 0, '2bit', 5, [5]]],
                           'sync': True})
    frames = P.encode(push, [bytes(P.nbytes('2bit', 5))])
    P.decode(frames)
    with pytest.raises(ProtocolError, match='need 6'):
        P.decode(P.encode(push, [bytes(20)]))


@pytest.mark.parametrize('name', ['local', 'local_update_cpu', 'local_allreduce_cpu'])
def test_a_store_type_without_compression_refuses_it_as_mxnet_does(name):
    """MXNet compresses on 'device' and 'dist*' stores only; elsewhere the params were taken
    and did nothing."""
    kv = kvps.create(name)
    with pytest.raises(ConfigError, match=f"not supported for a '{name}' store.*'device'"):
        kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})


@pytest.mark.parametrize('name', ['device', 'local_allreduce_device', 'dist_sync',
                                  'dist_async', 'dist_sync_device'])
def test_device_and_dist_types_compress_pushes_by_the_2bit_rule(name):
    """What a user of each type that may compress gets: every element of a push arrives as
    +threshold, -threshold or 0, what was not sent is kept for the next pushes, and pulls are
    exact. (The store compresses; here its backend is this process's. test_dist_semantics
    and test_dist_async_device check that servers apply what the codec sends.)"""
    kv = KVStore(name, LocalBackend())
    start = [0.123, -7.5, 3.0, 1e-3]
    kv.init(0, np.array(start, np.float32))
    kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    out = np.zeros(4, np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == np.float32(start).tolist()       # pulls are never compressed
    sent = []
    for grad in ([0.3, -0.7, 0.5, 2.0], [0.3, -0.2, 0.0, 0.0], [0.0, 0.0, -0.6, 0.0],
                 [0.0] * 4, [0.0] * 4):
        kv.push(0, np.array(grad, np.float32))
        kv.pull(0, out=out)       # no optimizer: the store holds what this push sent
        sent.append(out.tolist())
    assert sent == [[0.0, -0.5, 0.5, 0.5],     # 0.3 held; -0.2 held; 1.5 held
                    [0.5, 0.0, 0.0, 0.5],      # 0.6 held: 0.5 sent; -0.4 held; 1.0 held
                    [0.0, 0.0, -0.5, 0.5],     # -0.6: -0.5 sent, -0.1 held; 0.5 held
                    [0.0, 0.0, 0.0, 0.5],      # the last of the 2.0, four pushes late
                    [0.0, 0.0, 0.0, 0.0]]      # nothing is left to send


def test_several_values_of_one_push_are_summed_then_quantized_as_mxnets_dist_stores_do():
    """Two values of 0.3 (one per GPU) sum to 0.6, which sends one threshold (0.5); each value
    quantized alone, as MXNet's single-machine device store does, would send nothing."""
    kv = kvps.create('device')
    kv.init(0, np.zeros(3, np.float32))
    kv.set_optimizer(kvps.optimizer.create('test', rescale_grad=1.0))   # w += g
    kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    kv.push(0, [np.full(3, 0.3, np.float32), np.full(3, 0.3, np.float32)])
    out = np.zeros(3, np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [0.5] * 3
