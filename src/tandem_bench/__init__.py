"""The benchmark harness beside the library (``tandem bench``): race tandem's strategies against
each other and plain-torch baselines; training never imports it.

``run_bench(BenchConfig(...))`` returns a dict; ``format_table`` prints it, ``write_json``
saves it.
"""

from .options import BASELINES, BenchConfig, default_strategies, parse_names
from .report import explain, format_table, run_setup, write_json
from .runner import RESULT_FIELDS
from .suite import run_bench

__all__ = ["default_strategies", "BASELINES", "BenchConfig", "parse_names", "run_bench",
           "format_table", "write_json", "explain", "run_setup", "RESULT_FIELDS"]
