"""python -m benchmarks.network: its input refused in one line, its tables made from its results (a row faster or
slower than DDP only beyond the stated margin), docs/network.md and the results folder's network.md the tables of the
committed network.json, and (slow, as root) a small run of DDP on two hosts whose interface counters are within 10% of
its collectives, stopped or not, leaving no network namespace of its own (so no link or qdisc of it) and no process."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from processes import interrupted, processes_naming
from script_runs import ROOT, run_main, subprocess_env

from benchmarks import harness, network
from utils.errors import UsageError

# one row, per-rank batch 8, 2 timed steps a rate, no learning runs: the path of every row at a fraction of the time
SMALL = ["--only", "DDP", "--batch-size", "8", "--steps", "2", "--learning-steps", "0"]


def test_without_root_it_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    out = tmp_path / "out"
    result = run_main(network.main, ["--quick", "--output-dir", str(out)], capsys)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "need root" in result.stderr, result.stderr
    assert not out.exists()


@pytest.mark.parametrize("argv, said", [(["--rates", "fast"], "is not a rate"),
                                        (["--rates", "100mbit,100Mbit"], "names a rate twice"),
                                        (["--only", "Horovod"], "matches no row"),
                                        (["--batch-size", "6"], "divisible by 4")])
def test_bad_input_is_one_line_and_writes_nothing(argv, said, tmp_path, capsys):
    out = tmp_path / "out"
    result = run_main(network.main, [*argv, "--output-dir", str(out)], capsys)
    assert result.returncode == 2 and said in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_rates_go_fastest_first_and_only_names_rows():
    assert [r["label"] for r in network.parse_rates("30mbit,unshaped,1gbit")] == ["unshaped", "1 Gbit/s",
                                                                                 "30 Mbit/s"]
    assert [r.name for r in harness.rows_named(network.rows(), ["DDP"])] == ["DDP"]  # a whole name: that row alone
    assert [r.name for r in harness.rows_named(network.rows(), ["fp16,powersgd"])] == ["DDP + fp16 compression",
                                                                                        "DDP + PowerSGD (rank 2)"]


def test_the_learning_rows_give_diloco_a_second_seed_and_the_overlap_no_outer_momentum():
    names = {r.name: r.flags for r in network.learning_rows(network.rows())}
    assert names["DiLoCo (H=16), another seed"] == ["--sync-every", "16", "--seed", "1"]
    assert names["DiLoCo (H=16), round overlapped, no outer momentum"] == ["--sync-every", "16", "--overlap-round",
                                                                            "--outer-momentum", "0"]
    quick = [r.name for r in network.learning_rows(network.rows(), quick=True)]
    assert "DDP, another seed" in quick and not any(name.endswith(("seed", "momentum")) for name in quick[2:])


def test_timed_steps_are_the_second_epochs_after_its_first_and_after_the_recorded_ones():
    # (arrival, epoch, step, bytes each host had sent): 3 steps an epoch; step 2 of epoch 2 is global step 5
    lines = [(t, e, s, [100 * t, 200 * t]) for t, (e, s) in enumerate([(1, 1), (1, 2), (1, 3), (2, 1), (2, 2),
                                                                       (2, 3), (3, 1), (3, 2), (3, 3)])]
    assert network.timed(lines, 3) == {"step_s": 1, "steps_timed": 4, "sent_mb": [100 / 2**20, 200 / 2**20]}
    assert network.timed(lines, 3, after_step=5)["steps_timed"] == 3  # 5 -> 6, then epoch 3's two
    assert network.timed(lines[:4], 3) is None


def test_a_diloco_row_is_timed_over_its_second_round_whole():
    # H = 2: one epoch of 5 steps; rank 0's line after step 2 (the first round's end) to its line after step 4 (the
    # second's, which took 3 s more: its all-reduce), over 2 steps
    lines = [(t, 1, s, [10 * t, 20 * t]) for t, s in [(0, 1), (1, 2), (2, 3), (6, 4), (7, 5)]]
    assert network.timed_round(lines, 2) == {"step_s": 2.5, "steps_timed": 2, "sent_mb": [25 / 2**20, 50 / 2**20]}
    assert network.timed_round(lines[:3], 2) is None  # stopped before the second round's end


def test_each_row_is_held_to_the_floor_of_what_can_hide_its_bytes():
    """With compute alone's phases (1 s a step, 0.5 of it the backward): DDP hides its bytes behind the backward alone,
    one bucket and DiLoCo's round behind nothing, FSDP and the overlapped round behind the whole step; results without
    the phases keep the link's limit."""
    results = fake_results()
    results["meta"]["compute_alone"].update(forward_s=0.3, backward_s=0.5, optimizer_s=0.2)
    rate = {"label": "100 Mbit/s", "bps": 100e6}
    wire = 7.5 * 2**20 * 8 / 100e6  # 0.63 s

    def floor(name):
        return network.floor_s(results, {"row": name, "sent_mb": [7.5, 7.0]}, rate)
    assert floor("DDP") == pytest.approx(0.5 + wire) and floor("ZeRO-1") == floor("DDP")
    assert floor("DDP, one bucket after the backward") == floor("DiLoCo (H=16)") == pytest.approx(1 + wire)
    assert floor("FSDP") == floor("DiLoCo (H=16), round overlapped") == pytest.approx(1.0)  # the link's limit
    assert network.floor_s(results, {"row": "DDP", "sent_mb": [100.0, 1.0]}, rate) == pytest.approx(100 * 2**20 * 8
                                                                                                    / 100e6 + 0.5)
    del results["meta"]["compute_alone"]["backward_s"]
    assert floor("DDP") == floor("DDP, one bucket after the backward") == pytest.approx(1.0)


