"""Runs one optimizer's fused kernels over many keys, with per-key state and update counts."""

import numpy as np

from ..errors import ConfigError, DTypeError, ShapeError
from . import python_rules
from .kernels import common, kernels_for, multi_apply, numpy_kernels
from .kernels.numpy_packing import PACK_UP_TO, Slabs
from .optimizers import Optimizer
from .state_fit import (STATE_DTYPES, STATE_FORMAT, STATE_ITEMSIZE, check_state_names, misfit,
                        pack, state_dtype, state_rows, unpacked_state, wants_master)

__all__ = ['Updater', 'STATE_FORMAT', 'STATE_ITEMSIZE']

_HOST_DTYPES = frozenset(map(np.dtype, STATE_DTYPES.values()))   # the kernels' dtypes


class Updater:
    """Runs one optimizer over many keys on a server shard (or in the local store).

    State per (key, part) is created on the first update, on the weight's device: the
    optimizer's state arrays (zeros, or a copy of the weight for those it names in
    ``state_from_weight``), plus 'weight32', the fp32 master copy, for float16/bfloat16
    weights under multi_precision. Without multi_precision low-precision states keep the
    weight's dtype (arithmetic still runs in fp32 and rounds once per step, as on a GPU),
    except for optimizers with fp32_states (LAMB, as in MXNet). The states an optimizer
    names in ``row_states`` hold one element per row of the key's 2-D shape (GroupAdaGrad's
    history; ``shape_of`` gives the shape). An optimizer with a
    ``key_args(key, count)`` method adds what it returns to each key's kernel call.
    Update counts are kept per (key, part) and drive the lr scheduler as in MXNet: a key's
    count is incremented before its lr is computed, and num_update = the max over keys
    (in sync rounds at least the workers' push ``step``: the keys of other servers count).
    An optimizer written in Python (``update``/``create_state``, kvps.optimizer.python_rules)
    runs key by key on the same state, counts and checkpoints; ``shape_of(key, part)`` gives
    the shape it sees a whole key in (None: the flat part).
    """

    def __init__(self, optimizer, shape_of=None):
        if isinstance(optimizer, dict):
            optimizer = Optimizer.from_spec(optimizer)
        if not isinstance(optimizer, Optimizer):
            raise ConfigError(f'Updater needs an Optimizer or its spec dict, got '
                              f'{type(optimizer).__name__}')
        self._opt = optimizer
        self._shape_of = shape_of or _flat
        self._states = {}   # (key, part) -> {state name: array}
        self._counts = {}   # (key, part) -> updates applied
        # (key, part) -> (id of its state, weight dtype, shape, kernels) last checked to fit
        self._fits = {}
        self._num_update = optimizer.begin_num_update
        self._step_offset = 0   # added to the workers' push step: see start_at
        # Host states of small keys, cut end to end: they are updated in place, packed.
        self._slabs = Slabs()
        # The device kernels' prepared launches of recent rounds (cuda_launch.Round): they
        # hold the weights and states they were made for, and go with this updater.
        self._launches = {}
        # Python updates: (key, part) -> (id of its state, what rebuilds create_state's value)
        self._layouts = {}

    @property
    def optimizer(self):
        return self._opt

    def retune(self, optimizer):
        """Take ``optimizer``'s hyper-parameters and keep every key's state and count, if it
        is the same kind of optimizer with the same state; return whether it was. (What a
        Python update's create_state makes may follow its own hyper-parameters: it keeps its
        state only while they are the same, through new learning rates and rescales.)"""
        if isinstance(optimizer, dict):
            optimizer = Optimizer.from_spec(optimizer)
        same = (optimizer.name == self._opt.name and
                optimizer.state_names() == self._opt.state_names() and
                optimizer.multi_precision == self._opt.multi_precision and
                (not optimizer.runs_python or all(
                    getattr(optimizer, n) == getattr(self._opt, n) for n in optimizer.hyper)))
        if same:
            self._opt = optimizer
            self._opt.num_update = self._num_update
        return same

    @property
    def num_update(self):
        return self._num_update

    def update(self, key, weight, grad, part=0):
        """weight <- optimizer step with the summed grad, in place. grad may be clobbered."""
        self.update_many([(key, part, weight, grad)])

    def update_many(self, items, step=0, failures=None):
        """Multi-tensor apply over [(key, part, weight, grad), ...]. Everything is checked
        before any count moves or any weight changes; then all counts tick (MXNet's
        aggregated update), then the kernels run. ``step``: the workers' count of pushes of
        their most pushed key (a sync round), which num_update is brought up to: a server
        holding some of the keys then schedules the lr as one holding all of them would.
        ``failures``: where a Python update's exception is kept per item index, the other
        keys updating on (else it is raised)."""
        checked = [self._check(key, part, weight, grad) for key, part, weight, grad in items]
        counts = [self._tick(key, part) for key, part, _, _ in items]
        self._up_to(step)
        self._opt.num_update = self._num_update
        if self._opt.runs_python:
            python_rules.run(self._opt, [
                (key, weight, grad, state, self._layouts[key, part][1], count,
                 self._shape_of(key, part))
                for (key, part, weight, _), (grad, state), count in zip(items, checked, counts)],
                failures)
            return
        multi_apply(self._calls([(key, weight, grad, state, count) for (key, _, weight, _),
                                 (grad, state), count in zip(items, checked, counts)]),
                    self._launches)

    @property
    def updates_rows(self):
        """Whether pushed rows are updated alone (MXNet's lazy_update, on by default for sgd
        and adam); else the server applies them as the dense gradient they stand for
        (always for a Python update: MXNet hands it rows in a type of its own)."""
        opt = self._opt   # (a rule by rows, GroupAdaGrad's, updates rows alone though whole)
        return (getattr(opt, 'lazy_update', False) and not opt.runs_python
                and (not opt.whole_tensor or bool(opt.row_states)))

    def update_rows(self, key, part, weight, ids, grad, width):
        """MXNet's lazy update: only rows ``ids`` (sorted, unique) of ``weight`` (flat, rows
        of ``width``) and of its optimizer state change, by ``grad`` (len(ids) x width); wd,
        momentum and moments of the other rows wait until a gradient reaches them. The
        key's update count ticks as for any update."""
        _check_dtype(key, 'weight', weight)
        _check_dtype(key, 'grad', grad)
        kernels = kernels_for(weight)
        state = self._state_for(key, part, weight, kernels)
        count = self._tick(key, part)
        self._opt.num_update = self._num_update
        ids = kernels.from_host(ids, weight)   # a GPU weight takes its index on its device
        num_rows = weight.size // width   # (a per-row state has rows of one element)
        picked = {name: array.reshape(num_rows, -1)[ids] for name, array in state.items()}
        rows = weight.reshape(-1, width)[ids]
        multi_apply(self._calls([(key, rows.reshape(-1), grad.reshape(-1),
                                  {n: a.reshape(-1) for n, a in picked.items()}, count)]))
        weight.reshape(-1, width)[ids] = rows
        for name, array in state.items():
            array.reshape(num_rows, -1)[ids] = picked[name]

    # -- per update --------------------------------------------------------------------------
    def _check(self, key, part, weight, grad):
        """``(grad, state)`` for one update, both checked. ``grad``: an array, or a tuple of
        arrays to be summed (a sync round's last pushes: the kernels add them in the pass of
        the update, numpy's block by block, CUDA's as they load them), each checked alike."""
        if _plain_host_update(weight, grad):   # most updates: nothing to say, nothing to fix
            return grad, self._state_for(key, part, weight, numpy_kernels)
        kernels = kernels_for(weight)
        if _plain_device_update(weight, grad, kernels):   # a GPU shard's updates: the same
            return grad, self._state_for(key, part, weight, kernels)
        _check_dtype(key, 'weight', weight)
        if type(weight) is np.ndarray and (not weight.flags.c_contiguous
                                           or not weight.flags.writeable):
            raise ShapeError(f'key {key!r}: the stored weight must be a writable '
                             'C-contiguous array')
        if type(grad) is tuple:
            grad = tuple(self._checked_grad(key, part, weight, kernels, g) for g in grad)
        else:
            grad = self._checked_grad(key, part, weight, kernels, grad)
        return grad, self._state_for(key, part, weight, kernels)

    @staticmethod
    def _checked_grad(key, part, weight, kernels, grad):
        """``grad`` (made contiguous if need be) once it fits ``weight``; else the error."""
        if type(grad) is not type(weight) and kernels_for(grad) is not kernels:
            raise DTypeError(f'key {key!r}: weight and grad live on different devices '
                             f'({type(weight).__module__} vs {type(grad).__module__})')
        _check_dtype(key, 'grad', grad)
        if grad.shape != weight.shape and tuple(grad.shape) != tuple(weight.shape):
            raise ShapeError(f'key {key!r} part {part}: grad shape {tuple(grad.shape)} does not '
                             f'match the stored weight shape {tuple(weight.shape)}')
        if type(grad) is np.ndarray and not grad.flags.c_contiguous:
            grad = np.ascontiguousarray(grad)
        return grad

    def _state_for(self, key, part, weight, kernels):
        """The key's state, made on its first update; checked against the weight the first
        time they meet (a state restored by set_states may not fit; a weight may have moved
        to another device), not at every update."""
        state = self._states.get((key, part))
        if state is None:
            state = self._states[(key, part)] = self._new_state(key, part, weight, kernels)
        fit = (id(state), weight.dtype, weight.shape, kernels)
        if self._fits.get((key, part)) != fit:
            self._fit(key, part, state, weight, kernels)
            self._fits[(key, part)] = fit
        return state

    def _fit(self, key, part, state, weight, kernels):
        """Check ``state`` against ``weight``, moving it to the weight's device if need be."""
        problem = misfit(self._opt, key, part, state, weight,
                         state_rows(self._opt, key, part, self._shape_of, weight))
        if problem is not None:
            error, message = problem
            raise error(message)
        for name, arr in list(state.items()):
            if kernels_for(arr) is not kernels:  # restored by set_states, or device moved
                state[name] = kernels.from_host(kernels_for(arr).to_host(arr), weight)
        if self._opt.runs_python and self._layouts.get((key, part), (None,))[0] != id(state):
            self._layouts[key, part] = id(state), python_rules.fit(
                self._opt, key, part, state, self._work(key, part, weight, state, kernels))

    def _new_state(self, key, part, weight, kernels):
        state = {}
        if wants_master(self._opt, weight):
            state['weight32'] = kernels.widen(weight)
        if self._opt.runs_python:   # whatever its create_state makes, as named arrays
            layout, arrays = python_rules.new_state(
                self._opt, key, self._work(key, part, weight, state, kernels))
            state.update(arrays)
            self._layouts[key, part] = id(state), layout
            return state
        from_weight = getattr(self._opt, 'state_from_weight', ())   # DCASGD's previous weight
        dtype = state_dtype(self._opt, weight)
        rows = state_rows(self._opt, key, part, self._shape_of, weight)
        for name in self._opt.state_names():
            if name in self._opt.row_states:   # one element per row (GroupAdaGrad's)
                state[name] = kernels.zeros_like(weight.reshape(-1)[:rows], dtype)
            elif name in from_weight:
                state[name] = _copy(state.get('weight32', weight), dtype, kernels)
            else:
                state[name] = kernels.zeros_like(weight, dtype)
        return self._in_slabs(state)

    def _work(self, key, part, weight, state, kernels):
        """The array a Python update changes for this key part, in the shape it sees."""
        work = python_rules.working(weight, state, kernels)
        shape = self._shape_of(key, part)
        return work if shape is None else work.reshape(shape)

    def _in_slabs(self, state):
        """``state`` with its small host arrays moved into the slabs, which lay the states
        of keys side by side in the order they are made (for packed passes in place)."""
        return {name: self._slabs.copy(name, array)
                if type(array) is np.ndarray and array.size <= PACK_UP_TO else array
                for name, array in state.items()}

    def _tick(self, key, part):
        count = self._counts.get((key, part), self._opt.begin_num_update) + 1
        self._counts[(key, part)] = count
        self._num_update = max(self._num_update, count)
        return count

    def _calls(self, updates):
        """The kernel calls ``(name, args, kwargs)`` of ``updates``, each ``(key, weight,
        grad, state, count)``. Every call of one optimizer builds its kwargs in one order
        (multi_update packs calls whose scalars are equal)."""
        opt, calls = self._opt, []
        lr_of, wd_of, alike = self._lr_wd_of(opt)
        key_args = getattr(opt, 'key_args', None)   # per key (SGLD's noise, LARS's names)
        kernel, names, rescale, clip = (opt.kernel, opt.kernel_states, opt.rescale_grad,
                                        opt.clip_gradient)
        by_count = {}   # count -> the kernel's hyper-parameters: most keys share a count
        # Keys that share a count, lr and wd share one kwargs dict (kernels only read it),
        # which multi_update also reads once for all of them; a key with a master copy gets
        # its own dict of the same value objects, which the CUDA launches read once too.
        shared = {}
        for key, weight, grad, state, count in updates:
            lr, wd, weight32 = lr_of(key), wd_of(key), state.get('weight32')
            same = count if alike else (count, *common.signed_key((lr, wd)))
            kwargs = shared.get(same)
            if kwargs is None:
                more = by_count.get(count)
                if more is None:
                    more = by_count[count] = opt.kernel_args(count)
                kwargs = shared[same] = dict(lr=lr, wd=wd, rescale_grad=rescale,
                                             clip_gradient=clip, weight32=None, **more)
            if weight32 is not None or key_args is not None:
                kwargs = dict(kwargs, weight32=weight32,
                              **(key_args(key, count) if key_args is not None else {}))
            calls.append((kernel, (weight, grad, *map(state.get, names)), kwargs))
        return calls

    def _lr_wd_of(self, opt):
        """Functions giving each key's lr and wd as ``opt.get_lr``/``get_wd`` do, with the
        scheduler asked once for all keys of an update (a registered optimizer that overrides
        either is asked per key), and whether every key gets the same two (no multipliers:
        the very same objects, so keys need no comparing)."""
        num_update = self._num_update
        if type(opt).get_lr is not Optimizer.get_lr or type(opt).get_wd is not Optimizer.get_wd:
            return (lambda key: opt.get_lr(key, num_update)), opt.get_wd, False
        lr, lr_mult, wd, wd_mult = opt.base_lr(num_update), opt.lr_mult, opt.wd, opt.wd_mult
        if not lr_mult and not wd_mult:   # (x * 1.0 is x, to the bit)
            return (lambda key: lr), (lambda key: wd), True
        return ((lambda key: lr * lr_mult.get(key, 1.0)), (lambda key: wd * wd_mult.get(key, 1.0)),
                False)

    def _up_to(self, step):
        """num_update brought up to the workers' push ``step`` (counted as start_at says)."""
        self._num_update = max(self._num_update,
                               self._opt.begin_num_update + self._step_offset + step)

    def start_at(self, step):
        """The workers' push step as this updater takes over (a new optimizer, a load of
        states): they count sync steps from the job's start, and later steps count from here,
        so the lr schedule goes on from this updater's own num_update."""
        self._step_offset = self._num_update - self._opt.begin_num_update - step

    # -- checkpoints ---------------------------------------------------------------------
    def get_states(self, dump_optimizer=False, step=None):
        """All optimizer state as msgpack-able plain data (arrays copied to the host). For a
        checkpoint (``step`` None) with where the workers' push steps count from; for the
        workers (save_optimizer_states, at their push ``step``) without it (a load counts from
        its own step: start_at), num_update brought up to ``step`` first, as an update would
        (a server none of whose keys were pushed since saves the job's count too).

        {'format': 'kvps.updater.states/1', 'num_update': int, 'step_offset': int,
         'counts': [[key, part, count], ...],
         'states': [[key, part, {name: {'dtype', 'shape', 'data'}}], ...],
         'optimizer': spec}  (the last only with dump_optimizer=True)
        Keys sit in lists, not map keys, so int keys survive msgpack's default strict_map_key.
        """
        if step is not None:
            self._up_to(step)
        out = {'format': STATE_FORMAT, 'num_update': self._num_update,
               'counts': [[k, p, c] for (k, p), c in self._counts.items()],
               'states': [[k, p, {n: pack(a) for n, a in st.items()}]
                          for (k, p), st in self._states.items()]}
        if step is None:
            out['step_offset'] = self._step_offset
        if dump_optimizer:
            out['optimizer'] = self._opt.to_spec()
        return out

    def set_states(self, states, weights=None):
        """Restore what get_states returned (the optimizer too, when it was dumped), checked
        against ``weights`` as checked_states does."""
        self.install(self.checked_states(states, weights))

    def checked_states(self, states, weights=None):
        """What ``install`` takes for ``states`` (as get_states returns), every part checked
        and nothing changed yet: ConfigError (naming the key) if any of it does not fit.
        ``weights``: {(key, part): weight} where known; a state that does not fit its weight
        (dtype, shape, fp32 master copy) is refused here, not at the key's next update."""
        if not isinstance(states, dict) or states.get('format') != STATE_FORMAT:
            raise ConfigError(f'set_states: not a kvps updater state dict (format '
                              f'{STATE_FORMAT!r} expected)')
        opt = Optimizer.from_spec(states['optimizer']) if 'optimizer' in states else self._opt
        try:
            counts = {(k, int(p)): int(c) for k, p, c in states['counts']}
            restored = dict(unpacked_state(*item) for item in states['states'])
            num_update = int(states['num_update'])
            offset = int(states.get('step_offset', 0))   # (a file of an older kvps has none)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f'set_states: malformed state dict ({exc})') from None
        if not opt.runs_python:   # (a Python update's names: its create_state's, below)
            check_state_names(opt, restored)
        for where, state in restored.items():
            weight = (weights or {}).get(where)
            problem = None if weight is None else misfit(
                opt, *where, state, weight, state_rows(opt, *where, self._shape_of, weight))
            if problem is not None:
                raise ConfigError(problem[1])
            if weight is not None and opt.runs_python:
                self._fits_python(opt, where, state, weight)
        return opt, counts, restored, num_update, offset

    def _fits_python(self, opt, where, state, weight):
        """ConfigError unless a loaded ``state`` is what ``opt``'s create_state makes."""
        work = python_rules.working(weight, state, kernels_for(weight))
        shape = self._shape_of(*where)
        try:
            python_rules.fit(opt, *where, state, work if shape is None else work.reshape(shape))
        except (ShapeError, DTypeError) as exc:
            raise ConfigError(str(exc)) from None

    def install(self, checked):
        """Take ``checked`` (from checked_states) in place of every key's state and count."""
        opt, self._counts, states, num_update, self._step_offset = checked
        self._states = {where: self._in_slabs(state) for where, state in states.items()}
        self._opt = opt
        self._fits = {}
        self._layouts = {}
        self._launches.clear()   # they hold the replaced states
        self._num_update = opt.num_update = num_update


