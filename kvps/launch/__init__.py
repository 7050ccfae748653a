"""`python -m kvps.launch`: start a job's scheduler, servers and workers, and watch them."""

from .cli import main

__all__ = ['main']