def test_the_diloco_goals_and_the_floors_kind_are_on_the_page():
    results = fake_results()
    results["meta"]["compute_alone"].update(forward_s=0.3, backward_s=0.5, optimizer_s=0.2)
    results["meta"]["rows"] += ["DiLoCo (H=16)", "DiLoCo (H=16), round overlapped"]
    results["runs"] += [{"row": "DiLoCo (H=16)", "rate": "100 Mbit/s", "step_s": 1.6, "steps_timed": 16,
                         "sent_mb": [2.7, 2.7]},
                        {"row": "DiLoCo (H=16), round overlapped", "rate": "100 Mbit/s", "step_s": 1.1,
                         "steps_timed": 16, "sent_mb": [2.7, 2.7]}]
    text = network.markdown(results)
    assert "- At 100 Mbit/s, DiLoCo (H=16) 1.60x compute alone (goal 1.7x: met), 2.25x faster than DDP (goal 5x: " \
           "not met)." in text
    assert "- At 100 Mbit/s, its round overlapped 1.10x compute alone (goal 1.2x: met)." in text
    assert "| floor counts |" in text and "| DiLoCo (H=16) | `distributed_diloco.py --sync-every 16` | 1.60 |" in text
    assert "| 1.00 | none | 1.23 | 1.30 | 1.00 | 1.60 |" in text  # floor 1 + 2.7 MB / 100 Mbit/s, then the link's limit


def test_each_rate_names_the_fastest_row_that_learns_as_ddp_and_the_fastest_whatever_it_learns():
    """DDP's seeds end at test loss 0.10 and 0.12, so a row learns as DDP does up to 0.14. fp16 compression is faster
    than DDP at 300 and 100 Mbit/s and learns within; the overlapped round is faster still at 100 Mbit/s but learns
    far worse, until a run of it with no outer momentum (which takes its time) learns within; fp16 at 0.15 does not."""
    results = fake_results()
    results["runs"].append({"row": "DiLoCo (H=16), round overlapped", "rate": "100 Mbit/s", "step_s": 1.2,
                            "steps_timed": 16, "sent_mb": [2.7, 2.7]})
    results["learning"] = [{"name": name, "flags": [], "steps": 128, "train_loss": 0.1, "test_loss": loss, "top1": 99.0}
                           for name, loss in [("DDP", 0.10), ("DDP, another seed", 0.12),
                                              ("DDP + fp16 compression", 0.13),
                                              ("DiLoCo (H=16), round overlapped", 3.9)]]
    text = network.markdown(results)
    assert "| unshaped | DDP | 1.00 | DDP | 1.00 |" in text
    assert "| 300 Mbit/s | DDP + fp16 compression | 1.05 | DDP + fp16 compression | 1.05 |" in text
    assert "| 100 Mbit/s | DDP + fp16 compression | 1.90 | DiLoCo (H=16), round overlapped | 1.20 |" in text
    assert "of at most 0.1400 (the worse of DDP's two seeds plus their difference)" in text
    results["learning"].append({"name": "DiLoCo (H=16), round overlapped, no outer momentum", "flags": [], "steps": 128,
                                "train_loss": 0.1, "test_loss": 0.05, "top1": 100.0})
    assert "| 100 Mbit/s | DiLoCo (H=16), round overlapped, no outer momentum | 1.20 |" in network.markdown(results)
    results["learning"][2]["test_loss"] = 0.15  # fp16 now learns worse than DDP's spread: DDP is the choice at 300
    assert "| 300 Mbit/s | DDP | 1.30 | DDP + fp16 compression | 1.05 |" in network.markdown(results)


