"""How the Trainer's gradients travel: small parameters fused back to back into shared store
keys (as DDP's buckets and Horovod's fusion buffer pack tensors), and pushes bucketed while
backward runs."""

import hashlib
import itertools
import logging
import operator
import threading

from .. import rows

log = logging.getLogger('kvps')

# A key costs about 0.1 ms of CPU per round over the job (protocol, bookkeeping, replies),
# which buys copying about 1 MB in and out: parameters under half that gain from sharing one.
FUSE_BELOW_BYTES = 512 << 10

# Read over a fused key's members by map() in C: a step touches each member several times, and
# a Python loop over hundreds of small parameters costs a millisecond a step
REQUIRES_GRAD = operator.attrgetter('requires_grad')
_IS_SPARSE = operator.attrgetter('is_sparse')


class FusedKey:
    """Store key ``key`` holding ``members`` (Params of one dtype) back to back, in key order.

    ``weight`` is where pulled weights land before they go to the members; ``grad`` is where
    a push's gradients are gathered, and where summed gradients land when workers update.
    """

    def __init__(self, key, members, plain=True):
        self.key, self.members = key, members
        self.tensors = [p.tensor for p in members]     # the parameters themselves, in order
        self.member_keys = [p.key for p in members]
        # Workers updating: one pass over the packed key, its state kept under its key (its
        # members' multipliers are 1, which the optimizer gives a key it has no entry for);
        # False once the state is split into the members'
        self.updated_whole = plain
        self.sizes = [p.tensor.numel() for p in members]
        first = members[0].tensor.detach()
        self.weight = first.new_empty(sum(self.sizes))
        self.grad = first.new_empty(sum(self.sizes))
        self.weight_views = self._views(self.weight)
        self.grad_views = self._views(self.grad)
        self.arrived = {}      # member key -> its gradient (None: none), this step

    def use_grad(self, flat):
        """Gather gradients in ``flat`` (like ``grad``) from now on: GPU memory the servers
        map (KVStore.gradient_buffer), pushed from where it lies. It is written each step
        after the step's pull of the key returned, by which the servers have read it."""
        self.grad = flat
        self.grad_views = self._views(flat)

    def _views(self, flat):
        return [view.view(p.tensor.shape) for view, p in zip(flat.split(self.sizes), self.members)]

    def ranges(self):
        """[(member key, start, stop)]: where each member lies in the flat key."""
        out, start = [], 0
        for p, size in zip(self.members, self.sizes):
            out.append((p.key, start, start + size))
            start += size
        return out

    @property
    def first_key(self):
        return self.members[0].key

    def trainable_count(self):
        return sum(map(REQUIRES_GRAD, self.tensors))

    def gather_weights(self):
        """The members' current values, packed (for init)."""
        import torch
        torch.cat([p.tensor.detach().reshape(-1) for p in self.members], out=self.weight)
        return self.weight

    def scatter_weights(self):
        """Pulled weights into the members."""
        import torch
        with torch.no_grad():   # (written as the parameters' .detach() would be)
            torch._foreach_copy_(self.tensors, self.weight_views)

    def arrive(self, p, grad):
        """Note member ``p``'s gradient; True once every member's is here."""
        self.arrived[p.key] = grad
        return len(self.arrived) == len(self.members)

    def gather_grads(self, dense):
        """The arrived gradients packed into ``grad`` (zeros for the members without one:
        frozen, or trainable and unused this step); clears them for the next step."""
        import torch
        grads = list(map(self.arrived.get, self.member_keys))
        self.arrived = {}
        if not any(map(operator.is_, grads, itertools.repeat(None))) and \
                not any(map(_IS_SPARSE, grads)):
            torch._foreach_copy_(self.grad_views, grads)
            return self.grad
        self.grad.zero_()
        for view, g in zip(self.grad_views, grads):
            if g is not None:
                view.copy_(dense(g))
        return self.grad


