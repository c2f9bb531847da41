"""Runs the test suite in isolated pytest processes and prints one closing line for all of them.

    python scripts/run_tests.py            # tests/unit + tests/gpu in one process, each integration file in its own

Why separate processes: integration modules each start real vLLM engines (in-process `LLM` and `AsyncLLM` with an
engine-core subprocess), Ray and DeepSpeed. Sharing one interpreter across them hung the suite: a vLLM engine's ZMQ
context left by an earlier module was garbage-collected inside a later module's model loading and blocked forever in
`zmq.Context.term`. One process per integration file keeps each module's engines to itself (a module's tests still
share their engine through module-scoped fixtures).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(paths: list[str]) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "--durations=5", f"--junitxml={report}", *paths]
        print(f"\n=== {' '.join(paths)}", flush=True)
        start = time.time()
        code = subprocess.call(cmd, cwd=ROOT)
        # One line per group, so a CI log shows where the suite's time goes when it grows.
        print(f"=== {' '.join(paths)}: {time.time() - start:.0f}s", flush=True)
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if os.path.exists(report):
            for suite in ET.parse(report).getroot().iter("testsuite"):
                for key in counts:
                    counts[key] += int(suite.get(key, 0))
        if code not in (0, 5) and not (counts["failures"] or counts["errors"]):
            counts["errors"] += 1  # pytest itself failed (collection error, crash, interrupt)
        return counts


def main() -> int:
    start = time.time()
    groups = [["tests/unit", "tests/gpu"]] + [[f] for f in sorted(glob.glob(os.path.join("tests", "integration",
                                                                                            "test_*.py")))]
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for paths in groups:
        for key, value in run(paths).items():
            total[key] += value
    failed = total["failures"] + total["errors"]
    passed = total["tests"] - failed - total["skipped"]
    print(f"\n(all groups, {time.time() - start:.0f}s)")
    print(f"{passed} passed, {failed} failed, {total['skipped']} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
