"""SGLD's noise (kernels.noise): standard normal, reproducible from (seed, key, count, element)
alone, and the same bits whatever the blocks, threads or device (the CUDA side: the g++
emulation of the kernels in test_cuda_emulated, and test_kernels_gpu)."""

import hashlib
import math

import numpy as np
import pytest

from kvps.optimizer import create
from kvps.optimizer.kernels import noise, numpy_blocks, numpy_kernels as K
from kvps.optimizer.updater import Updater


def test_draws_are_standard_normal():
    z = noise.gaussian(*noise.stream(0, 'w', 1), 0, 400_000)
    assert abs(z.mean()) < 0.005 and abs(z.std() - 1) < 0.005
    assert abs(np.mean(z ** 3)) < 0.02 and abs(np.mean(z ** 4) - 3) < 0.05   # skew, kurtosis
    z.sort()
    for x in (-2.5, -1.0, -0.3, 0.0, 0.7, 1.5, 3.0):   # the CDF, as Kolmogorov-Smirnov reads it
        empirical = np.searchsorted(z, x) / z.size
        assert abs(empirical - 0.5 * (1 + math.erf(x / math.sqrt(2)))) < 0.003, x


def test_the_logarithm_is_exact_to_a_few_ulps():
    s = np.concatenate([np.random.default_rng(0).uniform(0, 1, 100_000), [1.0, 0.5, 2 ** -60,
                                                                          1e-300]])
    np.testing.assert_allclose(noise._log(s), np.log(s), rtol=1e-15, atol=1e-300)


def test_an_element_draws_the_same_number_wherever_its_block_starts():
    hi, lo = noise.stream(7, 3, 2)
    whole = noise.gaussian(hi, lo, 0, 3 * noise.CHUNK)   # several chunks, pairs at odd starts
    for start, n in ((400, 100), (1, 1), (3, 6), (noise.CHUNK * 2 - 1, 5000)):
        np.testing.assert_array_equal(noise.gaussian(hi, lo, start, n), whole[start:start + n])
    assert abs(np.corrcoef(whole[0::2], whole[1::2])[0, 1]) < 0.02   # a pair's two halves


def test_streams_differ_by_seed_key_and_count_and_are_pinned():
    streams = {noise.stream(seed, key, count) for seed in (0, 1) for key in (0, 1, '0', 'w')
               for count in (1, 2)}
    assert len(streams) == 16 and all(0 <= h < 2 ** 32 and 0 <= lo < 2 ** 32
                                      for h, lo in streams)
    # a job's noise must not change from one kvps version to the next (a rerun reproduces it)
    draws = noise.gaussian(*noise.stream(42, 'layer.weight', 3), 0, 64)
    assert hashlib.sha256(draws.tobytes()).hexdigest()[:16] == PINNED


PINNED = 'cc708d8a52a0b7b1'   # the first 64 draws above, little-endian float64


def test_an_sgld_job_is_reproducible_and_its_noise_is_its_own():
    def train(seed, key, threads=1):
        numpy_blocks.set_threads(threads)
        try:
            updater, weight = Updater(create('sgld', seed=seed)), np.zeros(300_000, np.float32)
            for _ in range(2):
                updater.update(key, weight, np.zeros(300_000, np.float32))
            return weight
        finally:
            numpy_blocks.set_threads(1)
    first = train(5, 'w')
    np.testing.assert_array_equal(train(5, 'w', threads=3), first)   # split over threads
    assert not np.array_equal(train(6, 'w'), first)
    assert not np.array_equal(train(5, 'v'), first)
    # w = sum of two draws of N(0, sqrt(lr)): lr 0.01 (the default), std 0.1 * sqrt(2)
    assert abs(first.std() - 0.1 * math.sqrt(2)) < 0.002


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_the_kernels_noise_is_the_draws_scaled_by_sqrt_lr(dtype):
    weight, hi, lo = np.zeros(1000, dtype), *noise.stream(1, 'k', 1)
    K.sgld_update(weight, np.zeros(1000, dtype), 0.04, 0.0, 1.0, None, noise_hi=hi,
                  noise_lo=lo)
    np.testing.assert_array_equal(weight, (noise.gaussian(hi, lo, 0, 1000) * 0.2).astype(dtype))
