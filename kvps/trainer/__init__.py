"""Gluon's Trainer for torch parameters, over a KVStore."""

from .trainer import Trainer

__all__ = ['Trainer']
