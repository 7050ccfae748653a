"""Gluon's Trainer for torch parameters: gradients summed through a KVStore, updates by kvps's kernels."""

import os
import warnings
import weakref

from .. import arrays
from ..devices import kernel_view, put_rows
from ..errors import ConfigError, DuplicateInitError, ParameterMismatchError, StaleGradientError
from ..optimizer import optimizers as opt_mod
from ..optimizer.updater import Updater
from .early_pulls import EarlyPulls
from .exchange import GradientExchange, dense
from .fusion import Layout, PushBucket, pull_weights, split_partly_frozen, weights_of
from .params import check_devices, check_same_everywhere, collect, merge_mults
from .store_rules import (check_compression, load_local_states, load_server_states, read_optimizer,
                          resolve, save_local_states, save_server_states, split_local_state)

__all__ = ['Trainer', 'ParameterMismatchError', 'StaleGradientError']

BUCKET_BYTES = 4 << 20   # gradients per push while backward runs (DDP's default is 25 MB)


class Trainer(GradientExchange):
    """Applies an optimizer to torch parameters, as ``mxnet.gluon.Trainer`` does.

    ``params``: a module, its ``named_parameters()``, a dict name -> parameter, or a list of
    parameters; store keys are their positions in the order given. ``optimizer``: a name with
    ``optimizer_params``, or a ``kvps.optimizer`` instance. ``kvstore``: None, a type name or a
    KVStore; one process holds one device, so only 'dist*' names create a store.
    ``update_on_kvstore``: None lets Gluon's rules choose (servers update in async and by
    default in sync; False sums gradients through the servers and updates on every worker).
    ``overlap`` (kvps): in distributed mode, send gradients while backward runs, in buckets
    of about ``bucket_bytes`` (the last one when backward ends), as DDP does; turn off to
    accumulate several backward passes before ``step``. ``fuse`` (kvps): with a store
    (distributed, or updating nothing), pack parameters under 512 KiB into shared keys of up
    to ``bucket_bytes`` (one device, dtype and lr_mult/wd_mult each), as DDP and Horovod fuse
    small tensors: a key costs more than its bytes, and a model's many biases and norms
    would otherwise set the pace. Updates are the same elementwise passes, so results are
    identical; such parameters have no key of their own in the store while fused
    (``fuse=False``: every parameter's key is its position, as in Gluon).

    Parameters may live on CUDA devices when the store is a device store ('dist_sync_device',
    'dist_async_device') or there is none: gradients and weights then pass through pinned host
    buffers, and local updates run the CUDA kernels on cupy views of the tensors (DLPack).

    Creating a Trainer on a store is collective: every worker must create it, with the same
    parameters; rank 0's initial weights are copied into every worker's parameters.
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore='device',
                 compression_params=None, update_on_kvstore=None, *, overlap=True,
                 bucket_bytes=BUCKET_BYTES, fuse=True):
        self._params = collect(params)
        self._optimizer = _make_optimizer(optimizer, optimizer_params)
        merge_mults(self._optimizer, self._params)
        self._scale = self._optimizer.rescale_grad
        check_compression(kvstore, compression_params)
        self._kv, self._update_on_kvstore = resolve(kvstore, update_on_kvstore)
        check_devices(self._params, self._kv, self._update_on_kvstore)
        self._distributed = self._kv is not None and 'dist' in self._kv.type
        self._updater = None if self._update_on_kvstore else Updater(self._optimizer)
        self._server_has_optimizer = False
        self._batch_size_known = False    # a step (of this job) has set rescale_grad
        self._fresh, self._pushed, self._reduced = set(), set(), False
        self._summed = {}          # key -> where step() pulls a summed gradient (workers update)
        self._seen_grads = {}
        # Parameters whose gradients come sparse (nn.Embedding(sparse=True)) push their rows
        # alone; when the servers update, they pull back only the rows changed since
        # (``_row_marks``: what each one saw last).
        self._row_keys, self._row_marks = set(), {}
        self._row_sums = {}        # key -> (ids, rows) of its summed gradient (workers update)
        self._bucket = self._early = None
        if self._kv is not None:
            self._bucket = PushBucket(self._kv, bucket_bytes, self._pull_early)
            self._early = EarlyPulls(self._kv, self._update_on_kvstore,
                                     lambda p: self._pull_target(p, into_grads=False))
        # A whole pass per fused key on the workers needs every member updated at every
        # step: so in distributed mode (not alone, where stale parameters are skipped).
        self._layout = Layout(self._params, self._optimizer, bucket_bytes, self._can_fuse(fuse),
                              whole_updates=self._distributed and not self._update_on_kvstore)
        for fused in self._layout.fused:   # workers update members on views of the sum
            self._summed.update((p.key, view) for p, view in zip(fused.members, fused.grad_views))
        if self._kv is not None:
            self._set_compression(compression_params)
            self._init_store()
        self._overlap = bool(overlap) and self._distributed
        # Servers without an optimizer just sum, so gradients may flow from the first backward;
        # with update_on_kvstore they must wait until step() has sent the optimizer (it needs
        # rescale_grad, i.e. the batch size).
        self._armed = self._overlap and not self._update_on_kvstore
        self._hooks = {}           # key -> handle of the hook sending its gradient
        self._hook_trainable()
        self._note_grads()

    def _can_fuse(self, fuse):
        """Fused keys need a kvps store (its state calls translate them to parameters), and
        an update that is elementwise when the servers run it (not LAMB's whole-tensor
        norms), by servers of a distributed store."""
        if not fuse or self._kv is None or not hasattr(self._kv, 'get_optimizer_states'):
            return False
        if self._update_on_kvstore and not self._distributed:
            return False   # alone a stale parameter is skipped: a shared key would move it
        return not (self._update_on_kvstore and self._optimizer.whole_tensor)

    def _hook_trainable(self):
        """Take the parameters requiring grad now as this step's ``_trainable`` (read at
        every step, as Gluon reads grad_req, so that freezing and unfreezing mid-training
        work as in torch.optim), and hook those not hooked yet (torch refuses hooks on the
        others): from their next backward on, their gradients leave as it runs."""
        self._trainable = [p for p in self._params if p.trainable]
        ref = weakref.ref(self)
        for p in self._trainable:
            if p.key not in self._hooks:
                self._hooks[p.key] = p.tensor.register_post_accumulate_grad_hook(_hook(ref, p))

    # -- properties ------------------------------------------------------------------------
    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    @property
    def optimizer(self):
        return self._optimizer

    @property
    def kvstore(self):
        """The store gradients go through, or None (single process, local updates)."""
        return self._kv

    @property
    def update_on_kvstore(self):
        """True when the servers run the optimizer; False when every worker updates itself."""
        return self._update_on_kvstore

    def set_learning_rate(self, lr):
        """Set the optimizer's learning rate; with update_on_kvstore the servers' copy follows
        at once, so in distributed mode every worker must call this at the same point."""
        self._optimizer.set_learning_rate(lr)
        if self._kv is not None and self._update_on_kvstore and self._server_has_optimizer:
            if self._pushed:
                warnings.warn(
                    'set_learning_rate between backward() and step(): this step\'s gradients '
                    'already left for the servers (overlap), which apply them at the old rate; '
                    'the new one applies from the next step. Set it before backward() (or use '
                    'an lr_scheduler, which the servers follow per update), or create the '
                    'Trainer with overlap=False', stacklevel=2)
            self._reinstall_optimizer()

    # -- training --------------------------------------------------------------------------
    def step(self, batch_size, ignore_stale_grad=False):
        """One update: gradients normalized by 1/batch_size, summed over workers, applied."""
        if self._reduced == 'grads':   # refused alike on every worker, before any collective
            raise RuntimeError(
                'allreduce_grads() has already summed this step\'s gradients into each .grad: '
                'apply them with update(batch_size). step() would reduce them again and '
                'ignore what was done to .grad in between (clipping, say)')
        self._hook_trainable()
        self._rescale(batch_size)
        if self._update_on_kvstore:
            self._dissolve_mixed()
        self._check_stale(ignore_stale_grad)
        self._allreduce_grads(into_grads=False)
        if not self._update_on_kvstore:
            self._update(ignore_stale_grad)
        self._end_step()

    def allreduce_grads(self):
        """Sum every worker's gradients into each ``param.grad`` (update_on_kvstore=False)."""
        if self._kv is not None and self._update_on_kvstore:
            raise RuntimeError('allreduce_grads() is not possible when the servers update the '
                               'parameters; create the Trainer with update_on_kvstore=False')
        self._hook_trainable()
        self._allreduce_grads(into_grads=True)

    def update(self, batch_size, ignore_stale_grad=False):
        """Apply the optimizer to the (reduced) gradients; pairs with allreduce_grads()."""
        if self._kv is not None and self._update_on_kvstore:
            raise RuntimeError('update() is not possible when the servers update the '
                               'parameters; use step(), or update_on_kvstore=False')
        if self._distributed and not self._reduced:
            raise RuntimeError('call allreduce_grads() before update() in distributed mode '
                               '(or use step()); updating with local gradients would make '
                               'the workers\' parameters diverge')
        self._hook_trainable()
        self._rescale(batch_size)
        self._check_stale(ignore_stale_grad)
        self._update(ignore_stale_grad)
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
        if self._kv is not None and self._update_on_kvstore and self._server_has_optimizer:
            save_server_states(self._kv, fname, self._layout)
        else:  # local updates, or servers that have not updated anything yet
            updater = self._updater or Updater(self._optimizer)
            save_local_states(updater, fname, self._sizes(), self._local_ranges())

    def load_states(self, fname):
        """Restore what save_states wrote (collective when the servers run the optimizer)."""
        fname = os.fspath(fname)
        if self._kv is not None and self._update_on_kvstore:
            optimizer = read_optimizer(fname, self._optimizer)
            if not self._server_has_optimizer:
                self._send_optimizer(optimizer)
                self._server_has_optimizer = True
            load_server_states(self._kv, fname, self._layout)
            self._optimizer = optimizer
            # its rescale_grad is the saving job's; the next step sends this job's (the same
            # kind of optimizer again keeps the state just loaded)
            self._batch_size_known = False
        else:
            load_local_states(self._updater, fname, self._sizes(), self._local_ranges(),
                              self._local_weights())
            self._optimizer = self._updater.optimizer

    # -- internals: setup ------------------------------------------------------------------
    def _init_store(self):
        """Prove the workers agree on the parameters, then broadcast rank 0's weights."""
        check_same_everywhere(self._kv, self._params, self._layout.digest())
        balance = getattr(self._kv, 'balance_keys', None)   # a kvps store's
        if balance is not None:
            balance(sum(p.tensor.numel() for p in self._params))
        if self._update_on_kvstore and self._optimizer.whole_tensor:
            keep_whole = getattr(self._kv, 'keep_keys_whole', None)   # a kvps store's
            if keep_whole is not None:
                keep_whole()   # the servers get the optimizer at the first step, after init
        entries = self._layout.store_keys(self._params)
        keys = [key for _, key, _ in entries]
        try:   # refused alike on every worker (they hold the same key table), before sending
            self._kv.init(keys, [weights_of(entry, gather=True) for _, _, entry in entries])
        except DuplicateInitError as exc:
            raise DuplicateInitError(
                f'{exc}: this store already holds keys (another Trainer, or kv.init calls of '
                'your own), and a Trainer\'s keys are its parameters\' positions from 0. One '
                'store serves one Trainer (its servers run one optimizer): give one Trainer '
                'every model\'s parameters (a GAN\'s generator and discriminator too); it '
                'trains those requiring grad at each step, so freeze the other model with '
                'requires_grad_(False), and lr_mult/wd_mult attributes on parameters set their '
                'own rates') from None
        pull_weights(self._kv, entries)

    def _set_compression(self, compression_params):
        if not compression_params:
            return
        setter = getattr(self._kv, 'set_gradient_compression', None)
        if setter is None:   # a store object of the user's own making
            warnings.warn(f'the store {type(self._kv).__name__} has no '
                          'set_gradient_compression; compression_params are ignored and '
                          'gradients travel at full precision', stacklevel=3)
        else:
            setter(compression_params)

    def _sizes(self):
        return {p.key: p.tensor.numel() for p in self._params}

    # -- internals: one step ---------------------------------------------------------------
    def _rescale(self, batch_size):
        """optimizer.rescale_grad = scale / batch_size, kept in step with the servers' copy."""
        rescale = self._scale / batch_size
        changed = rescale != self._optimizer.rescale_grad
        if changed and self._batch_size_known and self._update_on_kvstore \
                and self._server_has_optimizer and self._distributed:
            raise ConfigError(  # MXNet raises here too: the servers hold the old rescale_grad
                f'batch_size changed (rescale_grad {self._optimizer.rescale_grad} -> {rescale}) '
                'while the servers run the optimizer: they keep normalizing by the first '
                'batch size. Keep batch_size constant, or use update_on_kvstore=False')
        self._optimizer.rescale_grad = rescale
        self._batch_size_known = True
        if self._kv is not None and self._update_on_kvstore:
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
        self._kv.set_optimizer(self._layout.server_spec(optimizer.to_spec()))

    def _dissolve_mixed(self):
        """Fused keys now partly frozen are split (collective); their members' gradients, if
        noted already, then leave alone."""
        moved = split_partly_frozen(self._kv, self._layout, self._server_has_optimizer)
        self._pushed.difference_update(moved)

    def _check_stale(self, ignore_stale_grad):
        if ignore_stale_grad:
            return
        stale = [p.name for p in self._trainable if not self._is_fresh(p)]
        if stale:
            raise StaleGradientError(
                f'the gradient of {", ".join(stale[:5])}{" ..." if len(stale) > 5 else ""} was '
                'not updated by backward since the last step. If you intentionally use only '
                'some parameters, call step(..., ignore_stale_grad=True)')

    def _is_fresh(self, p):
        grad = p.tensor.grad
        # A gradient assigned by hand (p.grad = ...) counts as fresh, as one from backward does.
        return p.key in self._fresh or (grad is not None and grad is not self._seen_grads.get(p.key))

    def _takes_part(self, p):
        """Whether ``p`` is reduced and updated this step: in distributed mode every
        parameter is (workers stay identical); alone, only fresh ones (a stale one is skipped
        under ignore_stale_grad, as torch.optim skips a missing gradient)."""
        return self._distributed or self._is_fresh(p)

    def _on_grad(self, p):
        """Autograd has accumulated p's gradient: send it now when overlapping."""
        if self._armed:
            if p.key in self._pushed:
                raise RuntimeError(
                    f'parameter {p.name} got a second gradient before step(), but its first '
                    'one was already sent (kvps overlaps communication with backward). Call '
                    'step() after every backward(), or create the Trainer with overlap=False '
                    'to accumulate gradients over several backward passes')
            self._push(p, p.tensor.grad)
            self._bucket.flush_when_backward_ends()
        self._fresh.add(p.key)

    def _local_weights(self):
        """{(key, 0): the weight the local optimizer updates}, as _update gives them: what a
        loaded state must fit (dtype, size, fp32 master copy)."""
        whole = self._layout.updated_whole() if self._updater else []
        weights = {(fused.key, 0): kernel_view(fused.weight) for fused in whole}
        done = {p.key for fused in whole for p in fused.members}
        weights.update(((p.key, 0), kernel_view(p.tensor)) for p in self._params
                       if p.key not in done)
        return weights

    def _local_ranges(self):
        """{fused key: its members' ranges} where the local optimizer state is per fused key."""
        return self._layout.ranges(self._layout.updated_whole()) if self._updater else {}

    def _update(self, ignore_stale_grad):
        """Local update with the servers' kernels, in place on views of the tensors: numpy for
        CPU parameters, cupy (through DLPack, no copy) for CUDA ones; a fused key's members
        in one pass over the packed key (one kernel call instead of one per member)."""
        items, whole, done = [], [], set()
        for fused in self._layout.updated_whole():
            trainable = fused.trainable_count()
            if 0 < trainable < len(fused.members):   # partly frozen: per member from now on
                self._split_local_state(fused)
                continue
            done.update(p.key for p in fused.members)
            if trainable:
                if self._reduced == 'grads':   # the sums allreduce_grads left (maybe clipped)
                    fused.arrived = {p.key: p.tensor.grad for p in fused.members}
                    fused.gather_grads(dense)
                items.append((fused.key, 0, kernel_view(fused.gather_weights()),
                              kernel_view(fused.grad, read_only=True)))
                whole.append(fused)
        row_sums, self._row_sums = self._row_sums, {}
        lazy = []
        for p in self._trainable:
            if p.key in done:
                continue
            if p.key in row_sums and self._takes_part(p):
                lazy.append((p, *self._summed_rows(p, *row_sums[p.key])))
                continue
            grad = self._summed.get(p.key) if self._reduced == 'buffers' else p.tensor.grad
            # Distributed: every worker updates every parameter with the same summed gradient,
            # so workers stay identical even when their stale parameters differ.
            if grad is None or not self._takes_part(p):
                continue
            # Flat views: the state then has the servers' layout, so files load either way.
            # The gradient stays as backward (or allreduce_grads) left it, as with torch.optim.
            items.append((p.key, 0, kernel_view(p.tensor),
                          kernel_view(dense(grad), read_only=True)))
        if items:
            self._updater.update_many(items)
        for p, ids, rows in lazy:
            self._update_rows(p, ids, rows)
        for fused in whole:
            fused.scatter_weights()

    def _summed_rows(self, p, ids, rows):
        """``(ids, rows)`` of p's summed gradient: as pulled, or after allreduce_grads as its
        ``.grad`` holds them now (clipped, say; its other rows are zeros)."""
        if self._reduced != 'grads':
            return ids, rows
        grad = arrays.as_numpy(p.tensor.grad.detach())
        return ids, grad.reshape(grad.shape[0] if grad.ndim else 1, -1)[ids]

    def _update_rows(self, p, ids, rows):
        """A summed gradient that came as rows: only those rows update (lazy_update), else
        the dense gradient they stand for."""
        if self._updater.updates_rows:
            self._updater.update_rows(p.key, 0, kernel_view(p.tensor), ids, rows,
                                      rows.shape[1] if rows.ndim == 2 else 1)
            return
        grad = p.tensor.new_zeros(p.tensor.shape)
        put_rows(grad, ids, rows)
        self._updater.update_many([(p.key, 0, kernel_view(p.tensor),
                                    kernel_view(grad, read_only=True))])

    def _split_local_state(self, fused):
        """``fused``'s members are updated one by one from now on, each with its share of
        the state the fused key had."""
        split_local_state(self._updater, self._sizes(), self._local_ranges(), fused.key)
        fused.updated_whole = False

    def _end_step(self):
        if self._kv is not None and self._update_on_kvstore:
            # The servers counted one update per key; mirror it so that learning_rate follows
            # an lr_scheduler (exact in sync mode; this worker's own updates in async mode).
            self._optimizer.num_update += 1
            self._armed = self._overlap
        self._fresh.clear()
        self._pushed.clear()
        self._reduced = False
        self._note_grads()

    def _note_grads(self):
        self._seen_grads = {p.key: p.tensor.grad for p in self._trainable}


def _hook(ref, p):
    """A post-accumulate-grad hook that does not keep the Trainer alive."""
    def on_grad(_tensor):
        trainer = ref()
        if trainer is not None:
            trainer._on_grad(p)
    return on_grad


def _make_optimizer(optimizer, optimizer_params):
    if isinstance(optimizer, opt_mod.Optimizer):
        if optimizer_params:
            raise ValueError('optimizer_params must be None when optimizer is an Optimizer '
                             'instance (set its parameters when creating it)')
        return optimizer
    if isinstance(optimizer, str):
        return opt_mod.create(optimizer, **(optimizer_params or {}))
    raise TypeError('optimizer must be a name (e.g. \'sgd\') or a kvps.optimizer.Optimizer, got '
                    f'{type(optimizer).__name__}')
