"""The Trainer's parameter table: normalizing what users pass, and proving every worker agrees
on it."""

import dataclasses
import hashlib

from ..devices import DEVICE_TYPES, require_cupy
from ..errors import ConfigError, ParameterMismatchError
from ..optimizer import optimizers as opt_mod
from .torch_updates import TorchOptimizer, is_torch_optimizer


@dataclasses.dataclass
class Param:
    """One torch parameter under the Trainer: its store key (index as given), name, tensor."""
    key: int
    name: str
    tensor: object

    @property
    def trainable(self):
        return bool(self.tensor.requires_grad)

    def describe(self):
        dtype = str(self.tensor.dtype).replace('torch.', '')
        grad = '' if self.trainable else ' (frozen)'
        return f'{self.name}: {tuple(self.tensor.shape)} {dtype}{grad}'


class ParamGroup(dict):
    """torch.optim's parameter group over a Trainer: ``'params'``, read through ``params()``
    (which may refuse), and ``'lr'``, the learning rate, which an assignment sets (torch code
    sets ``group['lr']``, warm-ups say); nothing else can be set."""

    def __init__(self, params, lr, set_lr):
        super().__init__(params=(), lr=lr)
        self._params, self._set_lr = params, set_lr

    def __getitem__(self, name):
        return self._params() if name == 'params' else super().__getitem__(name)

    def __setitem__(self, name, value):
        if name != 'lr':
            raise KeyError(f'{name!r}: of a Trainer\'s parameter group only \'lr\' can be set')
        self._set_lr(value)
        super().__setitem__(name, value)


def collect(params):
    """[Param] from a module, a named_parameters() iterator, a dict name -> tensor or a list of
    tensors, in the order given (Gluon keeps the given order; keys are the positions).
    A tensor given twice (tied weights) is kept once, under its first position."""
    import torch  # lazy: kvps imports without torch
    if isinstance(params, torch.nn.Module):
        params = params.named_parameters()
    elif isinstance(params, dict):
        params = list(params.items())
    if isinstance(params, (str, bytes, torch.Tensor)) or not hasattr(params, '__iter__'):
        raise ValueError('params must be a module, its named_parameters(), a dict name -> '
                         f'parameter or a list of parameters; got {type(params).__name__}')
    items = list(params)
    if not items:
        raise ValueError('params is empty: the Trainer needs at least one parameter')
    named = [_split(i, item, torch) for i, item in enumerate(items)]
    if len({isinstance(item, tuple) for item in items}) > 1:
        raise ValueError('params mixes (name, parameter) pairs and bare parameters')
    seen, out = set(), []
    for key, (name, tensor) in enumerate(named):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(Param(key, name, tensor))
    return out


def _split(index, item, torch):
    """(name, tensor) for one entry; validates that it is a CPU or CUDA leaf tensor kvps can
    share."""
    name, tensor = item if isinstance(item, tuple) and len(item) == 2 else (f'param{index}', item)
    if not isinstance(name, str):
        raise ValueError(f'parameter name at position {index} must be a str, got {name!r}')
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f'params[{index}] ({name}) must be a torch tensor or Parameter, got '
                         f'{type(tensor).__name__}')
    if tensor.device.type not in ('cpu', 'cuda'):
        raise ValueError(f'parameter {name} lives on {tensor.device}; the Trainer updates CPU '
                         'and CUDA tensors')
    if tensor.requires_grad and not tensor.is_leaf:
        raise ValueError(f'parameter {name} is not a leaf tensor (it has a grad_fn), so '
                         'autograd never fills its .grad; pass the leaf parameters')
    if tensor.is_sparse or not tensor.is_contiguous():
        raise ValueError(f'parameter {name} must be a dense contiguous tensor')
    return name, tensor


