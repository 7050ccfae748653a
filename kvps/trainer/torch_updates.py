"""A torch.optim optimizer under the Trainer: the workers update with it, on the summed
gradients that the store leaves in each ``.grad`` (kvps as DDP is used, for any optimizer)."""

import sys

from ..errors import ConfigError
from ..optimizer import optimizers as opt_mod


def is_torch_optimizer(optimizer):
    """Whether ``optimizer`` is a torch.optim optimizer (torch imported only if it is loaded)."""
    torch = sys.modules.get('torch')
    return torch is not None and isinstance(optimizer, torch.optim.Optimizer)


def workers_update(optimizer, update_on_kvstore):
    """update_on_kvstore as given, or for a TorchOptimizer False (the servers run kvps's
    optimizers only: no code travels to them; True is refused)."""
    if not isinstance(optimizer, TorchOptimizer):
        return update_on_kvstore
    if update_on_kvstore:
        raise ValueError('update_on_kvstore=True with a torch.optim optimizer: the servers run '
                         'kvps optimizers only (no code travels to them); leave it None or '
                         'False, and the workers update with yours on the summed gradients')
    return False


class TorchOptimizer(opt_mod.Optimizer):
    """The kvps side of a torch optimizer, what the Trainer asks of its optimizer:
    ``rescale_grad`` (the Trainer's 1/batch_size), and the learning rate, read from its
    first parameter group and set into every group (as torch's schedulers see it)."""

    name = 'torch'

    def __init__(self, torch_optimizer):
        super().__init__(learning_rate=float(torch_optimizer.param_groups[0]['lr']))
        self.torch = torch_optimizer

    @property
    def learning_rate(self):
        return self.torch.param_groups[0]['lr']

    def set_learning_rate(self, lr):
        for group in self.torch.param_groups:
            group['lr'] = lr

    def to_spec(self):
        raise ConfigError('a torch.optim optimizer runs on the workers only')


class TorchUpdates:
    """The Trainer's local updates through a torch optimizer: each ``.grad`` times
    ``rescale_grad`` (the sums every worker got, in a job), then its ``step()``. Its state
    saves and loads with ``torch.save``; it cannot be handed to an elastic job's joiner."""

    reads_grads = True   # the Trainer's step leaves the sums in .grad for it (into_grads)
    hands_over = False

    def __init__(self, optimizer, params):
        """Refuse (ValueError) a torch optimizer over tensors the Trainer does not reduce:
        each worker would step them on its own gradient, and the workers would drift apart."""
        known = {id(p.tensor) for p in params}
        stray = [t for group in optimizer.torch.param_groups for t in group['params']
                 if id(t) not in known]
        if stray:
            raise ValueError(f'the torch optimizer holds {len(stray)} tensor(s) that are not '
                             f'among the Trainer\'s parameters (the first: shape '
                             f'{tuple(stray[0].shape)}), which no worker would sum; give the '
                             'Trainer and the optimizer the same parameters')
        self.optimizer = optimizer

    def run(self, trainable, takes_part, reduced, summed, row_sums):
        """LocalUpdates.run: here each ``.grad`` holds what to apply (in a job, the sums). A
        parameter that does not take part (alone, a stale one with ignore_stale_grad) is hidden
        from the optimizer for the step, its ``.grad`` put back after."""
        import torch
        stale = [(p.tensor, p.tensor.grad) for p in trainable
                 if p.tensor.grad is not None and not takes_part(p)]
        for tensor, _ in stale:
            tensor.grad = None
        grads = [p.tensor.grad for p in trainable if p.tensor.grad is not None]
        rescale = self.optimizer.rescale_grad
        if rescale != 1.0:
            dense = [g for g in grads if g.layout == torch.strided]
            torch._foreach_mul_(dense, rescale)
            for g in grads:
                if g.layout != torch.strided:
                    g.mul_(rescale)
        try:
            self.optimizer.torch.step()
        finally:
            for tensor, grad in stale:
                tensor.grad = grad

    def save(self, fname):
        import torch
        torch.save(self.optimizer.torch.state_dict(), fname)

    def load(self, fname):
        import torch
        self.optimizer.torch.load_state_dict(torch.load(fname))
