"""Training strategies: one small class each, selected by name through one registry.

Importing this package imports every strategy module, and each registers itself with
:func:`register`; :func:`create_strategy` then builds one by name (an unknown name is a
``ValueError`` listing the registered ones). The training loop uses only the
:class:`Strategy` interface.
"""

from __future__ import annotations

from .base import StepOutput, Strategy, create_strategy, register, strategy_names

# Imported for their @register side effect, in the order the CLI documents them.
from . import single, dp, balanced, hybrid, ddp  # noqa: E402,F401  isort: skip

__all__ = ["Strategy", "StepOutput", "register", "create_strategy", "strategy_names"]
