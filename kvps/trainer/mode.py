"""The Trainer's mode, chosen once: where updates run, distributed or not, fused, overlapped."""

import dataclasses
import enum


class Updates(enum.Enum):
    """Where the optimizer runs."""
    SERVERS = 'servers'    # the store's servers (update_on_kvstore)
    WORKERS = 'workers'    # every worker, on gradients summed through the store
    ALONE = 'alone'        # this process, on its own gradients: there is no store


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a Trainer trains; nothing of it changes after creation."""
    updates: Updates
    distributed: bool   # a 'dist*' store: every worker reduces and updates every parameter
    fused: bool         # small parameters share store keys (see fusion.Layout)
    overlap: bool       # gradients leave while backward runs, in buckets

    @classmethod
    def choose(cls, store, update_on_kvstore, optimizer, fuse, overlap):
        """The mode for ``store`` (a view from stores.open_store, or None) and the Trainer's
        arguments. Fused keys need a store that translates their state (a kvps store), and
        an update that is elementwise where the servers run it (not LAMB's whole-tensor
        norms), by servers of a distributed store: alone, a stale parameter is skipped, and
        a shared key would move it."""
        if store is None:
            return cls(Updates.ALONE, False, False, False)
        distributed = store.distributed
        on_servers = update_on_kvstore
        fused = bool(fuse) and store.fuses and not (
            on_servers and (not distributed or optimizer.whole_tensor))
        return cls(Updates.SERVERS if on_servers else Updates.WORKERS, distributed, fused,
                   bool(overlap) and distributed)

    @property
    def on_servers(self):
        """The servers run the optimizer (Trainer.update_on_kvstore)."""
        return self.updates is Updates.SERVERS

    @property
    def whole_updates(self):
        """Workers update a fused key in one pass: only where every member is updated at
        every step, i.e. distributed (alone, stale parameters are skipped)."""
        return self.distributed and self.updates is Updates.WORKERS

    @property
    def sends_from_first_backward(self):
        """Gradients may leave during the first backward: servers that only sum take them
        at once; servers that update must first get the optimizer, at the first step (it
        needs rescale_grad, i.e. the batch size)."""
        return self.overlap and not self.on_servers
