"""tools/timeline.py's GPU branch, on a made-up trace as torch.profiler writes one on a GPU: the device's
kernels are the compute (each in the category of the operator that launched it), NCCL's kernels the
communication, named and sized in whatever words and dtype names the trace uses."""
import json

import pytest

from tools import timeline


def gpu_trace(rank: int = 0) -> dict:
    """One step (µs): a forward convolution, a backward one on autograd's thread whose bfloat16 gradient all-reduce
    overlaps it, an all-gather and a reduce-scatter after it, and the optimizer's kernel."""
    def event(name, ts, dur, tid=1, cat="cpu_op", **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}

    def launch(ts, correlation, tid=1):
        return event("cudaLaunchKernel", ts, 1, tid=tid, cat="cuda_runtime", correlation=correlation)

    def kernel(name, ts, dur, stream=7, **args):
        return event(name, ts, dur, tid=stream, cat="kernel", **args)

    events = [event("ProfilerStep#4", 0, 200, cat="user_annotation"),
              event("aten::conv2d", 0, 10), launch(2, 1),
              event("autograd::engine::evaluate_function: ConvolutionBackward0", 50, 10, tid=2), launch(52, 2, tid=2),
              event("Optimizer.step#SGD.step", 150, 10, cat="user_annotation"), launch(152, 3),
              kernel("void cudnn::conv_fwd_kernel", 10, 30, correlation=1),
              kernel("void cudnn::wgrad_kernel", 60, 40, correlation=2),
              kernel("void multi_tensor_apply_kernel", 160, 10, correlation=3),
              # record_param_comms' words: ScalarType names (older torch), torch's names (newer), or none at all
              kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 70, 40, stream=20, **{
                  "Collective name": "allreduce", "In msg nelems": 1000, "Out msg nelems": 1000, "dtype": "BFloat16"}),
              kernel("ncclDevKernel_AllGather_RING_LL", 120, 10, stream=20, **{
                  "Collective name": "_allgather_base", "In msg nelems": 250, "Out msg nelems": 1000,
                  "dtype": "float32"}),
              kernel("ncclDevKernel_ReduceScatter_Sum_f16_RING_LL", 135, 5, stream=20, **{"In msg nelems": 500})]
    return {"distributedInfo": {"rank": rank, "world_size": 1}, "traceEvents": events}


def test_kernels_are_the_compute_and_nccl_kernels_the_collectives_in_every_dtype(tmp_path, capsys):
    lane = timeline.read_lane("rank 0", gpu_trace())
    assert lane.compute == {"forward": [(0.01, 0.04)], "backward": [(0.06, 0.1)], "optimizer": [(0.16, 0.17)]}
    assert [(c.asked, c.size) for c in lane.collectives] == [
        ("all_reduce", 2000),  # 1000 bfloat16 elements
        ("all_gather", 4000),  # its output: 1000 float32 elements
        ("reduce_scatter", 1000)]  # no dtype in its args: float16, from the kernel's name
    total, (share,) = timeline.overlap([lane])
    assert total == share == pytest.approx(30 / 55)  # the all-reduce under the backward kernel, 70-100 µs
    folder = tmp_path / "profile"
    folder.mkdir()
    (folder / "rank0.json").write_text(json.dumps(gpu_trace()))
    timeline.main([str(tmp_path)])
    assert capsys.readouterr().out.startswith("communication overlapping compute: 55%")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("text", "means"), [("allreduce", "all_reduce"), ("_allgather_base", "all_gather"),
                                             ("reduce_scatter_tensor_coalesced", "reduce_scatter"),
                                             ("AllGather", "all_gather"), ("ReduceScatter", "reduce_scatter"),
                                             ("broadcast", "broadcast"), ("Reduce", "reduce")])
def test_every_name_of_a_collective_means_one_collective(text, means):
    assert timeline.nccl_collective(text) == means


def test_profiling_the_graph_path_is_refused_in_one_line(monkeypatch, capsys):
    """Under --cuda-graphs the steps --profile-steps would record are the eager ones before the capture: the pair is
    refused when the flags are parsed (on a GPU; here the GPU check is left out, as tests/script_driver.py does)."""
    import distributed_apex
    from speed import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "_no_gpu", lambda args: None)
    with pytest.raises(SystemExit) as exited:
        distributed_apex.parse_args(["--cuda-graphs", "--loader", "device", "--opt-level", "O0",
                                     "--profile-steps", "2"])
    said = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(said) == 1 and "profile without --cuda-graphs" in said[0], said
    assert distributed_apex.parse_args(["--cuda-graphs", "--loader", "device", "--opt-level", "O0"]).cuda_graphs
