"""Optimizer update kernels: numpy reference and cupy/CUDA, chosen by where the array lives.

Both modules expose the same functions (`sgd_update`, `nag_update`, `adam_update`,
`adamw_update`, `adagrad_update`, `rmsprop_update`, `lamb_update`, `ftrl_update`,
`signum_update`, `test_update`) with the same signatures, plus `zeros_like`, `to_host`,
`from_host` and `multi_update`. cupy is imported only when a cupy array shows up.
"""

from kvps.errors import DTypeError

KERNEL_NAMES = ('sgd_update', 'nag_update', 'adam_update', 'adamw_update', 'adagrad_update',
                'rmsprop_update', 'lamb_update', 'ftrl_update', 'signum_update', 'test_update')


def is_cupy(array):
    """True for cupy arrays, detected without importing cupy."""
    return type(array).__module__.startswith('cupy')


def kernels_for(array):
    """The kernel module for an array: cuda_kernels for cupy arrays, numpy_kernels for numpy."""
    if is_cupy(array):
        from kvps._kernels import cuda_kernels
        return cuda_kernels
    import numpy as np
    if isinstance(array, np.ndarray):
        from kvps._kernels import numpy_kernels
        return numpy_kernels
    raise DTypeError(f'no optimizer kernels for {type(array).__module__}.'
                     f'{type(array).__name__}; expected a numpy or cupy array')


def multi_apply(calls):
    """Run many updates, e.g. one per small key: calls is [(kernel name, args, kwargs)] with
    the weight first in args. Calls are grouped by device module and handed to its
    `multi_update` in their original order (a key's updates never reorder)."""
    groups = {}
    for call in calls:
        groups.setdefault(kernels_for(call[1][0]), []).append(call)
    for module, group in groups.items():
        module.multi_update(group)
