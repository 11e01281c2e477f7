"""benchmarks.bucket_split: its five patterns of all-reduces on two hosts (network namespaces joined by a veth pair,
the link shaped by tc; skipped without root), each timed no faster than its bytes at the rate, each host's counters
showing the all-reduce's bytes sent and the link's unused time no longer than the run; and a bad flag refused in one
line."""
import json
import os
import shutil

import pytest

from benchmarks import bucket_split, network


def test_bad_values_are_refused_in_one_line(capsys, tmp_path):
    for flag, value in [("--queues", "256kb"), ("--rate", "unshaped"), ("--rate", "10kbit"), ("--buckets", "1,-2"),
                        ("--repeats", "0")]:
        with pytest.raises(SystemExit) as stop:
            bucket_split.parse_args([flag, value, "--output-dir", str(tmp_path / "out")])
        assert stop.value.code == 2
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and f"argument {flag}" in said[0], said
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_pattern_is_timed_and_counted_on_a_shaped_link(tmp_path):
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("ip", "tc", "taskset")):
        pytest.skip("two hosts need root, iproute2 and taskset")
    buckets_mb, rate_bps = [1.0, 2.0], 100e6
    status = bucket_split.main(["--rate", "100mbit", "--queues", "256kb/100ms", "--buckets", "1,2", "--repeats", "1",
                                "--idle", "0", "--output-dir", str(tmp_path)])
    assert status == 0
    results = json.loads((tmp_path / "bucket_split.json").read_text())
    runs = results["runs"]
    assert [r["pattern"] for r in runs] == list(bucket_split.PATTERNS)
    size = sum(buckets_mb) * network.MB
    for run in runs:
        # a ring of two ranks: each sends the all-reduce's size (half reduce-scatter, half all-gather), and headers
        assert all(size <= sent <= 1.2 * size for sent in run["sent"]), run
        # the link held to the rate: no run faster than its bytes (less tbf's burst of 256 kB, sent at once)
        assert run["seconds"] >= 0.8 * size * 8 / rate_bps, run
        assert all(count >= 0 for name in ("dropped", "retransmitted", "timeouts") for count in run[name]), run
        assert all(0 <= unused <= run["seconds"] + 2 * bucket_split.WINDOW_S for unused in run["unused"]), run
    page = (tmp_path / "bucket_split.md").read_text()
    assert all(f"| tbf 256kb/100ms | {pattern} |" in page for pattern in bucket_split.PATTERNS), page