def fake_results() -> dict:
    rates = network.parse_rates("unshaped,300mbit,100mbit")
    runs = []
    for rate, ddp, fp16 in zip(rates, (1.0, 1.3, 3.6), (1.1, 1.05, 1.9), strict=True):
        runs += [{"row": "DDP", "rate": rate["label"], "step_s": ddp, "steps_timed": 2, "sent_mb": [43.0, 43.1]},
                 {"row": "DDP + fp16 compression", "rate": rate["label"], "step_s": fp16, "steps_timed": 2,
                  "sent_mb": [21.6, 21.5]}]
    return {"meta": {"hardware": "2 cores of a CPU", "command": "python -m benchmarks.network", "commit": "abc1234",
                     "batch_size": 32, "steps": 4, "rates": rates, "rows": ["DDP", "DDP + fp16 compression"],
                     "compute_alone": {"step_s": 1.0, "command": "python -m benchmarks.bare_step"}},
            "runs": runs, "learning": [], "timeline": None,
            "collectives": {"DDP": {"calls": {"all_reduce": 45}, "sent_mb": [42.9, 42.9], "backward_s": 0.6}}}


def test_the_tables_come_from_the_results(tmp_path):
    text = network.markdown(fake_results())
    assert "| DDP | 1.00 (1.00x) | 1.30 (1.08x) | 3.60 (1.00x) |" in text  # floors: 1.0, 43.1 MB / rate
    assert "| DDP | 45 all_reduce | 42.9 / 42.9 | 43.0 / 43.1 | 1.003 (+0.30 MB) |" in text
    assert "The counters and the collectives within 10% of each other: every row." in text
    assert "fp16 compression 1.89x faster than DDP (goal 1.8x faster: met)" in text
    assert "- DDP + fp16 compression: slower than DDP at unshaped, faster at 300 Mbit/s and 100 Mbit/s." in text
    assert "2 a run at unshaped, 300 Mbit/s and 100 Mbit/s" in text  # the steps each run timed, from the results
    network.chart(fake_results(), tmp_path / "network.png")
    assert (tmp_path / "network.png").stat().st_size > 0


def test_within_the_margin_a_row_is_the_same_as_ddp_not_faster_or_slower():
    results, margin = fake_results(), network.SAME_WITHIN
    results["runs"][1]["step_s"] = 1.0 * (1 + 0.99 * margin)  # fp16 unshaped: DDP's 1.0 plus almost the margin
    results["runs"][3]["step_s"] = 1.3 * (1 - 0.5 * margin)  # at 300 Mbit/s: DDP's 1.3 less half of it
    text = network.markdown(results)
    assert "- DDP + fp16 compression: the same as DDP at unshaped and 300 Mbit/s, faster at 100 Mbit/s." in text
    assert f"more than {margin:.0%} of DDP's, else the same" in text  # the page states the margin
    results["runs"][1]["step_s"] = 1.0 * (1 + 1.01 * margin)  # just past it: slower
    assert "- DDP + fp16 compression: slower than DDP at unshaped, the same at 300 Mbit/s" in network.markdown(results)
    results["runs"][5]["step_s"] = 3.6 * 0.99  # fp16 at 100 Mbit/s: the goal's line says the same, not faster
    assert "- At 100 Mbit/s, fp16 compression the same as DDP (1.01x its speed)" in network.markdown(results)


def test_the_page_and_the_results_folder_hold_the_figures_of_their_json():
    # what `python -m benchmarks.network --doc docs/network.md` would write from the committed network.json, made
    # again here without a run: the page's part between its marks and the folder's network.md must be it, figure for
    # figure, so that neither drifts from the json (after a change to the tables, regenerate both from the json)
    folder = ROOT / "benchmarks" / "results" / "cpu-epyc-network"
    results = json.loads((folder / "network.json").read_text())
    page = (ROOT / "docs" / "network.md").read_text()
    pictures = os.path.relpath(folder, ROOT / "docs") + "/"
    assert page.count(network.DOC_MARKS[0]) == 1 and page.count(network.DOC_MARKS[1]) == 1
    assert network.doc_with_figures(page, results, pictures) == page
    assert (folder / "network.md").read_text() == network.markdown(results)


def test_the_doc_gets_the_tables_between_its_marks(tmp_path):
    page = tmp_path / "docs" / "network.md"
    page.parent.mkdir()
    page.write_text((ROOT / "docs" / "network.md").read_text())
    network.fill_doc(page, fake_results(), tmp_path / "results")
    text = page.read_text()
    assert text.count(network.DOC_MARKS[0]) == 1 and "| DDP | 1.00 (1.00x)" in text and "Not measured yet" not in text
    assert text.endswith((ROOT / "docs" / "network.md").read_text().split(network.DOC_MARKS[1])[1])
    with pytest.raises(UsageError):
        network.check_doc(str(ROOT / "README.md"))


