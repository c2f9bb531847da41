"""A run's learning curves as a table, read from its MLflow store: `agentrl report RUN_DIR --table` (kept under this
name because docs/benchmarks.md's commands use it).

    .venv/bin/python scripts/run_report.py runs/quickstart [--every 5] [--keys eval/success_rate ...]
"""

import sys

from agentrl.cli import main

if __name__ == "__main__":
    main(["report", "--table", *sys.argv[1:]])
