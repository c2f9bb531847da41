"""What the GPU suite reports of each test's memory (tests/gpu/conftest.py) and what scripts/gpu_memory_report.py
reads from it, on a stand-in for CUDA's caching allocator: a pytest run of three tests (one that leaves 5 GiB
reserved, one that fails holding 2 GiB, one after it), its JUnit report, the script's tables."""

import os
import subprocess
import sys
import textwrap

from tests.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFTEST = textwrap.dedent("""
    import torch

    GIB = 2 ** 30
    allocator = {"reserved": 0, "peak": 0, "live": 0}  # a caching allocator: freed blocks stay reserved until released


    class Block:  # GPU memory that lives as long as the object
        def __init__(self, gib):
            self.size = gib * GIB
            allocator["live"] += self.size
            allocator["reserved"] += self.size
            allocator["peak"] = max(allocator["peak"], allocator["reserved"])

        def __del__(self):
            allocator["live"] -= self.size


    def _release():
        allocator["reserved"] = allocator["live"]


    def _reset_peak():
        allocator["peak"] = allocator["reserved"]


    torch.cuda.is_available = lambda: True
    torch.cuda.memory_reserved = lambda: allocator["reserved"]
    torch.cuda.max_memory_reserved = lambda: allocator["peak"]
    torch.cuda.reset_peak_memory_stats = _reset_peak
    torch.cuda.empty_cache = _release

    from tests.gpu.conftest import _one_heavy_test_at_a_time, _release_cached_gpu_memory  # noqa: E402,F401
""")

TESTS = textwrap.dedent("""
    from conftest import Block

    KEPT = []  # what a test leaves behind in its worker (a module-level cache, a global registry)


    def test_a_leaks():
        KEPT.append(Block(5))
        scratch = Block(2)  # freed when the test returns


    def test_b_fails():
        trainer = Block(2)  # a failed test's locals live on in its exception (sys.last_*)
        assert False, "boom"


    def test_c_after_the_failure():
        scratch = Block(1)
""")


def test_each_test_reports_its_workers_memory_and_the_script_names_the_leak(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_memory.py").write_text(TESTS)
    report = tmp_path / "gpu.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}", "--rootdir", str(tmp_path), str(tmp_path / "test_memory.py")],
                   cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    rows = {name.split("::")[1]: (before, peak, after, outcome)
            for before, peak, after, outcome, name in load_script("gpu_memory_report").read(str(report))}
    # the failed test's trainer is released with it, not held into the next test by its exception
    assert rows == {"test_a_leaks": (0.0, 7.0, 5.0, "passed"),
                    "test_b_fails": (5.0, 7.0, 5.0, "failed"),
                    "test_c_after_the_failure": (5.0, 6.0, 5.0, "passed")}

    printed = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_memory_report.py"), str(report),
                              "--top", "2"], capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    largest, left = printed.stdout.split("\n\n")
    assert [line.split(" | ")[0] for line in largest.splitlines()[3:]] == ["| test_memory::test_a_leaks",
                                                                           "| test_memory::test_b_fails"]
    assert left.splitlines()[0] == "1 tests left memory reserved:" and "test_a_leaks" in left


def test_a_report_without_memory_figures_is_an_error(tmp_path):
    report = tmp_path / "gpu.xml"
    report.write_text('<testsuites><testsuite><testcase classname="m" name="t"/></testsuite></testsuites>')
    printed = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_memory_report.py"), str(report)],
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 1 and "no test reported its GPU memory" in printed.stderr
