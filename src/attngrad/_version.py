"""The package's version, in one place: the package init and the command line read it."""

__version__ = "0.1.0"
