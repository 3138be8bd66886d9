"""chatapp: a terminal chat application with its own local inference engine."""

__version__ = "0.1.0"
