"""Optimizer update kernels: numpy reference and cupy/CUDA, chosen by where the array lives.

Both modules expose the same functions (`sgd_update`, `nag_update`, `adam_update`,
`adamw_update`, `adagrad_update`, `rmsprop_update`, `lamb_update`, `ftrl_update`,
`signum_update`, `test_update`, and from numpy_more and cuda_more `adadelta_update`,
`adamax_update`, `nadam_update`, `ftml_update`, `lars_update`, `lbsgd_update`, `sgld_update`,
`dcasgd_update`, `adabelief_update`, `lans_update`, and from numpy_rows and cuda_rows
`group_adagrad_update`, whose state has one element per row) with the same signatures, plus
`zeros_like`, `widen`, `add_widened`, `narrow`, `to_host`, `from_host` and
`multi_update(calls, launches=None)`.
cupy is imported only when a cupy array shows up.
"""

import importlib

import numpy as np

from ...errors import DTypeError

KERNEL_NAMES = ('sgd_update', 'nag_update', 'adam_update', 'adamw_update', 'adagrad_update',
                'rmsprop_update', 'lamb_update', 'ftrl_update', 'signum_update', 'test_update',
                'adadelta_update', 'adamax_update', 'nadam_update', 'ftml_update', 'lars_update',
                'lbsgd_update', 'sgld_update', 'dcasgd_update', 'adabelief_update',
                'lans_update', 'group_adagrad_update')


def is_cupy(array):
    """True for cupy arrays, detected without importing cupy."""
    return type(array).__module__.startswith('cupy')


def kernels_for(array):
    """The kernel module for an array: cuda_kernels for cupy arrays, numpy_kernels for numpy.
    Asked several times per key and update: answered by the array's type, once found."""
    module = _BY_TYPE.get(type(array))
    if module is None:
        if is_cupy(array):
            module = _loaded('cuda_kernels')
        elif isinstance(array, np.ndarray):
            module = _loaded('numpy_kernels')
        else:
            raise DTypeError(f'no optimizer kernels for {type(array).__module__}.'
                             f'{type(array).__name__}; expected a numpy or cupy array')
        _BY_TYPE[type(array)] = module
    return module


_BY_TYPE = {}   # array type -> kernel module


_MODULES = {}


def _loaded(name):
    """A kernel module, imported the first time it is needed (cuda_kernels imports cupy)."""
    module = _MODULES.get(name)
    if module is None:
        module = _MODULES[name] = importlib.import_module(f'kvps.optimizer.kernels.{name}')
    return module


def multi_apply(calls, launches=None):
    """Run many updates, e.g. one per small key: calls is [(kernel name, args, kwargs)] with
    the arrays in args (weight, grad, *states) and weight32 in kwargs. Calls are grouped by
    device module and handed to its `multi_update` in their original order (a key's updates
    never reorder). ``launches``: a dict the caller keeps from call to call, where a module
    may keep what it prepared for a call list (the CUDA kernels keep their launches)."""
    groups = {}
    for call in calls:
        groups.setdefault(kernels_for(call[1][0]), []).append(call)
    for module, group in groups.items():
        module.multi_update(group, launches)
