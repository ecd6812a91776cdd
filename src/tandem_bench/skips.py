"""Why a tandem strategy cannot race: not registered, refused by the model, or unable to
compile. The reasons speak the command line (``--compile``), as the bench's report does."""

from __future__ import annotations

from torch import nn

from tandem.config import flagged
from tandem.errors import UsageError
from tandem.strategies import strategy_class, strategy_names
from tandem.strategies.compile import check_compile


def registered_strategies() -> list[str]:
    """Names in tandem's strategy registry (importing ``tandem.strategies`` registered them)."""
    return strategy_names()


def strategy_skip_reason(name: str, model: nn.Module, arch: str, compiled: bool = False,
                         device_type: str = "cpu") -> str | None:
    """Why tandem strategy ``name`` (compiled if ``compiled``) cannot run with ``model``."""
    if name not in registered_strategies():
        return f"strategy {name!r} is not available (not registered in tandem.strategies)"
    problem = None if model is None else strategy_class(name).check_model(model)
    if problem:
        return f"{arch}: {name} {problem}"
    if compiled:
        try:
            check_compile(strategy_class(name), device_type)
        except UsageError as exc:
            return flagged(exc)  # the bench's report speaks the command line
    return None
