"""Optimizers of a user's own, written as MXNet's users write them: the tests' server plugin
(KVPS_SERVER_PLUGINS=kvps_test_optimizers, with this folder on PYTHONPATH)."""

import numpy as np

from kvps.errors import ConfigError
from kvps.optimizer import Optimizer, register


def preprocess(opt, index, weight, grad):
    """MXNet's preamble: rescale, clip, weight decay (a new array: grad is left alone)."""
    grad = grad * opt.rescale_grad
    if opt.clip_gradient is not None:
        grad = np.clip(grad, -opt.clip_gradient, opt.clip_gradient)
    return grad + opt._get_wd(index) * weight


@register
class PyMomentum(Optimizer):
    """SGD with momentum: state None without momentum, else one array."""
    name = 'test_py_momentum'
    hyper = {'momentum': ('float', 0.0)}

    def _validate(self):
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f'test_py_momentum: momentum must be in [0, 1), got '
                              f'{self.momentum}')

    def create_state(self, index, weight):
        return np.zeros_like(weight) if self.momentum else None

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        grad = preprocess(self, index, weight, grad)
        if state is None:
            weight -= lr * grad
        else:
            state *= self.momentum
            state -= lr * grad
            weight += state


@register
class PyAdam(Optimizer):
    """Adam with MXNet's bias correction from the key's own count: a tuple of two arrays."""
    name = 'test_py_adam'
    default_lr = 0.001
    hyper = {'beta1': ('float', 0.9), 'beta2': ('float', 0.999), 'epsilon': ('float', 1e-8)}
    aliases = {'eps': 'epsilon'}

    def create_state(self, index, weight):
        return np.zeros_like(weight), np.zeros_like(weight)

    def update(self, index, weight, grad, state):
        self._update_count(index)
        t = self._index_update_count[index]
        lr = self._get_lr(index) * (1 - self.beta2 ** t) ** 0.5 / (1 - self.beta1 ** t)
        grad = preprocess(self, index, weight, grad)
        mean, var = state
        mean *= self.beta1
        mean += (1 - self.beta1) * grad
        var *= self.beta2
        var += (1 - self.beta2) * grad * grad
        weight -= lr * mean / (np.sqrt(var) + self.epsilon)


@register
class PyDCASGD(Optimizer):
    """MXNet's DCASGD: state (momentum or None, the previous weight), a shape-aware touch
    (rows scaled by their own norm's share) so that a flat view would give other values."""
    name = 'test_py_dcasgd'
    hyper = {'momentum': ('float', 0.0), 'lamda': ('float', 0.04)}

    def create_state(self, index, weight):
        return [None if not self.momentum else np.zeros_like(weight), weight.copy()]

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr = self._get_lr(index)
        grad = preprocess(self, index, weight, grad)
        mom, previous = state
        step = -lr * (grad + self.lamda * grad * grad * (weight - previous))
        if weight.ndim == 2:
            step /= 1 + np.abs(weight).sum(axis=1, keepdims=True)
        if mom is not None:
            mom *= self.momentum
            mom += step
            step = mom
        previous[:] = weight
        weight += step


@register
class Picky(PyMomentum):
    """Refuses negative gradients: an update of the user's that raises."""
    name = 'test_py_picky'

    def update(self, index, weight, grad, state):
        if (grad < 0).any():
            raise ValueError(f'key {index}: a negative gradient')
        super().update(index, weight, grad, state)