@pytest.fixture
def two_hosts_possible():
    """Skips without root, iproute2, tc or taskset, or where network namespaces cannot be made (a container)."""
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("ip", "tc", "taskset")):
        pytest.skip("two hosts need root, iproute2 and taskset")
    try:
        with network.TwoHosts("ddp-network-probe"):
            pass
    except UsageError as error:
        pytest.skip(str(error))


def start(argv: list[str], tmp_path: Path) -> subprocess.Popen:
    """The benchmark in a session of its own, its temporary files (the ranks' output folders) under tmp_path."""
    (tmp_path / "tmp").mkdir()
    return subprocess.Popen([sys.executable, "-m", "benchmarks.network", *argv, "--output-dir", str(tmp_path / "out")],
                            cwd=ROOT, env=subprocess_env(TMPDIR=str(tmp_path / "tmp")), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def assert_nothing_left(pid: int, tmp_path: Path) -> None:
    """No namespace of the benchmark's (named for its pid), so no link or qdisc of it, and no process of its runs."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"ddp-network-{pid}-" not in names, names
    assert not (ours := processes_naming(tmp_path)), ours


def agreement(results: dict, rate: str) -> float:
    run = next(r for r in results["runs"] if r["rate"] == rate)
    return sum(run["sent_mb"]) / sum(results["collectives"]["DDP"]["sent_mb"])


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_hosts_counters_agree_with_the_collectives_and_nothing_is_left(two_hosts_possible, tmp_path):
    proc = start([*SMALL, "--rates", "unshaped,200mbit"], tmp_path)
    try:
        stdout, stderr = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    out = tmp_path / "out"
    results = json.loads((out / "network.json").read_text())
    assert [r["rate"] for r in results["runs"]] == ["unshaped", "200 Mbit/s"] and "unfinished" not in results["meta"]
    for rate in ("unshaped", "200 Mbit/s"):
        assert 0.9 <= agreement(results, rate) <= 1.1, (rate, results)
    shaped = results["runs"][1]
    assert shaped["step_s"] >= 0.9 * max(shaped["sent_mb"]) * 2**20 * 8 / 200e6, shaped  # the link held to its rate
    assert (out / "network.png").is_file() and (out / "timeline.png").is_file()
    assert "### Bytes per step" in (out / "network.md").read_text()
    assert_nothing_left(proc.pid, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_ctrl_c_keeps_the_rows_measured_and_leaves_nothing(two_hosts_possible, tmp_path):
    proc = start([*SMALL, "--rates", "unshaped,30mbit", "--no-timeline"], tmp_path)
    _, stderr = interrupted(proc, "[2/", timeout=180)  # [1/5] compute alone, [2/5] the unshaped row: then the next
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("stopped by Ctrl-C after 1 of 2 runs"), stderr[-3000:]
    results = json.loads((tmp_path / "out" / "network.json").read_text())
    assert len(results["runs"]) == 1 and "unfinished" in results["meta"]
    assert 0.9 <= agreement(results, "unshaped") <= 1.1, results
    assert "**Unfinished:**" in (tmp_path / "out" / "network.md").read_text()
    assert_nothing_left(proc.pid, tmp_path)


def test_the_small_all_reduces_counted_are_those_started_in_each_steps_backward():
    from tools.timeline import Collective, Lane
    lane = Lane("rank 0", compute={"forward": [(0, 10), (100, 110)], "backward": [(10, 20), (25, 40), (110, 140)]},
                steps=[(0, 50, "step 3"), (100, 150, "step 4")])
    lane.collectives = [Collective(5, 6, "all_reduce", "all_reduce", 8200),  # SyncBatchNorm's forward: not counted
                        Collective(20, 25, "all_reduce", "all_reduce", 4096),  # in the backward's gap: counted
                        Collective(30, 45, "all_reduce", "all_reduce", 2 * 2**20),  # a bucket: not counted
                        Collective(39, 41, "all_reduce", "all_reduce", 64),  # counted
                        Collective(45, 46, "all_reduce", "all_reduce", 4),  # after the backward (the loss): not
                        Collective(120, 130, "all_reduce", "all_reduce", 1024)]  # the next step's
    assert network.small_in_backward([lane]) == [{"lane": "rank 0", "step": "step 3", "count": 2, "seconds": 0.007},
                                                 {"lane": "rank 0", "step": "step 4", "count": 1, "seconds": 0.01}]
