"""What each GPU test reserved, from the JUnit report of a tests/gpu run (tests/gpu/conftest.py writes the figures).

    python3 -m pytest tests/gpu -n 4 --junitxml=$OUT/gpu.xml
    python3 scripts/gpu_memory_report.py $OUT/gpu.xml [--top 16]

Prints the tests with the largest peaks (GiB their worker had reserved before the test, at its peak, and after the
test's release), and then every test that left memory reserved in its worker: those are why a light test can run
out of memory beside a heavy one.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET

KEYS = ("gpu_reserved_before_gib", "gpu_peak_reserved_gib", "gpu_reserved_after_gib")
LEFT_GIB = 0.2  # less is the allocator's rounding, not a test's tensors


def read(path: str) -> list[tuple[float, float, float, str, str]]:
    """(before, peak, after, outcome, test) for each test that reported its memory."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if not all(k in props for k in KEYS):
            continue
        outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                   else "skipped" if case.find("skipped") is not None else "passed")
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        rows.append((*(float(props[k]) for k in KEYS), outcome, name))
    return rows


def table(rows, title: str) -> str:
    lines = [title, "| test | outcome | before | peak | after |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {outcome} | {before:.2f} | {peak:.2f} | {after:.2f} |"
              for before, peak, after, outcome, name in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="the --junitxml file of a tests/gpu run")
    parser.add_argument("--top", type=int, default=16, help="how many of the largest peaks to list")
    args = parser.parse_args(argv)
    rows = read(args.junit)
    if not rows:
        print(f"{args.junit}: no test reported its GPU memory (a run without CUDA, or before tests/gpu/conftest.py "
              "wrote it)", file=sys.stderr)
        return 1
    print(table(sorted(rows, key=lambda r: -r[1])[:args.top], f"GiB reserved in the test's worker, {len(rows)} tests, "
                                                                 f"the {min(args.top, len(rows))} largest peaks:"))
    left = [r for r in rows if r[2] > r[0] + LEFT_GIB]
    print()
    print(table(sorted(left, key=lambda r: r[0] - r[2]), f"{len(left)} tests left memory reserved:") if left
          else "no test left memory reserved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
