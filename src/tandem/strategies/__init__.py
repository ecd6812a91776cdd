"""Training strategies: one small class each, selected by name through one registry.

Code outside this package asks a strategy's declared abilities, never its name.
"""

from __future__ import annotations

from .base import StepOutput, Strategy, create_strategy, register, strategy_class, strategy_names

# Imported for their @register side effect, in the order the CLI documents them.
from . import single, dp, balanced, hybrid, ddp, hybrid_ddp  # noqa: E402,F401  isort: skip

__all__ = ["Strategy", "StepOutput", "register", "create_strategy", "strategy_class",
           "strategy_names"]
