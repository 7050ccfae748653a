"""kvps: a parameter server for data-parallel training with the MXNet KVStore API."""

__version__ = '0.1.0'
