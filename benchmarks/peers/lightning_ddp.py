"""PyTorch Lightning's Trainer with its DDP strategy on the benchmark's workload, one of benchmarks.run's peers.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.peers.lightning_ddp --device cpu --batch-size 16 --steps 4

Lightning is optional (pip install lightning); benchmarks.run leaves this row out where it is missing.
The same job as the plain loop (benchmarks/peers/plain_ddp.py): its dataset (torchvision's transforms in
DataLoader workers kept across epochs), ResNet-18 for 32x32 images and SGD, in a LightningModule that
Trainer(strategy="ddp") trains. Started by torchrun, which Lightning recognises (TorchElasticEnvironment)
instead of starting processes of its own. The Trainer adds its DistributedSampler and set_epoch, the DDP
wrap and SyncBatchNorm on GPUs (sync_batchnorm=True; on the CPU plain BatchNorm, as in the plain loop).
`--precision bfloat16` is the Trainer's precision="bf16-mixed" (autocast in bfloat16, as the plain loop's).
The logger, checkpoints, progress bar and model summary are off: neither loop has them. A callback times
each training epoch, from its start to its last optimizer step, and rank 0 prints one JSON line per epoch
in the plain loop's form.
"""
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

try:
    import lightning as L
except ImportError:  # as a missing --tensorboard package is in the scripts: one line, exit status 2
    print("benchmarks.peers.lightning_ddp: error: needs PyTorch Lightning, an optional dependency "
          "(pip install lightning)", file=sys.stderr)
    sys.exit(2)

from benchmarks.peers import plain_ddp
from utils.models import resnet18_cifar


class Classifier(L.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.model, self.lr, self.criterion = resnet18_cifar(), lr, nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):
        images, targets = batch
        outputs = self.model(images)
        self.outputs_dtype = str(outputs.dtype).removeprefix("torch.")  # what Trainer's precision made of it
        return self.criterion(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)


class EpochTimer(L.Callback):
    """Rank 0 prints each training epoch's images/s (all processes together), seconds and mean loss."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    def on_train_epoch_start(self, trainer, module):
        self.loss_sum, self.steps = torch.zeros((), device=module.device), 0
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.loss_sum += outputs["loss"].detach()
        self.steps += 1

    def on_train_epoch_end(self, trainer, module):
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)
        seconds = time.perf_counter() - self.start
        images = self.steps * self.batch_size * trainer.world_size
        if trainer.is_global_zero:
            print(json.dumps({"epoch": trainer.current_epoch + 1, "images_per_s": images / seconds,
                              "epoch_time_s": seconds, "train_loss": self.loss_sum.item() / self.steps,
                              "world_size": trainer.world_size, "outputs": module.outputs_dtype}), flush=True)


def main(argv=None):
    args = plain_ddp.parse_args(argv, "benchmarks.peers.lightning_ddp", __doc__)
    processes, world_size = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    dataset = plain_ddp.AugmentedImages(args.steps * args.batch_size * world_size)
    # shuffle=True: Lightning swaps it for a DistributedSampler and tells it the epoch
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0, pin_memory=args.device == "cuda")
    trainer = L.Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=processes,
                        num_nodes=world_size // processes, strategy="ddp", sync_batchnorm=args.device == "cuda",
                        precision="bf16-mixed" if args.precision == "bfloat16" else "32-true",
                        max_epochs=args.epochs, callbacks=[EpochTimer(args.batch_size)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(args.lr), loader)


if __name__ == "__main__":
    main()
