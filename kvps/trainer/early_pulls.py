"""The Trainer's early pulls: each pushed key's pull sent right behind its push.

With servers on hosts of their own, a worker's link is idle one way while it pushes and the
other way while it pulls, unless results come back while later gradients still leave: a
server answers a key's pull as soon as its round is complete. So when backward pushes a
bucket, its pull requests follow at once, and step() only waits for what is still in flight.

Results land in buffers of the Trainer's own (fused keys' packed buffers, the buffers of
summed gradients, or, when the servers update, a copy of a parameter's weights), never in a
parameter before step(): autograd may still read a weight after its gradient is in (a
detached use of it), and code between backward and step must see the weights of before.
"""

import threading

from .fusion import FusedKey, priority_of


class EarlyPulls:
    """Pulls started by ``start`` (from autograd's threads), waited for by ``finish``."""

    def __init__(self, kv, weights, gradient_buffer):
        """``kv``: a kvps KVStore (its pull_begin); ``weights``: the servers update (pulls
        bring weights, else summed gradients); ``gradient_buffer(param)``: where a
        parameter's summed gradient is pulled."""
        self._begin = kv.pull_begin
        self._weights, self._gradient_buffer = weights, gradient_buffer
        self._staged = {}        # key -> a parameter's pulled weights until step()
        self._waits = {}         # key -> the wait of the pull that carries it
        self._lock = threading.Lock()

    def start(self, keys, entries):
        """Pull ``keys`` (just pushed; ``entries``: their parameters or fused keys), the
        first layers first."""
        with self._lock:   # buffers are made on first use, maybe on two threads at once
            targets = [self._target(entry) for entry in entries]
        wait = self._begin(list(keys), targets, priority_of(entries))
        with self._lock:
            self._waits.update(dict.fromkeys(keys, wait))

    def _target(self, entry):
        if isinstance(entry, FusedKey):
            return entry.weight if self._weights else entry.grad
        if not self._weights:
            return self._gradient_buffer(entry)
        staged = self._staged.get(entry.key)
        if staged is None:
            staged = self._staged[entry.key] = entry.tensor.detach().new_empty(
                entry.tensor.shape)
        return staged

    def started(self):
        """The keys whose pulls are under way (``finish`` waits for them)."""
        with self._lock:
            return set(self._waits)

    def finish(self):
        """Wait for every pull started; the keys they brought (each into ``staged`` or the
        buffer ``start`` chose)."""
        waits = self.take()
        for wait in {id(w): w for w in waits.values()}.values():
            wait()
        return set(waits)

    def take(self):
        """{key: the wait of its pull} of every pull started, handed over unwaited (a wait
        may serve several keys); a cross-barrier step leaves them to the next forward."""
        with self._lock:
            waits, self._waits = self._waits, {}
        return waits

    def staged(self, key):
        """The weights an early pull brought for parameter ``key`` (servers update)."""
        return self._staged[key]


class NoEarlyPulls:
    """A store that cannot pull early (one of the user's own): every key is pulled at step."""

    def start(self, keys, entries):
        pass

    def started(self):
        return set()

    def finish(self):
        return set()


NO_EARLY_PULLS = NoEarlyPulls()
