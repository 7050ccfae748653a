"""Prepared CUDA launches of the update kernels: a round's keys in one launch per kernel, kept.

A rule of cuda_kernels describes an update as a Request (the kernel it needs and its scalars);
a Plan adds the arrays, checked. A grad may be a tuple of two arrays (a sync round's last
pushes), which the kernel adds as it loads them: a kernel of its own (its plans' signature
and kernel name say so; its table has two pointer columns). The keys of a call list whose
plans share a kernel (rule, dtypes, grads, device) run as one launch of the multi layout
(cuda_source), however big each key is; a group of one key runs the single layout, which
takes everything by value and so needs no table on the device (one host-to-device copy fewer
per launch). LAMB always runs the multi layout: its two passes share the table and the
per-key partial sums.

A Round keeps a call list's launches for the next call list over the same keys, so that a
server shard, which updates the same keys with the same arrays round after round, plans them
once (see Round for what keeps one valid). Each round it only reads the gradients' pointers
and works out the scalars once per distinct hyper-parameter dict; the table goes to the device
again only when one of them changed.
"""

import operator
import threading
from typing import NamedTuple

import numpy as np

from ...errors import ShapeError
from . import common, cuda_source as src

OPTIONS = ('--fmad=false',)
ROUNDS_KEPT = 64    # call lists a caller's cache remembers (a shard sees one per message kind)
# Keyword arguments that carry arrays of the update: a call that passes one by keyword is
# planned every time (a Round checks the arrays it is given positionally).
_ARRAY_KEYWORDS = frozenset({'weight', 'grad', 'mom', 'mean', 'var', 'history', 'z', 'n',
                             'acc_g', 'acc_delta', 'u', 'd', 'v', 'cum', 'prev'})
_collecting = threading.local()   # .requests: a list while a call list is described


def cupy():
    import cupy as cp  # lazily, only when an array already is a cupy array
    return cp


def compiled(code, name):
    return cupy().RawKernel(code, name, options=OPTIONS)


_KERNELS = {}   # (plan signature, multi, pass, ilp) -> RawKernel


def kernel(plan, multi=False, index=0):
    """The compiled kernel of ``plan``, found by its signature: generating the source costs
    more than a launch, and the same few kernels run on every key."""
    key = (plan.signature(), multi, index, src.elements_per_thread())
    found = _KERNELS.get(key)
    if found is None:
        found = _KERNELS[key] = compiled(src.source(plan, multi, index),
                                         src.kernel_name(plan, multi, index))
    return found


class Request(NamedTuple):
    """An update as its rule asks for it, arrays not yet looked at: ``core`` is the rule's C
    between the loads and the stores; ``then``, the passes after it, as (finish, body) pairs:
    ``finish`` runs once per key on the sums of the pass before, then ``body`` (LAMB, LARS,
    LANS: see cuda_source)."""
    tag: str
    core: str
    then: object
    weight: object
    grad: object
    states: list
    weight32: object
    scalars: dict
    wide: tuple

    def variant(self):
        """All of the kernel's source that the arrays' dtypes do not decide."""
        return (self.tag, self.core, self.then, tuple(self.scalars), self.wide)

    def row(self):
        return tuple([float(value) for value in self.scalars.values()])


def request(*fields):
    """A rule's update (Request's fields): gathered while a call list is described, else
    planned and launched now."""
    req = Request(*fields)
    requests = getattr(_collecting, 'requests', None)
    if requests is not None:
        requests.append(req)
        return
    plan = plan_of(req)
    if plan.n:
        grad = _grad_of(plan)
        Launch([plan], [0]).run([grad], [plan_row(plan)], [0])


def describe(fn, args, kwargs):
    """The Request that rule ``fn`` makes for one call."""
    _collecting.requests = []
    try:
        fn(*args, **kwargs)
        (req,) = _collecting.requests
        return req
    finally:
        _collecting.requests = None


def _contiguous(array, written):
    """The kernels index flat memory: inputs are made contiguous, outputs must be."""
    if array.flags.c_contiguous:
        return array
    if written:
        raise ShapeError('optimizer state and weights must be C-contiguous arrays')
    return cupy().ascontiguousarray(array)


