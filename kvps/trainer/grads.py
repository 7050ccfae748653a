"""Which of the Trainer's gradients are new since the last step; where sums land in ``.grad``."""

import operator

from ..errors import StaleGradientError

# Read over every parameter by map() in C, once a step each (hundreds of small parameters)
_KEY = operator.attrgetter('key')
GRAD = operator.attrgetter('tensor.grad')


class GradientLog:
    """Fresh gradients: those backward accumulated since the last step (its hooks say so),
    and those assigned by hand (``.grad`` is another tensor than at the last step)."""

    def __init__(self, distributed):
        """``distributed``: every parameter takes part in every step, fresh or not."""
        self._distributed = distributed
        self._fresh = set()    # keys whose gradient backward accumulated this step
        self._seen = {}        # key -> its .grad tensor when the last step ended

    def arrived(self, p):
        """Autograd has accumulated ``p``'s gradient."""
        self._fresh.add(p.key)

    def is_fresh(self, p):
        grad = p.tensor.grad
        # A gradient assigned by hand (p.grad = ...) counts as fresh, as one from backward does.
        return p.key in self._fresh or (grad is not None and grad is not self._seen.get(p.key))

    def takes_part(self, p):
        """Whether ``p`` is reduced and updated this step: in distributed mode every
        parameter is (workers stay identical); alone, only fresh ones (a stale one is skipped
        under ignore_stale_grad, as torch.optim skips a missing gradient)."""
        return self._distributed or self.is_fresh(p)

    def taking_part(self, trainable):
        """Those of ``trainable`` that take part this step (takes_part)."""
        if self._distributed:
            return list(trainable)
        return [p for p in trainable if self.is_fresh(p)]

    def check(self, trainable, ignore_stale_grad):
        """Raise StaleGradientError for trainable parameters without a fresh gradient."""
        if ignore_stale_grad or self._fresh.issuperset(map(_KEY, trainable)):
            return   # (the common case: backward accumulated every one)
        stale = [p.name for p in trainable if not self.is_fresh(p)]
        if stale:
            raise StaleGradientError(
                f'the gradient of {", ".join(stale[:5])}{" ..." if len(stale) > 5 else ""} was '
                'not updated by backward since the last step. If you intentionally use only '
                'some parameters, call step(..., ignore_stale_grad=True)')

    def dense_grad(self, p):
        """``p``'s ``.grad`` as a dense tensor that summed gradients can land in (a new one,
        zeros, where it has none or a sparse one: not a gradient of the user's)."""
        grad = p.tensor.grad
        if grad is None or not is_dense(grad):
            p.tensor.grad = p.tensor.new_zeros(p.tensor.shape)
            self._seen[p.key] = p.tensor.grad
        return p.tensor.grad

    def next_step(self, trainable):
        """A step is over: what is fresh from now on is measured against ``.grad`` now."""
        self._fresh.clear()
        self._seen = dict(zip(map(_KEY, trainable), map(GRAD, trainable)))


def is_dense(grad):
    import torch  # lazy: kvps imports without torch (it is loaded once a Trainer exists)
    return grad.layout == torch.strided


def dense(grad):
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the dense tensor it stands for:
    store keys and kernels are dense, so it trains as ``sparse=False`` would."""
    return grad if is_dense(grad) else grad.to_dense()


def on_grad(ref, p):
    """A post-accumulate-grad hook telling the Trainer ``ref()`` (a weak reference: the hook
    does not keep it alive) that p's gradient is in."""
    def hook(_tensor):
        trainer = ref()
        if trainer is not None:
            trainer._on_grad(p)
    return hook
