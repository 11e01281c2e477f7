"""benchmarks.tensor_parallel, the measurements behind docs/sharding.md's "why not tensor parallelism": on 2 CPU ranks
(gloo), torch refuses to split a convolution's weight as it splits a Linear's, no split of one of ResNet-18's
convolutions that holds less than the whole weight gives the right forward and backward, and the split that does work,
by batch, is data parallelism: the weight whole on each rank and its gradient all-reduced."""
import pytest

from benchmarks import tensor_parallel


@pytest.mark.slow  # 2 spawned processes
@pytest.mark.timeout(120)
def test_no_split_of_a_convolution_holds_less_than_its_weight_and_trains_right():
    found = tensor_parallel.measure("cpu")
    rows = {row["case"]: row for row in found["rows"]}
    assert set(rows) == {case for case, _, _ in tensor_parallel.CASES}
    assert "only support nn.Linear and nn.Embedding" in rows["ColwiseParallel, the Linear split"]["refused"]
    for row in found["rows"]:
        trains_right = row.get("forward", "").startswith("right") and row.get("backward", "").count("right") == 2
        if trains_right:  # then each rank holds the whole weight
            assert row["weight_held"] == row["weight_bytes"], row
    batch = rows["images split by batch"]  # ResNet's stride-2 convolution: pytorch/pytorch#176446 fixed in 2.14
    assert batch["forward"].startswith("right") and batch["backward"].count("right") == 2, batch
    assert batch["sent_calls"] == {"all_reduce": 1}, batch  # the weight's gradient, as DDP's
    assert "Stride must be 1 when there is padding" in rows["images split by width, 3x3 stride 2"]["backward"]
    table = tensor_parallel.markdown(found)
    assert table.count("\n| ") == 1 + len(tensor_parallel.CASES) and "614,400 values for one image" in table