def plan_of(req):
    """The Plan of a Request: the master weight (``p_w``), the low-precision weight it rounds
    into, the grad (one array, or a tuple of two: ``p_g``, ``p_g2``) and the live states,
    checked; one pass, or more when ``req.then`` is set (the last updates the weight)."""
    mp = req.weight32 is not None
    master = req.weight32 if mp else req.weight
    grads = common.grad_parts(req.grad, master, most=len(src.GRADS))
    common.check_arrays(req.weight, grads[0], req.states, req.weight32)
    arrays = [('w', master)] + ([('weight', req.weight)] if mp else [])
    states = [(name, arr) for name, arr in req.states if arr is not None]
    arrays += [*zip(src.GRADS, grads), *states]
    arrays = [(name, _contiguous(arr, name not in src.GRADS)) for name, arr in arrays]
    compute = common.compute_dtype_name(master)
    wide = req.wide
    scalars = [(name, value, name in wide) for name, value in req.scalars.items()]
    passes = src.passes(req.core, req.then, mp, len(grads), tuple([name for name, _ in states]))
    return src.Plan(req.tag, compute, int(master.size), arrays, passes, scalars,
                    req.variant())


def plan_row(plan):
    return tuple([float(value) for _, value, _ in plan.scalars])


def _grad_of(plan):
    """The plan's grad as its call gave it: an array, or the tuple of its two."""
    grads = tuple([arr for name, arr in plan.arrays if name in src.GRADS])
    return grads if len(grads) > 1 else grads[0]


class Launch:
    """The launch (LAMB: the two) over a group of keys whose plans share a kernel: built from
    one round's plans, then given each round only what may change, the keys' gradients and
    scalar rows. ``keys``: the group's places in the call list."""

    def __init__(self, plans, keys):
        first = plans[0]
        self.keys, self.variant = keys, first.variant
        self.device = first.arrays[0][1].device
        names = [name for name, _ in first.arrays]
        slot, self._grads_per_key = names.index('g'), sum(n in src.GRADS for n in names)
        self._grad_dtype = first.arrays[slot][1].dtype
        self._shapes = [tuple(p.arrays[slot][1].shape) for p in plans]
        self.multi = len(plans) > 1 or len(first.passes) > 1
        self._kernels = [kernel(first, self.multi, i) for i in range(len(first.passes))]
        self._last = None   # (pointers, rows as bytes, which) the device table holds
        if self.multi:
            self._table(plans, slot)
        else:   # arguments by value; the grad's places are filled each round
            self._args = [np.int64(first.n), *(None if name in src.GRADS else a
                                               for name, a in first.arrays)]
            self._grad_at = 1 + slot
            wide = np.float64 if first.compute == 'float64' else np.float32
            self._types = [np.float64 if w else wide for _, _, w in first.scalars]
            self.blocks = src.blocks_for(first.n)

    def _table(self, plans, slot):
        """The table of the multi layout, on the host (rewritten in place) and the device."""
        first, nkeys = plans[0], len(plans)
        rows_at, width, scalars_at, count, total = src.table_words(
            nkeys, len(first.arrays), len(first.scalars))
        host = np.zeros(total, np.int64)
        starts = np.cumsum([0] + [src.blocks_for(p.n) for p in plans])
        host[:nkeys + 1] = starts
        rows = host[rows_at:scalars_at].reshape(nkeys, width)
        rows[:, 0] = [p.n for p in plans]
        rows[:, 1:] = [[a.data.ptr for _, a in p.arrays] for p in plans]
        pairs = self._grads_per_key > 1   # (a column of pointers per grad of a key)
        self._host = host
        self._grads = rows[:, 1 + slot:1 + slot + self._grads_per_key] if pairs else \
            rows[:, 1 + slot]
        self._scalars = host[scalars_at:].view(np.float64).reshape(nkeys, count)
        self.blocks, self._nkeys = int(starts[-1]), np.int32(nkeys)
        self._scratch = ()
        if len(first.passes) > 1:   # per-block partial norms, per-key counts and kept values
            cp = cupy()
            with self.device:
                self._scratch = (cp.empty(2 * self.blocks, cp.float64),
                                 cp.zeros(nkeys, cp.uint32),
                                 cp.empty(nkeys * src.KV_SLOTS, cp.float64))

    def pointers(self, grads):
        """The gradients' device pointers (a tuple per key where a key's grad is two
        arrays); None if one does not fit the kernel as built (another dtype or shape, not
        contiguous, one array where the kernel takes two or two where it takes one: the
        round is then planned anew)."""
        dtype, count, out = self._grad_dtype, self._grads_per_key, []
        for grad, shape in zip(grads, self._shapes):
            parts = grad if type(grad) is tuple else (grad,)
            if len(parts) != count or (count == 1 and parts is grad):
                return None
            for part in parts:
                if (part.dtype is not dtype and part.dtype != dtype) or part.shape != shape \
                        or not part.flags.c_contiguous:
                    return None
            out.append(tuple([part.data.ptr for part in parts]) if count > 1
                       else grad.data.ptr)
        return out

    def run(self, grads, rows, which, pointers=None):
        """Launch over the keys with ``grads`` (checked by pointers()) and scalar ``rows``
        (key i takes rows[which[i]]); the table is uploaded only if either changed."""
        if not self.multi:
            args, grad, at = list(self._args), grads[0], self._grad_at
            args[at:at + self._grads_per_key] = grad if type(grad) is tuple else (grad,)
            args += [kind(value) for kind, value in zip(self._types, rows[which[0]])]
            with self.device:
                self._kernels[0]((self.blocks,), (src.THREADS,), tuple(args))
            return
        self._refresh(self.pointers(grads) if pointers is None else pointers, rows, which)
        with self.device:
            for each in self._kernels:
                each((self.blocks,), (src.THREADS,), self._args)

    def _refresh(self, pointers, rows, which):
        values = np.array(rows, np.float64)
        now = (pointers, values.tobytes(), which)   # bytes: -0.0 and 0.0 differ, as needed
        if now == self._last:
            return
        self._grads[:] = pointers
        self._scalars[:] = values[0] if len(rows) == 1 else values[which]
        with self.device:   # a fresh array: a launch still queued keeps reading the old one
            self._args = (cupy().asarray(self._host), self._nkeys, *self._scratch)
        self._last = now


