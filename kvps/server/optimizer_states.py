"""A shard's optimizer and its state: set, saved, and loaded all-or-nothing across servers."""

from ..errors import ConfigError


class OptimizerStates:
    """The optimizer part of a Shard (``self.updater``, ``self.entries``, ``self._staged``)."""

    def set_optimizer(self, spec):
        """Run ``spec`` on every later update. The same kind of optimizer again (new learning
        rate, a resumed job setting it anew) keeps every key's state and update count;
        another kind starts fresh."""
        from ..optimizer.updater import Updater  # the optimizer stack loads only when one is used
        if self.updater is None or not self.updater.retune(spec):
            self.updater = Updater(spec)

    def get_states(self, dump_optimizer):
        if self.updater is None:
            raise ConfigError('no optimizer is set on the servers: there is no state to save')
        return self.updater.get_states(dump_optimizer)

    def set_states(self, states, stage=False):
        """Install ``states`` (an updater state dict), or with ``stage`` only check and hold
        them for commit_states: a job's servers all check theirs before any installs, so a
        load that one of them refuses changes none. Nothing changes before all is checked
        (the optimizer a file brings included, and each state against its key's weight)."""
        updater = self.updater
        if updater is None:
            if 'optimizer' not in states:
                raise ConfigError('set an optimizer before loading optimizer states (or load a '
                                  'file saved with dump_optimizer=True)')
            from ..optimizer.updater import \
                Updater  # the optimizer stack loads only when one is used
            updater = Updater(states['optimizer'])
        weights = {where: entry.weight for where, entry in self.entries.items()}
        staged = updater, updater.checked_states(states, weights)
        self._staged = None
        if stage:
            self._staged = staged
        else:
            self._install(*staged)

    def commit_states(self):
        """Install the states held by ``set_states(..., stage=True)``."""
        if self._staged is None:
            raise ConfigError('commit_states: no optimizer states are staged on this server '
                              '(it restarted since, or they were installed already)')
        staged, self._staged = self._staged, None
        self._install(*staged)

    def _install(self, updater, checked):
        updater.install(checked)
        self.updater = updater