class Layout:
    """Which of the Trainer's parameters share fused keys, and under which keys.

    Fused are the parameters trainable at creation under FUSE_BELOW_BYTES, in groups of one
    device, one dtype and one lr_mult/wd_mult (an update is then the same elementwise pass
    over the packed key as over each member), up to ``cap`` bytes per key. Fused keys take
    the ints after the parameters' positions; every other parameter keeps its position as
    its key. Workers whose parameters lie on different devices (rank r on GPU r, or one on
    the CPU) get the same layout as long as each splits them over devices alike; the
    Trainer checks that every worker's ``digest`` equals rank 0's.
    """

    def __init__(self, params, optimizer, cap, enabled, whole_updates):
        """``whole_updates``: workers update a fused key in one pass where its multipliers
        allow (see FusedKey.updated_whole)."""
        self.fused = []         # FusedKey, in the order of their first members
        self.by_member = {}     # param key -> its FusedKey
        if enabled and cap > 0:
            self._build(params, optimizer, cap, whole_updates)

    def _build(self, params, optimizer, cap, whole_updates):
        open_keys, groups = {}, []   # groups: (kind, members)
        for p in params:
            nbytes = p.tensor.numel() * p.tensor.element_size()
            if not (p.trainable and nbytes < FUSE_BELOW_BYTES):
                continue
            # One device per fused key: its members are packed with one torch.cat
            kind = (p.tensor.device, p.tensor.dtype, optimizer.lr_mult.get(p.key, 1.0),
                    optimizer.wd_mult.get(p.key, 1.0))
            group = open_keys.get(kind)
            if group is None or group[0] + nbytes > cap:
                group = open_keys[kind] = [0, []]
                groups.append((kind, group[1]))
            group[0] += nbytes
            group[1].append(p)
        next_key = max(p.key for p in params) + 1
        for (_, _, lr_mult, wd_mult), members in groups:
            if len(members) > 1:       # one parameter alone keeps its own key
                # an update that reads each weight whole (LAMB's norms, SGLD's noise by
                # element, one in Python) runs per member, not over the packed members as one
                plain = whole_updates and lr_mult == wd_mult == 1.0 and \
                    not optimizer.whole_tensor
                self._add(FusedKey(next_key, members, plain))
                next_key += 1

    def digest(self):
        """What must be the same on every worker: which parameters share which key."""
        return hashlib.sha256(repr(sorted(
            (f.key, [p.key for p in f.members]) for f in self.fused)).encode()).digest()

    def _add(self, fused):
        self.fused.append(fused)
        for p in fused.members:
            self.by_member[p.key] = fused

    def dissolve(self, fused):
        """``fused``'s members take their own keys from now on."""
        self.fused.remove(fused)
        for p in fused.members:
            del self.by_member[p.key]

    def updated_whole(self):
        """The fused keys whose optimizer state (workers updating) is under their own key."""
        return [f for f in self.fused if f.updated_whole]

    def ranges(self, fused=None):
        """{fused key: [(member key, start, stop)]} of ``fused`` (default: every fused key)."""
        return {f.key: f.ranges() for f in (self.fused if fused is None else fused)}

    def store_keys(self, params):
        """[(first member's position, store key, param or FusedKey)] for ``params`` and the
        fused keys holding any of them, in the order of their positions."""
        out, seen = [], set()
        for p in params:
            fused = self.by_member.get(p.key)
            if fused is None:
                out.append((p.key, p.key, p))
            elif fused.key not in seen:
                seen.add(fused.key)
                out.append((fused.first_key, fused.key, fused))
        return sorted(out, key=lambda item: item[0])

    def server_spec(self, spec):
        """An optimizer spec with its lr_mult/wd_mult tables extended to the fused keys (each
        takes its members' multipliers), as the servers, which see store keys only, need."""
        return self._with_tables(spec, lambda table: {
            **table, **{f.key: table[f.first_key] for f in self.fused if f.first_key in table}})

    def file_spec(self, spec):
        """An optimizer spec with the fused keys left out of its tables: files are per
        parameter, whoever loads them."""
        fused = {f.key for f in self.fused}
        return self._with_tables(spec, lambda table: {
            key: mult for key, mult in table.items() if key not in fused})

    @staticmethod
    def _with_tables(spec, change):
        # from_spec takes a table as a dict or as [key, value] pairs; both make a dict
        return {**spec, **{attr: change(dict(spec.get(attr) or {}))
                           for attr in ('lr_mult', 'wd_mult')}}


