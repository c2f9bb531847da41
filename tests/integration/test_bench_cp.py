"""scripts/bench_cp.py, the two-GPU issue's context-parallel run, as a dry run on the CPU (gloo, the tiny preset):
its equality check compares what it should and a failing rank ends the run instead of hanging it."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args: str) -> list[list[str]]:
    """The rows of the tables the script prints (cells stripped)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_cp.py"), "--device", "cpu", *args],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| tokens")]


def test_the_split_sequence_matches_one_rank_and_every_degree_is_timed():
    rows = _bench("--preset", "tiny", "--check-tokens", "256", "--tokens", "512", "--cp", "1", "2", "--repeats", "1")
    check, one, two = rows
    assert check[:2] == ["256", "2"]
    assert float(check[3]) < 1e-5  # the loss summed over the two ranks against one rank's
    assert float(check[4].split()[0]) < 1e-3  # the worst parameter's gradient (fp32 on the CPU: ~1e-5)
    assert one[:2] == ["512", "1"] and two[:3] == ["512", "2", "gloo"]
    assert two[3] == "256" and float(two[4]) > 0 and float(two[5].replace(",", "")) > 0


def test_a_failing_rank_ends_the_run_with_its_error():
    rows = _bench("--preset", "nosuch", "--check-tokens", "0", "--tokens", "256", "--cp", "2", "--repeats", "1",
                  "--timeout", "120")
    (row,) = rows
    assert row[:2] == ["256", "2"] and "unknown model preset 'nosuch'" in row[4]
