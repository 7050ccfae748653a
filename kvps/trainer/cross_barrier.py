"""Cross-barrier steps (BytePS): step() returns once its pulls are under way, and each module's
forward waits only for the weights of its own parameters.

Between a step and the forward that reads a parameter, its pulled weights wait in the
Trainer's buffers (the early pulls'), never half-written in the parameter: until they land
there, a parameter holds the weights of before the step. What lands them: the forward
pre-hook of each module that owns some of the Trainer's parameters (for those parameters),
the next backward's first gradient, the next step, save_states and load_states (for all of
them), and ``Trainer.wait()``, which code that reads parameters otherwise calls first.
"""

import threading

from .fusion import FusedKey


def check_cross_barrier(params, store, mode):
    """Refuse ``cross_barrier=True`` where it cannot work (ValueError): it needs the module
    (to hook its forward), a kvps store (pulls that return before they land) of a
    distributed job, and servers that update (pulls bring weights)."""
    import torch  # lazy: kvps imports without torch
    if not isinstance(params, torch.nn.Module):
        raise ValueError('cross_barrier=True hooks the forward of the modules that own the '
                         'parameters: pass the module itself as params (not its parameters)')
    if not (mode.distributed and mode.on_servers and getattr(store, 'fuses', False)):
        raise ValueError('cross_barrier=True needs a kvps store of a distributed job whose '
                         'servers update the parameters (update_on_kvstore not False): its '
                         'pulls then bring weights, which a forward can wait for one module '
                         'at a time')


class _Once:
    """``fn`` run once, by the first caller; later callers wait until it has run.
    ``keys``: the parameters it lands (a landing's)."""

    def __init__(self, fn, keys=()):
        self._fn, self._lock, self._done = fn, threading.Lock(), False
        self.keys = keys

    def __call__(self):
        with self._lock:
            if not self._done:
                self._fn()   # (raises again at the next call if it raised)
                self._done = True


class Arrivals:
    """The pulls a cross-barrier step left under way: per parameter, the landing that waits
    for its weights and puts them in place (one per store key, a fused key's shared by its
    members)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._landings = {}   # parameter key -> _Once(wait for its key's pull, then settle)

    def expect(self, pulled, settle):
        """Take over ``pulled`` (``[(store key, entry, wait)]``, Exchange.allreduce_later);
        ``settle(key, entry)`` puts a pull's weights into the entry's parameters."""
        waits = {}   # one _Once per wait: a wait may serve several keys
        landings = {}
        for key, entry, wait in pulled:
            wait = waits.setdefault(id(wait), _Once(wait))
            members = entry.members if isinstance(entry, FusedKey) else (entry,)
            landing = _Once(_landing(wait, settle, key, entry), [p.key for p in members])
            landings.update(dict.fromkeys(landing.keys, landing))
        with self._lock:
            self._landings.update(landings)

    def wait_for(self, keys):
        """Land the weights of the parameters ``keys`` (those still under way)."""
        if not self._landings:   # (the common case once every pull has landed)
            return
        with self._lock:
            found = {id(each): each for each in map(self._landings.get, keys) if each}
        for landing in found.values():
            landing()
            # What landed is forgotten, for every parameter it landed (a fused key's members
            # are in many modules): later forwards skip it, and once all have landed, all
            # forwards take the early return above.
            with self._lock:
                for key in landing.keys:
                    if self._landings.get(key) is landing:
                        del self._landings[key]

    def wait_all(self):
        """Land every parameter's weights still under way."""
        if self._landings:
            with self._lock:
                keys = list(self._landings)
            self.wait_for(keys)


def _landing(wait, settle, key, entry):
    def land():
        wait()
        settle(key, entry)
    return land


def hook_modules(module, params, arrivals):
    """A forward pre-hook on each module of ``module`` that owns some of ``params`` (Params),
    waiting for those parameters' weights; returns the hooks' handles."""
    keys_of = {id(p.tensor): p.key for p in params}
    handles = []
    for sub in module.modules():
        keys = [keys_of[id(t)] for t in sub.parameters(recurse=False) if id(t) in keys_of]
        if keys:
            handles.append(sub.register_forward_pre_hook(_pre_forward(arrivals, keys)))
    return handles


def _pre_forward(arrivals, keys):
    def pre_forward(_module, _args):
        arrivals.wait_for(keys)
    return pre_forward