def split_partly_frozen(store, layout, server_has_optimizer):
    """Give the members of fused keys now partly frozen keys of their own, and return theirs
    (collective; every worker freezes alike): the servers update a key whole, and a frozen
    member must not move (weight decay, momentum). Weights and optimizer state move over
    exactly, so the parameters train on as they would have unfused. ``store``: the Trainer's
    store view (a kvps store: only they have fused keys)."""
    mixed = [f for f in layout.fused if 0 < f.trainable_count() < len(f.members)]
    if not mixed:
        return []
    store.barrier()   # every worker's pushes so far are applied: the values are final
    pull_weights(store, [(f.first_key, f.key, f) for f in mixed])
    members = [p for f in mixed for p in f.members]
    store.init([p.key for p in members], [p.tensor for p in members])
    if server_has_optimizer:
        # Nobody pushes until this collective ends, so the servers' state is still now.
        store.unfuse_server_states(layout.ranges(mixed))
    for fused in mixed:
        layout.dissolve(fused)
        fused.arrived = {}
    log.info('kvps.Trainer: %d parameter(s) of fused keys now partly frozen have keys of '
             'their own', len(members))
    return [p.key for p in members]


def pull_weights(store, entries):
    """Pull ``entries`` (as Layout.store_keys gives) into the parameters."""
    store.pull([key for _, key, _ in entries], out=[weights_of(entry) for _, _, entry in entries])
    scatter_fused(entries)


def scatter_fused(entries):
    """The packed weights of the fused keys of ``entries`` into their members."""
    for _, _, entry in entries:
        if isinstance(entry, FusedKey):
            entry.scatter_weights()


def priority_of(entries):
    """The priority of a push or pull of ``entries`` (parameters or fused keys): minus the
    first one's position (BytePS's ``-index``), so that the first layers' gradients and
    weights travel first: the next forward pass needs them first."""
    return -min(e.first_key if isinstance(e, FusedKey) else e.key for e in entries)


def weights_of(entry, gather=False):
    """Where a store key's weights are: a parameter's tensor, or a fused key's packed buffer
    (filled from its members first with ``gather``)."""
    if isinstance(entry, FusedKey):
        return entry.gather_weights() if gather else entry.weight
    return entry.tensor


def _nbytes(value):
    """Bytes a pushed value sends: a sparse gradient, those of its rows."""
    if type(value) is rows.RowSparse or value.is_sparse:
        values = value.values if type(value) is rows.RowSparse else value._values()
        return values.numel() * values.element_size()
    return value.numel() * value.element_size()


def check_bucket_bytes(cap):
    """Refuse a bucket size that is not an int >= 0 (ValueError)."""
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
        raise ValueError(f'bucket_bytes must be an int >= 0, got {cap!r}')


class PushBucket:
    """Gradients waiting to leave in one push (one message per server for their small parts),
    sent once they hold ``cap`` bytes, when backward ends, or at ``step``: many small
    tensors cost a few messages instead of one each, and a gradient still leaves before
    backward returns, so code run between backward and step never changes what was sent."""

    def __init__(self, store, cap, after_push=None):
        """``store``: what takes ``push(keys, values)``; ``after_push(keys, entries)`` runs
        right after each push leaves."""
        check_bucket_bytes(cap)
        self._store, self._cap, self._after_push = store, cap, after_push
        self._keys, self._values, self._entries, self._bytes = [], [], [], 0
        self._callback_queued = False
        # Hooks of parameters on several GPUs run on autograd's per-device threads at once
        self._lock = threading.Lock()

    def add(self, key, value, entry):
        """Hold ``value`` for ``key`` (``entry``: its parameter or fused key)."""
        with self._lock:
            self._keys.append(key)
            self._values.append(value)
            self._entries.append(entry)
            self._bytes += _nbytes(value)
            full = self._bytes >= self._cap
        if full:
            self.flush()

    def flush(self):
        with self._lock:   # taken whole, so each gradient leaves in exactly one push
            self._callback_queued = False
            keys, values, entries = self._keys, self._values, self._entries
            self._keys, self._values, self._entries, self._bytes = [], [], [], 0
        if keys:
            self._store.push(keys, values, priority_of(entries))
            if self._after_push is not None:
                self._after_push(keys, entries)

    def flush_when_backward_ends(self):
        """Called from a gradient hook: send what is left once this backward pass is over
        (autograd's end-of-pass callback, the one DDP uses)."""
        if self._callback_queued or not self._keys:
            # (read unlocked, once per parameter: a gradient added meanwhile on another
            # thread is followed by that thread's own call)
            return
        with self._lock:
            if self._callback_queued or not self._keys:
                return
            self._callback_queued = True
        import torch
        torch.autograd.Variable._execution_engine.queue_callback(self.flush)
