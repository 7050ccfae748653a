"""The optimizer run by the Trainer's own process (workers update, or no store), and its state."""

from ..arrays import as_numpy
from ..devices import kernel_view, put_rows
from ..optimizer.updater import Updater
from .grads import dense
from .state_files import (install_local_states, load_local_states, local_states, save_local_states,
                          split_local_state)
from .torch_updates import TorchOptimizer, TorchUpdates


def local_updates(optimizer, params, layout):
    """What runs ``optimizer`` in the Trainer's process: TorchUpdates for a torch.optim one,
    else LocalUpdates (kvps's kernels)."""
    if isinstance(optimizer, TorchOptimizer):
        return TorchUpdates(optimizer, params)
    return LocalUpdates(optimizer, params, layout)


class LocalUpdates:
    """An Updater over a Trainer's parameters: numpy for CPU parameters, cupy (through
    DLPack, no copy) for CUDA ones; a fused key's members in one pass over the packed key
    (one kernel call instead of one per member)."""

    reads_grads = False   # step() leaves .grad as backward made it: the sums come apart
    hands_over = True     # its state travels as kvps data to an elastic job's joiner

    def __init__(self, optimizer, params, layout):
        shapes = {p.key: tuple(p.tensor.shape) for p in params}   # (fused keys: flat)
        # An optimizer written in Python sees each parameter in its shape, as in Gluon
        self.updater = Updater(optimizer, lambda key, part: shapes.get(key))
        self._params, self._layout = params, layout

    @property
    def optimizer(self):
        return self.updater.optimizer

    def run(self, trainable, takes_part, reduced, summed, row_sums):
        """One update of the ``trainable`` parameters that ``takes_part(p)`` (distributed:
        every one, with the same summed gradient, so workers stay identical even where their
        stale parameters differ). ``reduced``: 'grads' (allreduce_grads left the sums in
        ``.grad``), 'buffers' (step pulled them into ``summed``: key -> tensor) or False
        (``.grad`` as backward left it); ``row_sums``: {key: (ids, rows)} of summed gradients
        that came as rows."""
        items, whole, done = self._fused_items(reduced)
        lazy = []
        for p in trainable:
            if p.key in done:
                continue
            if p.key in row_sums and takes_part(p):
                lazy.append((p, *_summed_rows(p, *row_sums[p.key], reduced)))
                continue
            grad = summed.get(p.key) if reduced == 'buffers' else p.tensor.grad
            if grad is None or not takes_part(p):
                continue
            # Flat views: the state then has the servers' layout, so files load either way.
            # The gradient stays as backward (or allreduce_grads) left it, as with torch.optim.
            items.append((p.key, 0, kernel_view(p.tensor),
                          kernel_view(dense(grad), read_only=True)))
        if items:
            self.updater.update_many(items)
        for p, ids, rows in lazy:
            self._update_rows(p, ids, rows)
        for fused in whole:
            fused.scatter_weights()

    def _fused_items(self, reduced):
        """``(update items, fused keys updated whole, their members' keys)`` of the fused
        keys updated in one pass; those now partly frozen move to per-member state."""
        items, whole, done = [], [], set()
        for fused in self._layout.updated_whole():
            trainable = fused.trainable_count()
            if 0 < trainable < len(fused.members):   # partly frozen: per member from now on
                split_local_state(self.updater, self._sizes(), self._ranges(), fused.key)
                fused.updated_whole = False
                continue
            done.update(p.key for p in fused.members)
            if trainable:
                if reduced == 'grads':   # the sums allreduce_grads left (maybe clipped)
                    fused.arrived = {p.key: p.tensor.grad for p in fused.members}
                    fused.gather_grads(dense)
                items.append((fused.key, 0, kernel_view(fused.gather_weights()),
                              kernel_view(fused.grad, read_only=True)))
                whole.append(fused)
        return items, whole, done

    def _update_rows(self, p, ids, rows):
        """A summed gradient that came as rows: only those rows update (lazy_update), else
        the dense gradient they stand for."""
        if self.updater.updates_rows:
            self.updater.update_rows(p.key, 0, kernel_view(p.tensor), ids, rows,
                                     rows.shape[1] if rows.ndim == 2 else 1)
            return
        grad = p.tensor.new_zeros(p.tensor.shape)
        put_rows(grad, ids, rows)
        self.updater.update_many([(p.key, 0, kernel_view(p.tensor),
                                   kernel_view(grad, read_only=True))])

    # -- state files ------------------------------------------------------------------------
    def save(self, fname):
        """The optimizer and its per-parameter state into ``fname`` (the servers' format)."""
        save_local_states(self.updater, fname, self._sizes(), self._ranges())

    def load(self, fname):
        """Restore what ``save`` (or servers) wrote, checked against the parameters."""
        load_local_states(self.updater, fname, self._sizes(), self._ranges(), self._weights())

    def states(self):
        """What ``save`` writes, as the map (kvps.optimizer.states' file format)."""
        return local_states(self.updater, self._sizes(), self._ranges())

    def install(self, merged, where):
        """``load`` of the map ``states`` gave (``where``: its source, named in errors)."""
        install_local_states(self.updater, merged, self._sizes(), self._ranges(),
                             self._weights(), where)

    def _sizes(self):
        return {p.key: p.tensor.numel() for p in self._params}

    def _ranges(self):
        """{fused key: its members' ranges} where the state is per fused key."""
        return self._layout.ranges(self._layout.updated_whole())

    def _weights(self):
        """{(key, 0): the weight the optimizer updates}, as ``run`` gives them: what a
        loaded state must fit (dtype, size, fp32 master copy)."""
        whole = self._layout.updated_whole()
        weights = {(fused.key, 0): kernel_view(fused.weight) for fused in whole}
        done = {p.key for fused in whole for p in fused.members}
        weights.update(((p.key, 0), kernel_view(p.tensor)) for p in self._params
                       if p.key not in done)
        return weights


def _summed_rows(p, ids, rows, reduced):
    """``(ids, rows)`` of p's summed gradient: as pulled, or after allreduce_grads as its
    ``.grad`` holds them now (clipped, say; its other rows are zeros)."""
    if reduced != 'grads':
        return ids, rows
    grad = as_numpy(p.tensor.grad.detach())
    return ids, grad.reshape(grad.shape[0] if grad.ndim else 1, -1)[ids]
