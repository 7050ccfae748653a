"""The Trainer's gradient exchange: gradients pushed as backward makes them, and weights (or
summed gradients) pulled back where step() puts them."""

import operator

import numpy as np

from .. import devices, rows
from .fusion import FusedKey, PushBucket, priority_of, weights_of
from .grads import GRAD, dense, is_dense

_VERSION = operator.attrgetter('_version')   # a tensor's count of in-place changes


class Exchange:
    """A Trainer's pushes and pulls through its store, for one step at a time."""

    def __init__(self, store, mode, layout, bucket_bytes, grads):
        """``store``: the Trainer's store view (stores.KvpsStore or UserStore); ``mode``: its
        Mode; ``layout``: its fused keys; ``bucket_bytes``: gradients per push while backward
        runs; ``grads``: its GradientLog, where summed gradients land in ``.grad``."""
        self._store, self._mode, self._layout, self._grads = store, mode, layout, grads
        self.pushed = set()    # keys of the parameters whose gradients left this step
        # The .grad tensors backward sent this step, their parameters and versions: see
        # check_sent_unchanged (lists appended as backward runs, compared in C loops)
        self._sent, self._sent_params, self._sent_versions = [], [], []
        self.summed = {}       # key -> where step() pulls a summed gradient (workers update)
        for fused in layout.fused:   # workers update members on views of the sum
            self._sums_in(fused)
        # Parameters whose gradients come sparse (nn.Embedding(sparse=True)) push their rows
        # alone; when the servers update, they pull back only the rows changed since
        # (``_row_marks``: what each one saw last).
        self.row_keys, self._row_marks = set(), {}
        self._row_sums = {}    # key -> (ids, rows) of its summed gradient (workers update)
        self._bucket = PushBucket(store, bucket_bytes, self._pull_early)
        self._early = store.early_pulls(mode.on_servers,
                                        lambda p: self._pull_target(p, into_grads=False))
        # an elastic joiner waiting for its state (trainer.handover): its rounds see no
        # gradient of its own, only its abstentions
        self.abstaining = False

    def export_buckets(self):
        """Gather each fused key's gradients where its pushes need no copy (GPU memory the
        servers map, the ipc route) where the store has room: once its keys are placed."""
        for fused in self._layout.fused:
            flat = self._store.gradient_buffer(fused.grad)
            if flat is not None:
                fused.use_grad(flat)
                self._sums_in(fused)

    def _sums_in(self, fused):
        """Workers updating pull ``fused``'s sum into its gradient buffer, and update its
        members on views of it."""
        self.summed.update((p.key, view) for p, view in zip(fused.members, fused.grad_views))

    def push_from_backward(self, p):
        """Autograd has accumulated p's gradient: send it now (overlap)."""
        if p.key in self.pushed:
            raise RuntimeError(
                f'parameter {p.name} got a second gradient before step(), but its first '
                'one was already sent (kvps overlaps communication with backward). Call '
                'step() after every backward(), or create the Trainer with overlap=False '
                'to accumulate gradients over several backward passes')
        grad = p.tensor.grad
        self._push(p, grad)
        self._sent.append(grad)
        self._sent_params.append(p)
        self._sent_versions.append(grad._version)
        self._bucket.flush_when_backward_ends()

    def check_sent_unchanged(self):
        """Refuse a step whose ``.grad`` tensors were changed (in place, or replaced) after
        backward sent them (RuntimeError): the step applies what was sent, so a change made
        in between (clipping, scaling) would be lost without a word."""
        if all(map(operator.is_, map(GRAD, self._sent_params), self._sent)) and \
                list(map(_VERSION, self._sent)) == self._sent_versions:
            return
        changed = [p.name for p, grad, version in zip(self._sent_params, self._sent,
                                                      self._sent_versions)
                   if p.tensor.grad is not grad or grad._version != version]
        raise RuntimeError(
            f'the .grad of {", ".join(changed[:3])}{" and others" if changed[3:] else ""} '
            'changed after backward sent it (kvps sends gradients as backward makes them), so '
            'this step would apply them unchanged. To clip or scale the sums: '
            'update_on_kvstore=False, allreduce_grads(), change .grad, then step(); to '
            'change each worker\'s own before it leaves: overlap=False (docs/trainer.md)')

    def take_row_sums(self):
        """{key: (ids, rows)} of the summed gradients that came as rows (workers update),
        handed over once."""
        row_sums, self._row_sums = self._row_sums, {}
        return row_sums

    def next_step(self):
        self.pushed.clear()
        self._sent, self._sent_params, self._sent_versions = [], [], []

    def sum_target(self, entry):
        """Where step() pulls the summed gradient of ``entry`` (a parameter or FusedKey)."""
        return self._pull_target(entry, into_grads=False)

    def _push(self, p, grad):
        # Every trainable parameter is pushed every step (zeros when it has no gradient):
        # a sync round completes only when every worker has pushed into it.
        self.pushed.add(p.key)
        if self.abstaining:   # (its abstention leaves with the rest: _send_rest)
            self._push_value(p, grad)   # (notes whether its sums come as rows, as pushed)
            return
        fused = self._layout.by_member.get(p.key)
        if fused is None:
            self._bucket.add(p.key, self._push_value(p, grad), p)
        elif fused.arrive(p, grad):   # a fused key leaves once all its members' gradients are in
            self._bucket.add(fused.key, fused.gather_grads(dense), fused)

    def _push_value(self, p, grad):
        """What a parameter of its own pushes: a sparse gradient's rows alone (where the
        store takes rows), else the dense gradient (zeros for none: rows, none of them)."""
        if grad is None:
            return rows.RowSparse(np.empty(0, np.int64), p.tensor.new_zeros(
                (0, *p.tensor.shape[1:]))) if p.key in self.row_keys else \
                p.tensor.new_zeros(p.tensor.shape)
        if is_dense(grad):
            self.row_keys.discard(p.key)
            return grad
        if self._store.sends_rows(p) and grad.sparse_dim() == 1:
            self.row_keys.add(p.key)
            return grad
        return dense(grad)

    def _pull_early(self, keys, entries):
        """Right behind a push (see early_pulls): in distributed mode with overlap."""
        if self._mode.overlap:
            pairs = [(k, e) for k, e in zip(keys, entries) if k not in self.row_keys]
            if pairs:
                self._early.start(*map(list, zip(*pairs)))

    def allreduce(self, reduced, into_grads):
        """Send what backward has not sent yet of ``reduced`` (the parameters taking part);
        pull weights (servers update) or summed gradients: into each ``.grad``
        (allreduce_grads, as Gluon), or for step() into buffers of the exchange's, so that
        ``.grad`` stays this worker's own and a backward that adds to it without zero_grad
        accumulates as with torch.optim (not onto the sum)."""
        self._send_rest(reduced)
        entries = self._layout.store_keys(reduced)
        # Keys pulled right behind their pushes (overlap) are waited for; one pipelined pull
        # for the rest: all requests leave before any answer is awaited, first layers first
        # (the next forward needs them first).
        started = self._early.started()
        by_rows = [(key, entry) for _, key, entry in entries if key in self.row_keys]
        rows_landed = self._pull_rows_begin(by_rows) if by_rows else None
        late = [(key, entry) for _, key, entry in entries
                if key not in started and key not in self.row_keys]
        if late:
            self._store.pull([key for key, _ in late],
                             out=[self._late_target(entry, into_grads) for _, entry in late],
                             priority=priority_of([entry for _, entry in late]))
        if rows_landed is not None:
            self._land_rows(by_rows, rows_landed(), into_grads)
        early = self._early.finish()
        for _, key, entry in entries:
            self.settle(key, entry, key in early, into_grads)
        if into_grads:
            self._land_fused_grads(entries, {p.key for p in reduced})

    def allreduce_later(self, reduced):
        """step()'s exchange when the servers update, without waiting (cross_barrier): send
        what backward has not sent, start every pull into the exchange's buffers; returns
        ``[(key, entry, wait)]`` of those pulls, to be waited for and ``settle``-d before
        anything reads the entry's parameters. (Rows are pulled into the weights
        themselves: those are waited for here.)"""
        self._send_rest(reduced)
        entries = self._layout.store_keys(reduced)
        by_rows = [(key, entry) for _, key, entry in entries if key in self.row_keys]
        if by_rows:
            self._pull_rows_begin(by_rows)()
        started = self._early.started()
        late = [(key, entry) for _, key, entry in entries
                if key not in started and key not in self.row_keys]
        if late:
            self._early.start(*map(list, zip(*late)))
        waits = self._early.take()
        return [(key, entry, waits[key]) for _, key, entry in entries if key in waits]

    def _send_rest(self, reduced):
        """Push the gradients of ``reduced`` that backward did not send, and the fused keys
        some of whose members are frozen (zeros for them); then flush. Abstaining: an
        abstention from the round of each of their keys."""
        if self.abstaining:
            self._store.abstain([key for _, key, _ in self._layout.store_keys(reduced)])
            return
        for p in reduced:
            if p.key not in self.pushed:
                self._push(p, p.tensor.grad)
        for fused in self._layout.fused:
            if fused.arrived:
                self._bucket.add(fused.key, fused.gather_grads(dense), fused)
        self._bucket.flush()

    def _pull_rows_begin(self, by_rows):
        """Send the pulls of parameters whose gradients went as rows: the rows their servers
        changed into the weights, or the rows of the summed gradient (workers update)."""
        return self._store.pull_rows_begin([key for key, _ in by_rows],
                                           [p.tensor.detach() for _, p in by_rows],
                                           self._row_marks, self._mode.on_servers,
                                           priority_of([p for _, p in by_rows]))

    def _land_rows(self, by_rows, got, into_grads):
        """Workers update: keep the summed rows for the local update (a lazy update of those
        rows); for allreduce_grads also write them into ``.grad`` (zeros elsewhere), where
        update() reads those rows back (the caller may have clipped them)."""
        if self._mode.on_servers:
            return
        self._row_sums = got
        for key, p in by_rows if into_grads else ():
            target = self._grads.dense_grad(p)
            target.detach().zero_()
            devices.put_rows(target, *got[key])

    def _late_target(self, entry, into_grads):
        if self._mode.on_servers:
            return weights_of(entry)
        return self._pull_target(entry, into_grads)

    def settle(self, key, entry, early=True, into_grads=False):
        """Put what the pull of ``key`` brought where step's caller sees it: a fused key's
        packed weights into its members, an early pull's buffer (``early``) into a
        parameter's weights or ``.grad``."""
        on_servers = self._mode.on_servers
        if isinstance(entry, FusedKey):
            if on_servers:
                entry.scatter_weights()
        elif early and on_servers:
            entry.tensor.detach().copy_(self._early.staged(key))
        elif early and into_grads:
            self._grads.dense_grad(entry).copy_(self.summed[key])

    def _land_fused_grads(self, entries, reduced):
        """allreduce_grads: summed gradients of fused keys into the ``.grad`` of their members
        reduced (keys in ``reduced``), as Gluon leaves them: one fused copy (hundreds of small
        members: a copy each would cost more than their bytes)."""
        pairs = [(self._grads.dense_grad(p), view) for _, _, entry in entries
                 if isinstance(entry, FusedKey)
                 for p, view in zip(entry.members, entry.grad_views) if p.key in reduced]
        if pairs:
            import torch
            torch._foreach_copy_(*map(list, zip(*pairs)))

    def _pull_target(self, p, into_grads):
        if isinstance(p, FusedKey):
            return p.grad
        if not into_grads:
            summed = self.summed.get(p.key)
            if summed is None:
                summed = self.summed[p.key] = p.tensor.new_empty(p.tensor.shape)
            return summed
        return self._grads.dense_grad(p)
