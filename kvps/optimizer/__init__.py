"""Optimizers and lr schedulers as plain data (MXNet's names), and what runs them: the updater and its fused kernels."""

from .lr_scheduler import (CosineScheduler, FactorScheduler, LRScheduler, MultiFactorScheduler,
                           PolyScheduler, create_scheduler)
from .more_optimizers import (DCASGD, FTML, LANS, LARS, LBSGD, SGLD, AdaBelief, AdaDelta, Adamax,
                              GroupAdaGrad, Nadam, ccSGD)
from .optimizers import (LAMB, NAG, SGD, AdaGrad, Adam, AdamW, Ftrl, Optimizer, RMSProp, Signum,
                         Test, create, register, registered)

__all__ = ['Optimizer', 'SGD', 'NAG', 'Adam', 'AdamW', 'AdaGrad', 'RMSProp', 'LAMB', 'Ftrl',
           'Signum', 'Test', 'AdaDelta', 'Adamax', 'Nadam', 'FTML', 'LARS', 'LBSGD', 'SGLD',
           'DCASGD', 'ccSGD', 'GroupAdaGrad', 'AdaBelief', 'LANS', 'create', 'register',
           'registered', 'LRScheduler', 'FactorScheduler', 'MultiFactorScheduler',
           'CosineScheduler', 'PolyScheduler', 'create_scheduler']