def _flat(key, part):
    return None


def _copy(array, dtype, kernels):
    """A copy of ``array`` in ``dtype``: its own, or float32 from a low-precision one."""
    return array.copy() if array.dtype == dtype else kernels.widen(array)


def _plain_host_update(weight, grad):
    """Whether a weight and its grad (or tuple of grads) pass every check of
    ``Updater._check`` as they are: host arrays of a kernel dtype and of one shape, C-contiguous,
    the weight writable. Asked for every key of every round, so in as few steps as Python
    allows; anything else takes the checks that say what is wrong."""
    if type(weight) is not np.ndarray or weight.dtype not in _HOST_DTYPES:
        return False
    flags, shape = weight.flags, weight.shape
    if not (flags.c_contiguous and flags.writeable):
        return False
    for g in grad if type(grad) is tuple else (grad,):
        if type(g) is not np.ndarray or g.dtype not in _HOST_DTYPES or g.shape != shape \
                or not g.flags.c_contiguous:
            return False
    return True


def _plain_device_update(weight, grad, kernels):
    """Whether a device weight and its grad (or tuple of grads) pass every check of
    ``Updater._check`` as they are: one array type and shape, kernel dtypes (the kernels
    check the rest as they plan)."""
    if kernels is numpy_kernels or weight.dtype not in _HOST_DTYPES:
        return False
    for g in grad if type(grad) is tuple else (grad,):
        if type(g) is not type(weight) or g.dtype not in _HOST_DTYPES or g.shape != weight.shape:
            return False
    return True


def _check_dtype(key, label, array):
    if common.storage_name(array) not in common.WEIGHT_DTYPES:
        raise DTypeError(f'key {key!r}: {label} dtype {array.dtype} is not supported; '
                         'use float16, float32, float64 or bfloat16 (uint16 storage)')
