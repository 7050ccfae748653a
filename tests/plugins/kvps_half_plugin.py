"""A server plugin whose optimizer only server 1 registers: servers that disagree."""

import os

from kvps_test_optimizers import PyMomentum

from kvps.optimizer import register

if os.environ.get('DMLC_ROLE') == 'server' and os.environ.get('KVPS_RANK') == '1':
    @register
    class PyHalf(PyMomentum):
        name = 'test_py_half'
