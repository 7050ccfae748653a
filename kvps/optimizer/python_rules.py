"""Optimizers written as MXNet's are, a Python ``update`` and ``create_state`` per key: the
checks a class passes at ``register``, its state kept as named arrays, and its updates run."""

import inspect

import numpy as np

from ..errors import ConfigError, DTypeError, ShapeError
from . import plugins
from .hyper import coerce
from .kernels import KERNEL_NAMES, common, kernels_for

_KINDS = ('float', 'int', 'bool', 'str', 'ints')
# Attributes every optimizer sets in __init__, which a hyper-parameter must not overwrite
_RESERVED = frozenset({'lr', 'num_update', 'lr_mult', 'wd_mult', 'lr_scheduler'})
STATE = 'state'   # the name of a create_state's array ('state.0', 'state.1.0': in tuples)


# -- the class, at register ------------------------------------------------------------------
def default_whole_tensor(cls, base):
    """A Python update sees each weight whole, in its shape, as in MXNet (the servers keep
    its keys whole, the Trainer does not fuse them), unless a class of its line declares
    ``whole_tensor`` itself: an elementwise one may say False and take split keys."""
    if cls.update is base.update:
        return
    for klass in cls.__mro__:
        if klass is base:
            cls.whole_tensor = True
            return
        if 'whole_tensor' in vars(klass):
            return


def check_class(cls, base, base_params):
    """Raise TypeError or ConfigError unless ``cls`` can be registered: a subclass of
    ``base`` whose update is a Python ``update`` of its own or one of kvps's kernels, with a
    valid ``hyper`` table and an ``__init__`` that takes nothing undeclared."""
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f'register takes a subclass of kvps.optimizer.Optimizer, got {cls!r}')
    owner = cls.__name__
    if cls.update is base.update:
        if cls.kernel is None:
            raise ConfigError(
                f'{owner} has no update: override update(index, weight, grad, state) (and '
                'create_state(index, weight)) as in MXNet, or name one of kvps\'s kernels '
                f'(kernel = ...: {", ".join(KERNEL_NAMES)})')
        if cls.kernel not in KERNEL_NAMES and not cls.__module__.startswith('kvps.'):
            raise ConfigError(f'{owner}.kernel = {cls.kernel!r} is not one of kvps\'s kernels '
                              f'({", ".join(KERNEL_NAMES)}); write update() instead')
    _check_hyper(cls, owner, base, base_params)
    _check_init(cls, owner, base, base_params)


def _check_hyper(cls, owner, base, base_params):
    if not isinstance(cls.hyper, dict) or not isinstance(cls.aliases, dict):
        raise ConfigError(f'{owner}.hyper and .aliases must be dicts')
    for name, entry in cls.hyper.items():
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                and entry[0].rstrip('?') in _KINDS):
            raise ConfigError(f'{owner}.hyper[{name!r}] must be (kind, default) with kind one '
                              f'of {", ".join(_KINDS)} (a trailing ? allows None), got {entry!r}')
        if name in base_params or name in _RESERVED or hasattr(base, name):
            raise ConfigError(f'{owner}.hyper declares {name!r}, a name every optimizer has '
                              'already')
        if entry[1] is not None:   # None: a required parameter (or None by default with ?)
            coerce(entry[0], name, entry[1], f'{owner}.hyper default')
    for alias, target in cls.aliases.items():
        if target not in cls.hyper:
            raise ConfigError(f'{owner}.aliases maps {alias!r} to {target!r}, which its hyper '
                              'table does not declare')


def _check_init(cls, owner, base, base_params):
    """A hyper-parameter travels to the servers in the spec only when ``hyper`` declares it:
    one that only ``__init__`` knows would be left behind, silently."""
    if cls.__init__ is base.__init__:
        return
    known = {*cls.hyper, *cls.aliases, *base_params, 'lr_scheduler'}
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    for p in params:
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in known:
            raise ConfigError(
                f'{owner}.__init__ takes {p.name!r}, which {owner}.hyper does not declare: '
                'hyper-parameters travel to the servers as data, so declare each one, e.g. '
                f'hyper = {{{p.name!r}: (\'float\', default)}}; kvps then sets self.{p.name}')
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise ConfigError(f'{owner}.__init__ must take **kwargs and pass them on to '
                          'super().__init__ (the spec gives every parameter by name)')


def unknown_message(name, known):
    """What ``create`` says of a name no optimizer is registered under."""
    here = plugins.loaded()
    where = '' if here is None else (
        f' (this server imported {", ".join(here) or "no modules"} from KVPS_SERVER_PLUGINS)')
    return (f'unknown optimizer {name!r}{where}; known: {", ".join(known)}. An optimizer of '
            'your own is registered with @kvps.optimizer.register in a module of yours; '
            'servers run it only from a module installed on every server host and named in '
            'KVPS_SERVER_PLUGINS (python -m kvps.launch --server-plugin MODULE)')