def check_devices(params, kv, update_on_kvstore, optimizer=None):
    """Refuse CUDA parameters that the setup cannot move or update, before any collective call
    (so every worker fails alike, none waits for the others): a store must be a device store,
    and local updates with a kvps ``optimizer`` run the CUDA kernels, which need cupy."""
    gpu = [p for p in params if p.tensor.device.type == 'cuda']
    if not gpu:
        return
    if kv is not None and 'device' not in kv.type:
        raise ValueError(f'parameter {gpu[0].name} lives on {gpu[0].tensor.device}, but a '
                         f'{kv.type!r} store moves host arrays only; use a device store type '
                         f'({", ".join(DEVICE_TYPES)}) or keep the parameters on the CPU')
    if not (update_on_kvstore or isinstance(optimizer, TorchOptimizer)) and \
            any(p.trainable for p in gpu):
        require_cupy()


def digest(params):
    """32 bytes that differ whenever names, shapes, dtypes, trainability or order differ."""
    text = '\n'.join(f'{p.key} {p.describe()}' for p in params)
    return hashlib.sha256(text.encode()).digest()


def check_same_everywhere(kv, params, layout_digest):
    """Collective: raise ParameterMismatchError on every worker unless every worker's table,
    and then its layout of store keys (``layout_digest``), equals rank 0's (the store's
    agree collective compares digests at a barrier, in sync and async stores alike, so no
    worker waits for a peer that left)."""
    _check_table(kv, params)
    differs = kv.agree(layout_digest)
    if differs:
        raise ParameterMismatchError(
            f'the Trainers of rank(s) {", ".join(map(str, differs))} pack parameters into '
            f"shared store keys differently from rank 0's (this is rank {kv.rank}): give every "
            "worker's Trainer the same fuse and bucket_bytes, and spread the parameters over "
            'devices alike on every worker (all on one device, or split the same way)')


def _check_table(kv, params):
    differs = kv.agree(digest(params))
    if kv.rank in differs:
        raise ParameterMismatchError(_mismatch_message(kv.rank, params))
    if differs:
        raise ParameterMismatchError(
            f'{len(differs)} worker(s) of this job (ranks {", ".join(map(str, differs))}) hold '
            'parameters that differ from rank 0\'s (names, shapes, dtypes, requires_grad or '
            'order); every worker must build the same model and pass its parameters to the '
            'Trainer in the same order')


def _mismatch_message(rank, params):
    shown = '\n  '.join(p.describe() for p in params[:20])
    more = f'\n  ... and {len(params) - 20} more' if len(params) > 20 else ''
    return (f'worker rank {rank}: the parameters given to the Trainer differ from rank 0\'s '
            '(names, shapes, dtypes, requires_grad or order); every worker must build the same '
            f'model and pass its parameters in the same order. This worker has {len(params)}:'
            f'\n  {shown}{more}')


def merge_mults(optimizer, params):
    """Gluon's per-parameter lr_mult/wd_mult: taken from ``tensor.lr_mult``/``.wd_mult``
    attributes when present (read once, at Trainer creation), over the optimizer's tables."""
    for attr, setter in (('lr_mult', optimizer.set_lr_mult), ('wd_mult', optimizer.set_wd_mult)):
        given = {p.key: getattr(p.tensor, attr) for p in params if hasattr(p.tensor, attr)}
        if given:
            try:
                setter({**getattr(optimizer, attr), **given})
            except ConfigError as exc:
                raise ValueError(f'bad {attr} on a parameter: {exc}') from None


def make_optimizer(optimizer, optimizer_params):
    """The Trainer's optimizer: a kvps.optimizer instance as given, one made by name, or a
    torch.optim optimizer's kvps side (TorchOptimizer)."""
    if is_torch_optimizer(optimizer):
        optimizer = TorchOptimizer(optimizer)
    if isinstance(optimizer, opt_mod.Optimizer):
        if optimizer_params:
            raise ValueError('optimizer_params must be None when optimizer is an Optimizer '
                             'instance (set its parameters when creating it)')
        return optimizer
    if isinstance(optimizer, str):
        return opt_mod.create(optimizer, **(optimizer_params or {}))
    raise TypeError('optimizer must be a name (e.g. \'sgd\'), a kvps.optimizer.Optimizer or a '
                    f'torch.optim.Optimizer, got {type(optimizer).__name__}')
