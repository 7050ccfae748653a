"""Gluon's Trainer for torch parameters: gradients summed through a KVStore, updates by kvps's
kernels."""

import contextlib
import itertools
import os
import warnings
import weakref

from ..errors import ConfigError, DuplicateInitError, ParameterMismatchError, StaleGradientError
from ..timeline.recording import traced
from .cross_barrier import Arrivals, check_cross_barrier, hook_modules
from .elastic_batch import ElasticBatch
from .exchange import Exchange
from .fusion import (REQUIRES_GRAD, Layout, check_bucket_bytes, scatter_fused, split_partly_frozen,
                     weights_of)
from .grads import GradientLog, on_grad
from .handover import Handover
from .local_updates import local_updates
from .mode import Mode
from .params import ParamGroup, check_devices, collect, make_optimizer, merge_mults
from .state_files import read_optimizer
from .stores import check_compression, one_trainer_per_store, open_store
from .torch_updates import workers_update

__all__ = ['Trainer', 'ParameterMismatchError', 'StaleGradientError']

BUCKET_BYTES = 4 << 20   # gradients per push while backward runs (DDP's default is 25 MB)
# The same when the job spans hosts. A step ends with its last bucket's push and its weights'
# return over the links, which smaller buckets (and fused keys) shorten: bench_hosts --training
# deep, 4 hosts at 1 Gbit/s, 191-223 -> 167-181 ms a step. On one host, through shared memory,
# smaller buckets only add messages: bench_training deep 23.6-23.9 -> 25.4-27.1 ms.
BUCKET_BYTES_ACROSS_HOSTS = 1 << 20