class Round:
    """The launches of one call list, kept to run the next call list over the same keys.

    Valid while the calls name the same rules with the very same weight, state and master
    (weight32) arrays in the same places, on the same CUDA stream. The Round holds those
    arrays, so none is freed and its memory given to another while the Round is kept: the
    table's pointers stay right. Anything else plans the calls anew:
    - a weight reallocated (copy-on-write of a leased weight), a state created (a key's first
      update, or set_states), a key added or dropped: another object in some place;
    - a dtype change: another object too (an array's dtype does not change);
    - a rule now asking another kernel (nesterov on, say): its request's variant differs
      from the launch's, found when the round's scalars are worked out;
    - a gradient of another dtype, shape or layout, or of two arrays where it was one (a
      sync round's last pushes, added in the kernel: another kernel) or one where it was
      two: found when its pointers are read;
    - another stream: LAMB's partial sums and counters, kept between launches, may be reused
      only behind the launch before, on its stream.
    What changes freely: the gradients (their pointers are read every round) and the
    hyper-parameters (lr schedule, Adam's bias correction: the scalars are worked out every
    round, once per distinct kwargs dict)."""

    def __init__(self, calls, rules):
        self.names = [call[0] for call in calls]
        self.fixed = _fixed(calls)
        self.stream = _stream()   # held: its handle cannot go to another stream meanwhile
        self.reusable = not any(_ARRAY_KEYWORDS.intersection(kw) for _, _, kw in calls)
        plans = [plan_of(describe(rules[name], args, kw)) for name, args, kw in calls]
        self.launches = [Launch([plans[i] for i in keys], keys) for keys in _groups(plans)]
        self._plans = plans    # until run_first: their grads may be contiguous copies

    def matches(self, calls):
        fixed = _fixed(calls)
        return ([call[0] for call in calls] == self.names and len(fixed) == len(self.fixed)
                and all(map(operator.is_, fixed, self.fixed)) and _stream().ptr == self.stream.ptr)

    def run_first(self, calls):
        """Launch for the calls the Round was planned from."""
        plans, self._plans = self._plans, None
        assert self._run([call[2] for call in calls], [_grad_of(plan) for plan in plans],
                         lambda launch, i: plan_row(plans[i]))

    def run_again(self, calls, rules):
        """Launch for ``calls`` (which match()); False, with nothing launched, if a call no
        longer fits the launches as built."""
        def row_of(launch, i):
            name, args, kw = calls[i]
            if _ARRAY_KEYWORDS.intersection(kw):
                return None
            req = describe(rules[name], args, kw)
            return req.row() if req.variant() == launch.variant else None
        return self._run([call[2] for call in calls], [call[1][1] for call in calls], row_of)

    def _run(self, kwargs, grads, row_of):
        """Check every launch's gradients and scalars, then launch them all."""
        ready = []
        for launch in self.launches:
            mine = [grads[i] for i in launch.keys]
            pointers, rows = launch.pointers(mine), _rows(launch, kwargs, row_of)
            if pointers is None or rows is None:
                return False
            ready.append((launch, mine, *rows, pointers))
        for launch, mine, rows, which, pointers in ready:
            launch.run(mine, rows, which, pointers)
        return True


