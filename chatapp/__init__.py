"""chatapp: a terminal chat application with its own local inference engine."""

import os as _os

# OpenMP threads that spin while waiting collapse when anything else wants the
# CPU (a TUI, a second engine client, a browser): on 2 cores a decode step got
# 3-7x slower. Passive waiting costs little here; it must be set before torch
# loads its OpenMP runtime, hence this package's very first import. A user's
# own setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
