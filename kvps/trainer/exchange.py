"""The Trainer's gradient exchange: gradients pushed as backward makes them, and weights (or summed gradients) pulled back where step() puts them."""

import numpy as np

from .. import devices, rows
from .fusion import FusedKey, weights_of


class GradientExchange:
    """Pushes and pulls of a Trainer (its ``_kv``, ``_layout``, ``_bucket``, ``_early``,
    ``_summed`` and row bookkeeping; see trainer.py)."""

    def _push(self, p, grad):
        # Every trainable parameter is pushed every step (zeros when it has no gradient):
        # a sync round completes only when every worker has pushed into it.
        self._pushed.add(p.key)
        fused = self._layout.by_member.get(p.key)
        if fused is None:
            self._bucket.add(p.key, self._push_value(p, grad), p)
        elif fused.arrive(p, grad):   # a fused key leaves once all its members' gradients are in
            self._bucket.add(fused.key, fused.gather_grads(dense), fused)

    def _push_value(self, p, grad):
        """What a parameter of its own pushes: a sparse gradient's rows alone (to a kvps store,
        for a host parameter), else the dense gradient (zeros for none: rows, none of them)."""
        if grad is None:
            return rows.RowSparse(np.empty(0, np.int64), p.tensor.new_zeros(
                (0, *p.tensor.shape[1:]))) if p.key in self._row_keys else \
                p.tensor.new_zeros(p.tensor.shape)
        if is_dense(grad):
            self._row_keys.discard(p.key)
            return grad
        if hasattr(self._kv, 'pull_changed_rows_begin') and p.tensor.device.type == 'cpu' \
                and p.tensor.is_contiguous() and grad.sparse_dim() == 1:
            self._row_keys.add(p.key)
            return grad
        return dense(grad)

    def _pulls_rows(self, key):
        """Whether step() pulls rows of ``key``: those its servers changed (they update), or
        those of the summed gradient (workers update)."""
        return key in self._row_keys

    def _pull_early(self, keys, entries):
        """Right behind a push (see _trainer_pulls): in distributed mode with overlap."""
        if self._overlap:
            pairs = [(k, e) for k, e in zip(keys, entries) if not self._pulls_rows(k)]
            if pairs:
                self._early.start(*map(list, zip(*pairs)))

    def _allreduce_grads(self, into_grads):
        """Send what backward has not sent yet; pull weights (servers update) or summed
        gradients: into each ``.grad`` (allreduce_grads, as Gluon), or for step() into buffers
        of the Trainer's, so that ``.grad`` stays this worker's own and a backward that adds
        to it without zero_grad accumulates as with torch.optim (not onto the sum)."""
        if self._kv is None:
            return
        # Alone, a stale parameter (ignore_stale_grad) is skipped, as without a store: not
        # pushed (a store that updates would move it) nor pulled (into .grad).
        reduced = [p for p in self._trainable if self._takes_part(p)]
        for p in reduced:
            if p.key not in self._pushed:
                self._push(p, p.tensor.grad)
        for fused in self._layout.fused:   # some members frozen (workers update): zeros for them
            if fused.arrived:
                self._bucket.add(fused.key, fused.gather_grads(dense), fused)
        self._bucket.flush()
        entries = self._layout.store_keys(reduced)
        # Keys pulled right behind their pushes (overlap) are waited for; one pipelined pull
        # for the rest: all requests leave before any answer is awaited, first layers first
        # (the next forward needs them first).
        started = self._early.started()
        by_rows = [(key, entry) for _, key, entry in entries if self._pulls_rows(key)]
        rows_landed = self._pull_rows_begin(by_rows) if by_rows else None
        late = [(key, entry) for _, key, entry in entries
                if key not in started and not self._pulls_rows(key)]
        if late:
            self._kv.pull([key for key, _ in late],
                          out=[self._late_target(entry, into_grads) for _, entry in late])
        if rows_landed is not None:
            self._land_rows(by_rows, rows_landed(), into_grads)
        self._settle(entries, self._early.finish(), into_grads)
        if into_grads:
            self._land_fused_grads(entries, {p.key for p in reduced})
        self._reduced = 'grads' if into_grads else 'buffers'

    def _pull_rows_begin(self, by_rows):
        """Send the pulls of parameters whose gradients went as rows: the rows their servers
        changed into the weights, or the rows of the summed gradient (workers update)."""
        keys = [key for key, _ in by_rows]
        if self._update_on_kvstore:
            return self._kv.pull_changed_rows_begin(
                keys, [p.tensor.detach() for _, p in by_rows], self._row_marks)
        return self._kv.pull_pushed_rows_begin(keys)

    def _land_rows(self, by_rows, got, into_grads):
        """Workers update: keep the summed rows for _update (a lazy update of those rows);
        for allreduce_grads also write them into ``.grad`` (zeros elsewhere), where update()
        reads those rows back (the caller may have clipped them)."""
        if self._update_on_kvstore:
            return
        self._row_sums = got
        for key, p in by_rows if into_grads else ():
            target = self._grad_target(p)
            target.detach().zero_()
            devices.put_rows(target, *got[key])

    def _late_target(self, entry, into_grads):
        if self._update_on_kvstore:
            return weights_of(entry)
        return self._pull_target(entry, into_grads)

    def _settle(self, entries, early, into_grads):
        """Put what the pulls brought where step's caller sees it: fused keys' packed weights
        into their members, early pulls' buffers into a parameter's weights or ``.grad``."""
        for _, key, entry in entries:
            if isinstance(entry, FusedKey):
                if self._update_on_kvstore:
                    entry.scatter_weights()
            elif key in early and self._update_on_kvstore:
                entry.tensor.detach().copy_(self._early.staged(key))
            elif key in early and into_grads:
                self._grad_target(entry).copy_(self._summed[key])

    def _land_fused_grads(self, entries, reduced):
        """allreduce_grads: summed gradients of fused keys into the ``.grad`` of their members
        reduced (keys in ``reduced``), as Gluon leaves them."""
        for _, _, entry in entries:
            if isinstance(entry, FusedKey):
                for p, view in zip(entry.members, entry.grad_views):
                    if p.key in reduced:
                        self._grad_target(p).copy_(view)

    def _pull_target(self, p, into_grads):
        if isinstance(p, FusedKey):
            return p.grad
        if not into_grads:
            summed = self._summed.get(p.key)
            if summed is None:
                summed = self._summed[p.key] = p.tensor.new_empty(p.tensor.shape)
            return summed
        return self._grad_target(p)

    def _grad_target(self, p):
        grad = p.tensor.grad   # summed gradients land in dense .grad tensors
        if grad is None or not is_dense(grad):
            p.tensor.grad = p.tensor.new_zeros(p.tensor.shape)
            self._seen_grads[p.key] = p.tensor.grad
        return p.tensor.grad


def is_dense(grad):
    import torch  # lazy: kvps imports without torch (it is loaded once a Trainer exists)
    return grad.layout == torch.strided


def dense(grad):
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the dense tensor it stands for:
    store keys and kernels are dense, so it trains as ``sparse=False`` would."""
    return grad if is_dense(grad) else grad.to_dense()