def _fixed(calls):
    """The arrays of a call list that a Round holds: weight, states and master of each."""
    return [a for _, args, kw in calls for a in (args[0], *args[2:], kw.get('weight32'))]


def _stream():
    return cupy().cuda.get_current_stream()


def _groups(plans):
    """The keys of each launch, in launch order: within a stretch of the list where no weight
    comes twice, one launch per kernel and device, in the order first met; a weight met again
    starts a new stretch, so a key's updates keep their order. Empty keys launch nothing."""
    out, pending, seen = [], {}, set()
    for i, plan in enumerate(plans):
        if plan.n == 0:
            continue
        master = plan.arrays[0][1]
        if master.data.ptr in seen:
            out += pending.values()
            pending, seen = {}, set()
        seen.add(master.data.ptr)
        pending.setdefault((plan.signature(), master.device.id), []).append(i)
    return out + list(pending.values())


def _rows(launch, kwargs, row_of):
    """(distinct scalar rows, the row of each key) of a launch, or None if a key no longer
    fits it. A row is worked out once per kwargs dict (the updater shares one among keys of
    one count, lr and wd) and once per set of hyper-parameter objects (keys with a master
    weight each have a dict, made from one shared dict's values)."""
    rows, which, by_dict, by_values = [], [], {}, {}
    for i in launch.keys:
        kw = kwargs[i]
        at = by_dict.get(id(kw))
        if at is None:
            values = _values_key(kw)
            at = by_values.get(values)
            if at is None:
                row = row_of(launch, i)
                if row is None:
                    return None
                at = by_values[values] = len(rows)
                rows.append(row)
            by_dict[id(kw)] = at
        which.append(at)
    return rows, which


def _values_key(kw):
    """The names and the very objects of a call's hyper-parameters (alive while the call list
    is: equal ids, equal values), the master weight left out."""
    return (tuple(kw), *[id(value) for name, value in kw.items() if name != 'weight32'])


def multi_update(calls, rules, rounds=None):
    """Run ``calls`` [(rule name, args, kwargs)] (the arrays in args: weight, grad, *states;
    weight32 in kwargs), the rules found in ``rules``: every call planned and checked before
    any launch. ``rounds``: a dict the caller keeps between calls, in which the Round of a
    call list is kept for the next list over the same keys (at most ROUNDS_KEPT lists,
    the least recently run dropped first); None plans every time."""
    if not calls:
        return
    hint = (len(calls), id(calls[0][1][0]))   # unique while the Round holds that weight
    kept = rounds.pop(hint, None) if rounds is not None else None
    if kept is None or not kept.matches(calls) or not kept.run_again(calls, rules):
        kept = Round(calls, rules)
        kept.run_first(calls)
    if rounds is not None and kept.reusable:
        rounds[hint] = kept   # the most recently run last
        if len(rounds) > ROUNDS_KEPT:
            del rounds[next(iter(rounds))]
