"""Sharded checkpoints of distributed_fsdp.py, with torch.distributed.checkpoint (DCP): each rank writes its
own shard of the weights and optimizer state, in parallel, and a later run reads them back at any world
size (DCP reshards on load). A checkpoint is a directory:

    checkpoint.dcp/__0_0.distcp, __1_0.distcp, ...   each rank's shard
    checkpoint.dcp/.metadata                         DCP's index of the shards, written once all are whole
    checkpoint.dcp/run.pt                            the header: epoch, step, flags, scheduler (rank 0)

It is written as checkpoint.dcp.tmp and renamed when whole, the older ones moving down (checkpoint.1.dcp,
...), so a crash or a killed rank during a save leaves the previous checkpoint as it was.

    python -m safety_net.sharded_checkpoint runs/distributed_fsdp/checkpoint.dcp [OUT.pt]

makes one plain checkpoint file of it (default: checkpoint.pt beside it), which --evaluate and --init-from
of every script read.
"""
import argparse
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from safety_net import checkpoint, crash_report
from safety_net.checkpoint import HEADER, Checkpoint, load
from safety_net.stop_errors import StorageError
from utils import collectives
from utils.errors import UsageError, exit_on_error, first_line

FULL = StateDictOptions(full_state_dict=True)  # plain tensors keyed as the unsharded model's state_dict


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        checkpoint.fsync(os.path.join(path, name))
    checkpoint.fsync(path)


class ShardedCheckpoint(Checkpoint):
    """Checkpoint's behaviour (lock, resume, --init-from, --keep, --restart, divergence and storage errors)
    with sharded checkpoints: every rank saves and loads its own shard of the model and optimizer."""

    full_weights = FULL  # whole weights (--init-from, another script's checkpoint): each rank keeps its shard
    optimizer_options = None  # torch's default layout of the optimizer's state: its param_groups one list

    def state_dicts(self) -> dict:
        """Every rank (collective: same_buffers_everywhere, before DCP picks one rank's copy of them to write): what
        save() checks and writes, this rank's shards."""
        self.same_buffers_everywhere()
        return self.shards()

    def shards(self) -> dict:
        """The model's and optimizer's state as this rank's shards (DTensors), keyed by parameter name."""
        model, optimizer = self.parts["model"], self.parts["optimizer"]
        return {"model": get_model_state_dict(model),
                "optimizer": get_optimizer_state_dict(model, optimizer, options=self.optimizer_options)}

    def load_weights(self, state: dict | None = None) -> None:
        """For --evaluate: the weights of <output-dir>/checkpoint.dcp, each rank reading its shard (`state`, its
        header, is not needed)."""
        self.read_weights(self.path, self.path)

    def read_weights(self, path: str, source: str) -> None:
        """The model's weights in `path`: of a sharded checkpoint (a directory), each rank reads its shard."""
        if not os.path.isdir(path):
            return super().read_weights(path, source)
        load(path)
        model = self.parts["model"]
        weights = get_model_state_dict(model)
        self._read_shards({"model": weights}, path, source)
        set_model_state_dict(model, weights)

    def _read_shards(self, state: dict, path: str, source: str | None = None) -> None:
        """dcp.load of `path` into `state`; a failure is one UsageError naming `source` (default: the path)."""
        try:
            dcp.load(state, checkpoint_id=path)
        except (CheckpointException, RuntimeError, KeyError, ValueError, OSError) as e:
            reason = first_line(e)
            raise UsageError(f"{source or path}: its shards could not be read into this model ({reason})") from None

    def restore(self, state: dict, path: str) -> None:
        """The model and optimizer from the shards in `path`, resharded to this world size; the scheduler
        from its header `state`."""
        if "model" in state:
            raise UsageError(f"{path} is a single-file checkpoint; {self.script} continues from a sharded "
                             "one (a directory), or starts a new run from these weights with --init-from")
        shards = self.shards()
        self._read_shards(shards, path)
        set_model_state_dict(self.parts["model"], shards["model"])  # this rank's shards as read: no full_weights
        self.restore_others({**state, "optimizer": shards["optimizer"]}, path)

    def load_optimizer_state(self, saved: dict) -> None:
        """The optimizer's state keyed by parameter name, as DCP read this rank's shard of it."""
        set_optimizer_state_dict(self.parts["model"], self.parts["optimizer"], saved, options=self.optimizer_options)

    def write(self, state: dict, epoch: int, step: int, epoch_loss: tuple[float, float]) -> None:
        """Every rank (collectives: DCP's, and the write agreed) writes its shard into checkpoint.dcp.tmp, rank 0
        the header, then rank 0 renames it to checkpoint.dcp. A failed write on any rank raises StorageError on
        every rank."""
        tmp = f"{self.path}.tmp"
        error = None
        try:
            dcp.save(state, checkpoint_id=tmp)  # each rank its own file; rank 0 then writes .metadata
        except CheckpointException as e:  # raised on every rank when any rank's write failed
            error = e
        if error is None and self.env.is_main:
            try:
                header = self.header(epoch, step, epoch_loss)
                header.update({name: part.state_dict() for name, part in self.parts.items()
                               if name not in ("model", "optimizer") and part is not None})
                torch.save(header, os.path.join(tmp, HEADER))
                _fsync_tree(tmp)
                checkpoint.rotate_in(tmp, self.path, self.options.keep, sharded=True)
            except OSError as e:
                error = e
        if not collectives.all_ok(error is None, self.env.device):  # no rank trains on without a checkpoint
            if self.env.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._storage_error(error, state)

    def same_buffers_everywhere(self) -> None:
        """Every rank (collective: a broadcast per buffer): the BatchNorm statistics, which are not sharded and which
        DCP writes from one rank, made rank 0's on every rank first."""
        for buffer in self.parts["model"].buffers():
            torch.distributed.broadcast(buffer, src=0)

    def _storage_error(self, error, shards: dict) -> StorageError:
        reason = "another rank's write failed" if error is None else (
            getattr(error, "strerror", None) or str(error).strip().splitlines()[-1][:160])
        needed = f"this rank's shard needs about {checkpoint.nbytes(shards) / 2**20:.0f} MB"
        return checkpoint.storage_error(self.path, reason, needed, sharded=True)