class Trainer:
    """Applies an optimizer to torch parameters, as ``mxnet.gluon.Trainer`` does (docs/trainer.md).

    ``params``: a module, its ``named_parameters()``, a dict name -> parameter, or a list of
    parameters; store keys are their positions in the order given. ``optimizer``: a name with
    ``optimizer_params``, or a ``kvps.optimizer`` instance. ``kvstore``: None, a type name or a
    KVStore; one process holds one device, so only 'dist*' names create a store.
    ``update_on_kvstore``: None lets Gluon's rules choose (servers update in async and by
    default in sync; False sums gradients through the servers and updates on every worker).
    kvps's own: ``overlap`` sends gradients while backward runs, in buckets of about
    ``bucket_bytes`` (None: 4 MiB, 1 MiB across hosts), as DDP does (off: several backward
    passes accumulate before ``step``; ``no_sync()`` does that with it on); ``fuse`` packs
    parameters under 512 KiB into shared keys, as DDP and Horovod fuse small tensors, with the
    same results; ``cross_barrier`` (off by default) lets ``step`` return once its pulls are
    under way, each module's forward waiting for its own parameters (BytePS's). Pushes and
    pulls carry MXNet's priority, the first parameters' the highest.

    Parameters may live on CUDA devices with a device store ('dist_sync_device',
    'dist_async_device') or none: they then stay on the GPU where the servers keep GPU shards
    on this host (CUDA IPC), else are copied once each way through host memory.

    Creating a Trainer on a store is collective: every worker must create it, with the same
    parameters; rank 0's initial weights are copied into every worker's parameters.
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore='device',
                 compression_params=None, update_on_kvstore=None, *, overlap=True,
                 bucket_bytes=None, fuse=True, cross_barrier=False):
        self._params = collect(params)
        self._optimizer = make_optimizer(optimizer, optimizer_params)
        merge_mults(self._optimizer, self._params)
        self._scale = self._optimizer.rescale_grad
        check_compression(kvstore, compression_params)
        update_on_kvstore = workers_update(self._optimizer, update_on_kvstore)   # (torch's)
        # The store's view (stores.KvpsStore or UserStore), or None; and the mode, once
        self._store, on_servers = open_store(kvstore, update_on_kvstore)
        check_devices(self._params, self._store, on_servers, self._optimizer)
        self._mode = Mode.choose(self._store, on_servers, self._optimizer, fuse, overlap)
        if cross_barrier:   # refused alike on every worker, before any collective
            check_cross_barrier(params, self._store, self._mode)
        if bucket_bytes is None:   # (alike on every worker: the job's hosts when it formed)
            across = self._store is not None and self._store.num_hosts > 1
            bucket_bytes = BUCKET_BYTES_ACROSS_HOSTS if across else BUCKET_BYTES
        elif self._store is not None:
            check_bucket_bytes(bucket_bytes)   # before the layout reads it
        self._layout = Layout(self._params, self._optimizer, bucket_bytes, self._mode.fused,
                              whole_updates=self._mode.whole_updates)
        self._local = None if on_servers else local_updates(self._optimizer, self._params,
                                                             self._layout)
        self._grads = GradientLog(self._mode.distributed)
        self._server_has_optimizer = False
        self._batch_size_known = False    # a step (of this job) has set rescale_grad
        self._reduced = False      # 'grads' or 'buffers': where this step's sums are
        self._exchange = None
        self._elastic = None       # an elastic job's ElasticBatch
        self._handover = None      # an elastic job's when workers update: its Handover
        if self._store is not None:
            self._exchange = Exchange(self._store, self._mode, self._layout, bucket_bytes,
                                      self._grads)
            if compression_params:
                self._store.set_compression(compression_params)
            self._init_store()
        # Gradients leave as backward makes them (see Mode.sends_from_first_backward)
        self._armed = self._mode.sends_from_first_backward
        self._hooks = {}           # key -> handle of the hook sending its gradient
        self._tensors = [p.tensor for p in self._params]
        self._trainable_flags = None   # requires_grad of each parameter when last read
        self._hook_trainable()
        self._grads.next_step(self._trainable)
        # Off by default: with it, a parameter read outside the forward of a module that owns
        # it, between step and the next forward (logging, torch.save, an EMA, a functional
        # use), silently gives the weights of before the step unless wait() is called first,
        # and a pull's error surfaces in the forward; it gains only the tail of the pulls'
        # time (see docs/trainer.md).
        self._arrivals = Arrivals() if cross_barrier else None
        self._accumulating = False   # inside no_sync()
        self._forward_hooks = [] if self._arrivals is None else hook_modules(
            params, self._params, self._arrivals)

    def _hook_trainable(self):
        """Take the parameters requiring grad now as this step's ``_trainable`` (read at
        every step, as Gluon reads grad_req, so that freezing and unfreezing mid-training
        work as in torch.optim), and hook those not hooked yet (torch refuses hooks on the
        others): from their next backward on, their gradients leave as it runs."""
        flags = list(map(REQUIRES_GRAD, self._tensors))   # (C: hundreds of parameters)
        if flags == self._trainable_flags:
            return
        self._trainable_flags = flags
        self._trainable = list(itertools.compress(self._params, flags))
        ref = weakref.ref(self)
        for p in self._trainable:
            if p.key not in self._hooks:
                self._hooks[p.key] = p.tensor.register_post_accumulate_grad_hook(on_grad(ref, p))

    # -- properties ------------------------------------------------------------------------
    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    @property
    def optimizer(self):
        return self._optimizer

    @property
    def param_groups(self):
        """torch.optim's groups (one ParamGroup): ``'lr'`` to read or set; ``'params'``, for a
        GradScaler to unscale and check the sums allreduce_grads() leaves in their ``.grad``."""
        return [ParamGroup(self._scaled_params, self.learning_rate, self.set_learning_rate)]

    def _scaled_params(self):
        if self._mode.on_servers:
            raise RuntimeError(
                "param_groups' params: the store updates them, so no .grad holds what it "
                'applies, for a GradScaler to unscale or skip; create the Trainer with '
                'update_on_kvstore=False (docs/trainer.md, mixed precision)')
        if self._mode.distributed and self._reduced != 'grads':   # (before, each worker's own)
            raise RuntimeError(
                "param_groups' params: call allreduce_grads() first: .grad then holds the sums "
                'every worker sees, so a GradScaler steps or skips on all of them alike')
        self._hook_trainable()
        return [p.tensor for p in self._trainable]

    @property
    def kvstore(self):
        """The store gradients go through, or None (single process, local updates)."""
        return None if self._store is None else self._store.kv

    @property
    def update_on_kvstore(self):
        """True when the servers run the optimizer; False when every worker updates itself."""
        return self._mode.on_servers

    @property
    def round_key(self):
        """A store key this Trainer pushes at every step (its first trainable parameter's,
        or the fused key holding it): what kvps.elastic.Sampler ties its batches to."""
        trainable = [p for p in self._params if p.trainable]
        if self._store is None or not trainable:
            raise ValueError('round_key: this Trainer pushes nothing (no distributed store, '
                             'or no parameter requires grad)')
        return self._layout.store_keys(trainable[:1])[0][1]

    @property
    def joining(self):
        """Whether this Trainer joined a running elastic job, updates on the workers, and waits
        for a member's weights and optimizer state (its steps abstain meanwhile)."""
        return self._handover is not None and self._handover.waiting

    def set_learning_rate(self, lr):
        """Set the learning rate; where the servers update, theirs too (every worker at once)."""
        self._optimizer.set_learning_rate(lr)
        if self._mode.on_servers and self._server_has_optimizer:
            if self._exchange.pushed:
                warnings.warn(
                    'set_learning_rate between backward() and step(): this step\'s gradients '
                    'already left for the servers (overlap), which apply them at the old rate; '
                    'the new one applies from the next step. Set it before backward() (or use '
                    'an lr_scheduler, which the servers follow per update), or create the '
                    'Trainer with overlap=False', stacklevel=2)
            self._reinstall_optimizer()

    # -- training --------------------------------------------------------------------------
    def wait(self):
        """With cross_barrier: put every weight a step pulled into its parameter (forwards do
        so for their own); call it before reading parameters otherwise. Without: nothing."""
        if self._arrivals is not None:
            self._arrivals.wait_all()

    @traced('step', 'step')
    def step(self, batch_size, ignore_stale_grad=False):
        """One update: gradients normalized by 1/batch_size, summed over workers, applied; after
        allreduce_grads(), the sums in .grad as they are (update(): GradScaler.step's call)."""
        if self._reduced == 'grads':
            return self.update(batch_size, ignore_stale_grad)
        if self._exchange is not None:
            self._exchange.check_sent_unchanged()
        self.wait()   # the last step's weights, in place before this one pulls more
        self._hook_trainable()
        self._rescale(batch_size)
        if self._mode.on_servers:
            self._dissolve_mixed()
        self._grads.check(self._trainable, ignore_stale_grad)
        if self._arrivals is not None:   # the servers update: weights land in forward
            self._arrivals.expect(self._exchange.allreduce_later(self._taking_part()),
                                  self._exchange.settle)
        else:   # (sums into .grad for a torch optimizer, which reads them there)
            self._allreduce_grads(into_grads=bool(self._local and self._local.reads_grads))
        if not self._mode.on_servers:
            self._update()
        self._end_step()

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's no_sync(): backward passes inside it add to each ``.grad`` and send nothing;
        the next one outside sends the sums as it runs (overlap kept) for ``step`` to apply."""
        accumulating, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = accumulating

    @traced('allreduce_grads', 'exchange')
    def allreduce_grads(self):
        """Sum every worker's gradients into each ``param.grad`` (update_on_kvstore=False)."""
        if self._mode.on_servers:
            raise RuntimeError('allreduce_grads() is not possible when the servers update the '
                               'parameters; create the Trainer with update_on_kvstore=False')
        if self._exchange is None:   # alone: nothing to reduce (update() reads .grad)
            return
        self._end_skipped_step()
        self._exchange.check_sent_unchanged()
        self._hook_trainable()
        self._allreduce_grads(into_grads=True)

    @traced('update', 'update')
    def update(self, batch_size, ignore_stale_grad=False):
        """Apply the optimizer to the (reduced) gradients; pairs with allreduce_grads()."""
        if self._mode.on_servers:
            raise RuntimeError('update() is not possible when the servers update the '
                               'parameters; use step(), or update_on_kvstore=False')
        if self._mode.distributed and not self._reduced:
            raise RuntimeError('call allreduce_grads() before update() in distributed mode '
                               '(or use step()); updating with local gradients would make '
                               'the workers\' parameters diverge')
        self._hook_trainable()
        self._rescale(batch_size)
        self._grads.check(self._trainable, ignore_stale_grad)
        self._update()
        self._end_step()

    def zero_grad(self, set_to_none=True):
        """Clear the gradients of every parameter (torch's Optimizer.zero_grad)."""
        for p in self._params:
            if p.tensor.grad is not None:
                if set_to_none:
                    p.tensor.grad = None
                else:
                    p.tensor.grad.detach_().zero_()

    # -- checkpoints -----------------------------------------------------------------------
    def save_states(self, fname):
        """Write the optimizer and its per-parameter state (momentum, counts) to ``fname``.

        One format whoever runs the optimizer: a file saved with update_on_kvstore=True
        loads into a Trainer that updates locally, and the other way round."""
        fname = os.fspath(fname)
        self.wait()
        if self._mode.on_servers and self._server_has_optimizer:
            self._store.save_server_states(fname, self._layout)
        else:  # local updates, or servers that have not updated anything yet
            local = self._local or local_updates(self._optimizer, self._params, self._layout)
            local.save(fname)

    def load_states(self, fname):
        """Restore what save_states wrote (collective when the servers run the optimizer)."""
        fname = os.fspath(fname)
        self.wait()
        if self._mode.on_servers:
            optimizer = read_optimizer(fname, self._optimizer)
            if not self._server_has_optimizer:
                self._send_optimizer(optimizer)
                self._server_has_optimizer = True
            self._store.load_server_states(fname, self._layout)
            self._optimizer = optimizer
            # its rescale_grad is the saving job's; the next step sends this job's (the same
            # kind of optimizer again keeps the state just loaded)
            self._batch_size_known = False
        else:
            self._local.load(fname)
            self._optimizer = self._local.optimizer

    # -- internals: setup ------------------------------------------------------------------
    def _init_store(self):
        """Prove the workers agree on the parameters, then broadcast rank 0's weights."""
        self._store.agree_on(self._params, self._layout.digest())
        # the servers get an optimizer that reads weights whole at the first step, after init
        self._store.prepare_init(sum(p.tensor.numel() for p in self._params),
                                 keep_whole=self._mode.on_servers and self._optimizer.whole_tensor)
        reference = self._store.scale_rounds()   # an elastic dist_sync job's size, or None
        if reference is not None:
            kv = self._store.kv
            self._elastic = ElasticBatch(kv, reference)
            if not self._mode.on_servers:   # a joiner takes the weights and state of a member
                self._handover = Handover(kv.notes, self._params, self._local, self._exchange,
                                          self._layout, waiting=kv.joining)
        entries = self._layout.store_keys(self._params)
        keys = [key for _, key, _ in entries]
        try:   # refused alike on every worker (they hold the same key table), before sending
            self._store.broadcast(keys, [weights_of(e, gather=True) for _, _, e in entries])
        except DuplicateInitError as exc:
            raise one_trainer_per_store(exc) from None
        scatter_fused(entries)
        self._exchange.export_buckets()

    # -- internals: one step ---------------------------------------------------------------
    def _rescale(self, batch_size):
        """optimizer.rescale_grad = scale / batch_size, kept in step with the servers' copy
        (an elastic job's batch_size restated for its fixed size: ElasticBatch)."""
        if self._elastic is not None:
            batch_size = self._elastic.job_batch(batch_size)
        rescale = self._scale / batch_size
        changed = rescale != self._optimizer.rescale_grad
        if changed and self._batch_size_known and self._mode.on_servers \
                and self._server_has_optimizer and self._mode.distributed:
            raise ConfigError(  # MXNet raises here too: the servers hold the old rescale_grad
                f'batch_size changed (rescale_grad {self._optimizer.rescale_grad} -> {rescale}) '
                'while the servers run the optimizer: they keep normalizing by the first '
                'batch size. Keep batch_size constant, or use update_on_kvstore=False')
        self._optimizer.rescale_grad = rescale
        self._batch_size_known = True
        if self._mode.on_servers:
            if not self._server_has_optimizer:   # collective: the first step
                self._send_optimizer(self._optimizer)
                self._server_has_optimizer = True
            elif changed:
                self._reinstall_optimizer()

    def _reinstall_optimizer(self):
        """Give the servers the current hyper-parameters; the same kind of optimizer keeps its
        per-key state there (collective)."""
        self._send_optimizer(self._optimizer)

    def _send_optimizer(self, optimizer):
        """Install ``optimizer`` on the servers (collective), its per-key multipliers
        extended to the fused keys."""
        self._store.set_optimizer(self._layout.server_spec(optimizer.to_spec()))

    def _dissolve_mixed(self):
        """Fused keys now partly frozen are split (collective); their members' gradients, if
        noted already, then leave alone."""
        moved = split_partly_frozen(self._store, self._layout, self._server_has_optimizer)
        self._exchange.pushed.difference_update(moved)

    def _on_grad(self, p):
        """Autograd has accumulated p's gradient: send it now when overlapping (once the
        last step's weights are all in place: its pulls' buffers take this step's)."""
        if self._arrivals is not None:
            self._arrivals.wait_all()
        self._end_skipped_step()
        if self._armed and not self._accumulating:
            self._exchange.push_from_backward(p)
        self._grads.arrived(p)

    def _allreduce_grads(self, into_grads):
        """Reduce this step's gradients through the store (none: nothing to do). Alone, a
        stale parameter (ignore_stale_grad) is skipped, as without a store: not pushed (a
        store that updates would move it) nor pulled (into .grad)."""
        if self._exchange is None:
            return
        self._exchange.allreduce(self._taking_part(), into_grads)
        self._reduced = 'grads' if into_grads else 'buffers'

    def _taking_part(self):
        """The trainable parameters reduced this step (GradientLog.taking_part)."""
        return self._grads.taking_part(self._trainable)

    def _update(self):
        """Run the local optimizer on this step's gradients (workers update, or alone)."""
        summed, row_sums = ({}, {}) if self._exchange is None else (
            self._exchange.summed, self._exchange.take_row_sums())
        if self._handover is not None and self._handover.waiting:   # kept, replayed later
            self._handover.keep(self._trainable, self._reduced, self._optimizer.rescale_grad,
                                row_sums)
            return
        self._local.run(self._trainable, self._grads.takes_part, self._reduced, summed,
                        row_sums)

    def _end_skipped_step(self):
        """A step whose sums allreduce_grads() left in .grad and nothing applied (a GradScaler
        found inf or NaN in them, alike on every worker) ends as the next one begins."""
        if self._reduced == 'grads':
            self._end_step()

    def _end_step(self):
        if self._mode.on_servers:
            # The servers counted one update per key; mirror it so that learning_rate follows
            # an lr_scheduler (exact in sync mode; this worker's own updates in async mode).
            self._optimizer.num_update += 1
        self._armed = self._mode.overlap   # servers that update have the optimizer by now
        if self._handover is not None and self._handover.step_ended():   # (took a handover)
            self._optimizer = self._local.optimizer
        if self._exchange is not None:
            self._exchange.next_step()
        self._reduced = False
        self._grads.next_step(self._trainable)
