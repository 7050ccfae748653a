"""A pull into an array of another dtype than the key's casts, as MXNet's CopyFromTo does."""

import numpy as np
import pytest
import torch

import kvps
from kvps.errors import ShapeError

DTYPES = ['float16', 'bfloat16', 'float32', 'float64', 'int8', 'uint8', 'int32', 'int64']
# Values every dtype holds (no negatives: uint8), some not integers (truncated toward zero),
# some not exact in float16 or bfloat16 (rounded to nearest even)
VALUES = [0.0, 1.5, 2.75, 3.0, 100.25, 7.125, 99.9, 0.3]


def tensor(dtype, values=VALUES):
    return torch.tensor(values, dtype=torch.float64).to(getattr(torch, dtype))


def key_value(dtype):
    """The key's value as stored: the values cast to the key's dtype."""
    return tensor(dtype)


@pytest.mark.parametrize('target', DTYPES)
@pytest.mark.parametrize('stored', DTYPES)
def test_a_pull_casts_into_a_target_of_any_dtype(stored, target):
    kv = kvps.create('local')
    kv.init('k', key_value(stored))
    out = torch.full((len(VALUES),), 42, dtype=getattr(torch, target))
    kv.pull('k', out=out)
    expected = key_value(stored).to(getattr(torch, target))   # torch casts as C and MXNet do
    assert torch.equal(out, expected), (out, expected)


@pytest.mark.parametrize('stored', ['float16', 'float32', 'bfloat16'])
def test_targets_of_several_dtypes_in_one_pull(stored):
    kv = kvps.create('local')
    kv.init(3, key_value(stored))
    same = torch.zeros(len(VALUES), dtype=getattr(torch, stored))
    wide = np.zeros(len(VALUES), np.float64)
    narrow = torch.zeros(len(VALUES), dtype=torch.float16)
    strided = torch.zeros(2 * len(VALUES), dtype=torch.float32)[::2]
    kv.pull([3, 3, 3, 3], out=[wide, same, narrow, strided])   # the key's dtype not first
    assert torch.equal(same, key_value(stored))
    assert np.array_equal(wide, key_value(stored).double().numpy())
    assert torch.equal(narrow, key_value(stored).to(torch.float16))
    assert torch.equal(strided, key_value(stored).float())


def test_pushpull_and_a_key_of_numpy_targets_cast_too():
    kv = kvps.create('local')
    kv.init(0, np.zeros(4, np.float16))
    out = np.zeros(4, np.float32)
    kv.pushpull(0, np.full(4, 1.5, np.float16), out=out)
    assert out.tolist() == [1.5] * 4


def test_a_target_of_another_shape_is_still_refused_before_anything_is_written():
    kv = kvps.create('local')
    kv.init(0, np.ones(4, np.float32))
    good, bad = np.zeros(4, np.float64), np.zeros(5, np.float64)
    with pytest.raises(ShapeError, match='shape'):
        kv.pull([0, 0], out=[good, bad])
    assert not good.any()