class PipelineCheckpoint(ShardedCheckpoint):
    """distributed_pipeline.py's checkpoints: each rank (stage) writes the weights and optimizer state of the layers
    it holds, keyed by their names in the whole model, so the checkpoint holds the whole model once and a later run
    reads each stage's part at any number of stages."""

    # each parameter's learning rate, momentum, ... under its own name ("param_groups.layer2.1.conv1.weight.lr"): in
    # torch's default layout every stage's one param_group would be saved under the same key, and one stage's kept
    optimizer_options = StateDictOptions(flatten_optimizer_state_dict=True)

    def same_buffers_everywhere(self) -> None:
        """Nothing to agree on: each stage's BatchNorm statistics are its own layers', held by that rank alone."""

    def set_weights(self, weights: dict, source: str) -> None:
        """Full weights (another script's checkpoint, --init-from): this stage keeps those of its own layers."""
        # by hand: torch's set_model_state_dict is strict over all keys (the other stages' too) or over none
        own = self.parts["model"].state_dict().keys()
        missing = [key for key in own if key not in weights]
        if missing:
            raise UsageError(f"{source} holds weights of another architecture (no {missing[0]})")
        self.parts["model"].load_state_dict({key: weights[key] for key in own})


def to_single_file(sharded: str, out: str) -> dict:
    """The sharded checkpoint `sharded` as one plain checkpoint file `out` (written atomically): the full
    weights under "model", the optimizer state keyed by parameter name, and the header. Returns it."""
    header = load(sharded)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out))) as scratch:
        plain = os.path.join(scratch, "plain.pt")
        dcp_to_torch_save(sharded, plain)  # torch's own conversion: every shard, in one process
        state = torch.load(plain, map_location="cpu", weights_only=True)
    state = {**header, "model": state["model"], "optimizer": state["optimizer"], "converted_from": sharded}
    checkpoint.save_atomic(state, out)
    return state


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m safety_net.sharded_checkpoint",
                                     description="Make one plain checkpoint file of a sharded checkpoint of "
                                                 "distributed_fsdp.py, for --evaluate and --init-from of any script.")
    parser.add_argument("sharded", help="a sharded checkpoint directory, e.g. runs/distributed_fsdp/checkpoint.dcp")
    parser.add_argument("out", nargs="?", help="the file to write (default: checkpoint.pt beside the directory); "
                                               "an existing file is not overwritten")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.sharded)), checkpoint.FILENAME)
    with exit_on_error(crash_report.report):  # a crash: one line, the traceback in a file
        if not os.path.isdir(args.sharded):
            raise UsageError(f"{args.sharded} is not a sharded checkpoint directory")
        if os.path.exists(out):
            raise UsageError(f"{out} exists; name another file, or remove it first")
        if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise UsageError(f"{os.path.dirname(out)}: no such directory")
        state = to_single_file(args.sharded, out)
        use = (f"python distributed.py --evaluate --output-dir {os.path.dirname(out) or '.'} tests it"
               if os.path.basename(out) == checkpoint.FILENAME else f"--init-from {out} starts a run from it")
        print(f"wrote {out}: epoch {state['epoch']}, step {state['step']} of a {state['world_size']}-process run "
              f"({use})")
    sys.exit(0)


if __name__ == "__main__":
    main()
