"""The version of tandem, written into every checkpoint and shown by ``tandem --version``."""

__version__ = "0.1.0"
