"""A shard's optimizer: run over many keys at once; its state saved, and loaded all-or-nothing."""

from ..errors import ConfigError, KVPSError


class OptimizerStates:
    """The optimizer a Shard holds (``updater``: an Updater, or None: a push replaces the
    value) and the states staged for ``commit_states``."""

    def __init__(self, updater=None, shape_of=None):
        """``shape_of(key, part)``: the shape of a key held whole (None: a part of it), in
        which an optimizer written in Python sees it."""
        self.updater = updater
        self._shape_of = shape_of
        self._staged = None        # (updater, checked states) awaiting commit_states

    def set_optimizer(self, spec, step=0):
        """Run ``spec`` on every later update. The same kind of optimizer again (new learning
        rate, a resumed job setting it anew) keeps every key's state and update count;
        another kind starts fresh, counting from the workers' push ``step`` now."""
        if self.updater is None or not self.updater.retune(spec):
            self.updater = _updater(spec, self._shape_of)
            self.updater.start_at(step)

    def check_optimizer(self, spec):
        """Whether ``spec`` names an optimizer this server runs, with valid hyper-parameters
        (raises ConfigError otherwise); returns whether it reads each weight whole. Nothing
        changes: a worker asks every server before rank 0 sets it on any."""
        return _updater(spec, self._shape_of).optimizer.whole_tensor

    def update(self, items, step=0):
        """Run the optimizer over ``items`` ((key, part, weight, grad)); returns {index:
        exception} of those it could not update. The updater checks every item before it
        changes anything, so after a failed check each item is tried alone: one bad key does
        not fail the keys sent with it (nor does a Python update that raises)."""
        try:
            failures = {}
            self.updater.update_many(items, step, failures)
            return failures
        except KVPSError as exc:
            if len(items) == 1:
                return {0: exc}
        except Exception as exc:   # a kernel failed part way: which keys changed is unknown
            return dict.fromkeys(range(len(items)), exc)
        failed = {}
        for index, item in enumerate(items):
            try:
                self.updater.update_many([item], step)
            except Exception as exc:
                failed[index] = exc
        return failed

    def update_rows(self, key, part, weight, ids, rows, width):
        """Run the optimizer on rows ``ids`` of ``weight`` only (MXNet's lazy update); returns
        the exception that failed it, or None."""
        try:
            self.updater.update_rows(key, part, weight, ids, rows, width)
        except Exception as exc:   # the pushers get it; the key goes on
            return exc
        return None

    def get_states(self, dump_optimizer, step=None):
        if self.updater is None:
            raise ConfigError('no optimizer is set on the servers: there is no state to save')
        return self.updater.get_states(dump_optimizer, step)

    def set_states(self, states, weights, stage=False, step=None):
        """Install ``states`` (an updater state dict), each checked against its key part's
        weight in ``weights`` ({(key, part): array}), or with ``stage`` only check and hold
        them for commit_states: a job's servers all check theirs before any installs, so a
        load that one of them refuses changes none. Nothing changes before all is checked
        (the optimizer a file brings included). ``step``: the workers' push step now, which
        later steps count from (None: the states' own count from it, a checkpoint's)."""
        updater = self.updater
        if updater is None:
            if 'optimizer' not in states:
                raise ConfigError('set an optimizer before loading optimizer states (or load a '
                                  'file saved with dump_optimizer=True)')
            updater = _updater(states['optimizer'], self._shape_of)
        staged = updater, updater.checked_states(states, weights)
        self._staged = None
        if stage:
            self._staged = staged
        else:
            self._install(*staged, step)

    def commit_states(self, step=0):
        """Install the states held by ``set_states(..., stage=True)``."""
        if self._staged is None:
            raise ConfigError('commit_states: no optimizer states are staged on this server '
                              '(it restarted since, or they were installed already)')
        staged, self._staged = self._staged, None
        self._install(*staged, step)

    def _install(self, updater, checked, step):
        updater.install(checked)
        if step is not None:
            updater.start_at(step)
        self.updater = updater


def _updater(spec, shape_of):
    from ..optimizer.updater import Updater  # the optimizer stack loads only when one is used
    return Updater(spec, shape_of)
