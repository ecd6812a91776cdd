"""Training strategies: one small class each, selected by name through one registry.

Importing this package imports every strategy module so that each registers itself. A strategy
module that is missing (not built yet) or fails to import because an optional layer is absent
is skipped; asking for it then gives the registry's "unknown strategy" error.
"""

from __future__ import annotations

import importlib

from .base import StepOutput, Strategy, create_strategy, register, strategy_names

__all__ = ["Strategy", "StepOutput", "register", "create_strategy", "strategy_names"]

for _name in ("single", "dp", "balanced", "hybrid", "ddp"):
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except ImportError as _exc:
        # Only swallow "this strategy (or a tandem layer it needs) is not there yet";
        # a genuine bug inside an existing module still raises.
        if not (_exc.name or "").startswith("tandem."):
            raise
del _name
