"""No step of any script reads a float or bool tensor back to Python between progress lines: on a GPU each such
read (.item(), float(), bool(), .tolist()) waits for the device to finish all the work queued before it. Counted on
the CPU by tests/script_driver.py; the graph path and distributed_apex.py's --loader device are checked on 2 ranks in
tests/test_cuda_graphs.py."""
import sys

import pytest
from script_runs import ROOT, TINY, check, run

DRIVER = str(ROOT / "tests" / "script_driver.py")


@pytest.mark.slow
@pytest.mark.parametrize(("script", "launcher"), [
    ("dataparallel.py", "python"), ("distributed.py", "torchrun"), ("distributed_mp.py", "torchrun"),
    ("distributed_apex.py", "torchrun"),
    ("distributed_gradient_accumulation.py", "torchrun"), ("distributed_fsdp.py", "torchrun")])
def test_no_step_reads_a_float_or_bool_tensor_back_between_progress_lines(script, launcher, tmp_path):
    """3 steps of one epoch in one process (tests/test_cuda_graphs.py counts distributed_apex.py on 2 ranks), a progress
    line at the first only: the other two steps, the safety net's bookkeeping included, read nothing back."""
    counted = tmp_path / "host_reads.txt"
    args = ["--host-reads", str(counted), script, *TINY, "--print-freq", "1000", "--output-dir", str(tmp_path / "run")]
    start = [] if launcher == "python" else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    check(run([sys.executable, *start, DRIVER, *args], timeout=300))
    assert counted.read_text() == "0 none\n", f"{script} read tensors back:\n{counted.read_text()}"