# -- its state --------------------------------------------------------------------------------
def new_state(opt, key, work):
    """``(layout, {name: flat array})`` of ``opt.create_state(key, work)``: its arrays by
    name (what kvps saves, loads and moves), and the layout that rebuilds what it returned."""
    arrays = {}
    layout = _flatten(opt.create_state(key, work), STATE, arrays, type(opt).__name__, work)
    return layout, arrays


def _flatten(value, name, arrays, owner, work):
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return (list if isinstance(value, list) else tuple,
                [_flatten(v, f'{name}.{i}', arrays, owner, work) for i, v in enumerate(value)])
    if not _same_kind(value, work):
        raise ConfigError(
            f'{owner}.create_state returned {type(value).__name__} as {name!r}: a state is None, '
            f'an array like the weight ({type(work).__module__}.{type(work).__name__}) of its '
            'size, or a tuple or list of those')
    if value.size != work.size or common.storage_name(value) not in common.WEIGHT_DTYPES:
        raise ConfigError(
            f'{owner}.create_state returned {name!r} of {value.size} {value.dtype} elements: '
            f'kvps keeps states of the weight\'s size ({work.size}) in float16, float32 or '
            'float64, which save, load and split as the weight does')
    arrays[name] = value.reshape(-1) if value.flags.c_contiguous else value.ravel()
    return (name, tuple(value.shape))


def _same_kind(value, work):
    try:
        return kernels_for(value) is kernels_for(work)
    except DTypeError:
        return False


def rebuild(layout, state):
    """What create_state returned, over the arrays of ``state`` (views: updates land there)."""
    if layout is None:
        return None
    head, rest = layout
    if isinstance(head, str):
        return state[head].reshape(rest)
    return head(rebuild(child, state) for child in rest)


def fit(opt, key, part, state, work):
    """The layout of ``state`` (loaded, or moved) once it matches what create_state makes
    for ``work``; else ConfigError, ShapeError or DTypeError naming the key."""
    layout, fresh = new_state(opt, key, work)
    have = {n for n in state if n != 'weight32'}
    where = f'key {key!r} part {part}'
    if have != set(fresh):
        raise ConfigError(f'{where}: the optimizer state holds {sorted(have) or "none"}, but '
                          f'{type(opt).__name__}.create_state makes {sorted(fresh) or "none"}: '
                          'it was saved under another optimizer')
    for name, want in fresh.items():
        got = state[name]
        if got.size != want.size:
            raise ShapeError(f'{where}: optimizer state {name!r} holds {got.size} elements, '
                             f'create_state makes {want.size}')
        if got.dtype != want.dtype:
            raise DTypeError(f'{where}: optimizer state {name!r} is {got.dtype}, create_state '
                             f'makes {want.dtype}')
    return layout


# -- its updates ---------------------------------------------------------------------------
def working(weight, state, kernels):
    """The array ``update`` changes: the fp32 master copy (multi_precision), a float32 copy of
    a bfloat16 weight (numpy and cupy have no bfloat16), else the weight itself."""
    master = state.get('weight32')
    if master is not None:
        return master
    if common.storage_name(weight) == common.BF16_STORAGE:
        return kernels.widen(weight)
    return weight


def run(opt, updates, failures=None):
    """Call ``opt.update`` per key of ``updates`` ((key, weight, grad, state, layout, count,
    shape)): on its working array (in ``shape`` when known), then the weight takes it. An
    update that raises fails its own key: recorded in ``failures`` (index -> exception) if
    given, else raised; the keys after it still update."""
    for index, update in enumerate(updates):
        try:
            _run_one(opt, *update)
        except Exception as exc:   # the user's code: any exception fails this key alone
            if failures is None:
                raise
            failures[index] = exc


def _run_one(opt, key, weight, grad, state, layout, count, shape):
    kernels = kernels_for(weight)
    work = working(weight, state, kernels)
    grad = _writable_grad(grad, work, kernels)
    if shape is not None:
        work_view, grad = work.reshape(shape), grad.reshape(shape)
    else:
        work_view = work
    opt._index_update_count[key] = count
    opt.update(key, work_view, grad, rebuild(layout, state))
    if work is not weight:
        kernels.narrow(work, weight)


def _writable_grad(grad, work, kernels):
    """The round's gradient as an array of ``work``'s dtype that ``update`` may change (as
    MXNet's may): a sync round's last two pushes summed, a bfloat16 gradient widened, a
    read-only receive buffer copied."""
    if type(grad) is tuple:   # float32/float64 keys: (sum so far, last push)
        grad = grad[0] + grad[1]
    if grad.dtype != work.dtype:
        return kernels.widen(grad) if common.storage_name(grad) == common.BF16_STORAGE \
            else grad.astype(work.dtype)
    if type(grad) is np.ndarray and not grad.flags.writeable:   # (cupy's always are)
        return grad.copy()
    return grad
