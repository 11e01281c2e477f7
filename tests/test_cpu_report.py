"""--cpu-report (tests/conftest.py): what each test costs in CPU seconds, its launches included, and per file."""
import json
import subprocess
import sys

from script_runs import ROOT, subprocess_env

TEST = "tests/test_data.py::test_synthetic_set_is_a_prefix_and_differs_between_train_and_test"


def test_the_cpu_report_holds_this_runs_tests_and_sums_them_per_file(tmp_path):
    report = tmp_path / "cpu.jsonl"
    report.write_text('{"test": "tests/test_old.py::left_from_a_run_before", "cpu_s": 99.0}\n')
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", TEST,
                          "--cpu-report", str(report)], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert [row["test"] for row in rows] == [TEST] and 0 < rows[0]["cpu_s"] < 60, rows
    summary = ran.stdout[ran.stdout.index("CPU seconds per test file"):]
    assert f"{rows[0]['cpu_s']:8.1f}  tests/test_data.py" in summary and "test_old" not in summary, summary
