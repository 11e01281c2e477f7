"""A parameter that takes no part in the loss: "Expected to have finished reduction in the prior iteration".

Symptom: the second step raises "RuntimeError: Expected to have finished reduction in the prior iteration before
starting a new one. This error indicates that your module has parameters that were not used in producing loss.
... Parameter indices which did not receive grad for rank 0: 4 5".
Cause: DDP all-reduces a bucket of gradients once every parameter in it has its gradient. A parameter that forward()
did not use (here a head switched off) never gets one, so the reduction never finishes, and the next forward()
finds it unfinished. A branch taken on some steps only (a loss term skipped, a layer frozen halfway) does the same.
Find it: TORCH_DISTRIBUTED_DEBUG=INFO (or DETAIL) names the parameters: "Parameters which did not receive grad for
rank 0: aux_head.bias, aux_head.weight". (torch 2.15.0 on gloo crashes with SIGSEGV when DDP is built under DETAIL;
INFO is enough here.)
Fix: use the parameter or leave it out of the model; or find_unused_parameters=True, which after every forward walks
the autograd graph from the outputs to mark what was left unused (a cost at every step, growing with the graph);
or static_graph=True, when the same parameters go unused at every step: DDP learns it once, in the first step.

    python failures/unused_parameter.py                                # the error at step 1
    TORCH_DISTRIBUTED_DEBUG=INFO python failures/unused_parameter.py   # ... and the parameters' names
    python failures/unused_parameter.py --fixed                        # find_unused_parameters=True: exit 0
    python failures/unused_parameter.py --fixed static_graph           # static_graph=True: exit 0
"""
import torch
from _launch import launch, parse
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 2)
        self.aux_head = nn.Linear(16, 2)  # an auxiliary loss's head, switched off in this run

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))  # aux_head is not called: its parameters get no gradient


def main(rank, world_size, args):
    torch.manual_seed(rank)
    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
    if args.fixed == "find_unused_parameters":  # the fix: after each forward, find the parameters it did not use
        model = DistributedDataParallel(Net(), find_unused_parameters=True)
    elif args.fixed == "static_graph":  # the fix: learn in the first step which parameters are never used
        model = DistributedDataParallel(Net(), static_graph=True)
    else:
        model = DistributedDataParallel(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"rank {rank}: step {step}, loss {loss.item():.3f}")


if __name__ == "__main__":
    launch(main, parse(__doc__, fixes=("find_unused_parameters", "static_graph")))
