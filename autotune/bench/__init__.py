"""The benchmark harness: workloads, the async OpenAI-API load client, metrics, SLOs."""
from .runner import BenchResult, run_benchmark, run_sweep, save_results, summary_table
from .slo import SLO, parse_slo
from .workloads import Workload, load_workload, shipped_workloads

__all__ = ["SLO", "BenchResult", "Workload", "load_workload", "parse_slo", "run_benchmark", "run_sweep",
           "save_results", "shipped_workloads", "summary_table"]
