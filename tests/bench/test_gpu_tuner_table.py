"""bench_gpu_tuner.py table: issue 30's tuner-vs-best rows come from a command, not from a hand-made file."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "h100-2026-12-06b"  # the H100's tune + confirm files (551321c)


def test_the_table_rebuilds_the_committed_rows_from_the_tune_and_confirm_files(tmp_path):
    """Best known is the better relaunched median (embedded: the export beat the sweep by 1.335x, so its ratio is
    1.0), the budget is read off the tuner's argv, and a row per engine that has both files."""
    for name in ("tuner-c8.json", "tuner-llamacpp-c8.json", "confirm.json", "confirm-llamacpp.json"):
        shutil.copy(RESULTS / name, tmp_path / name)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu_tuner.py"), "table", "--out", str(tmp_path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "tuner-vs-best.json").read_text())["rows"]
    assert rows == json.loads((RESULTS / "tuner-vs-best.json").read_text())["rows"]
    embedded, llamacpp = rows
    assert embedded["best_known_tok_s"] == embedded["tuner_relaunched_tok_s"] and embedded["ratio_tuner_over_sweep_best"] > 1.3
    assert llamacpp["best_known_tok_s"] == llamacpp["sweep_best_relaunched_tok_s"] and llamacpp["budget_s"] == 600
