"""The peers of benchmarks.run: the same job written the way others write it, measured beside our rows.

plain_ddp.py is a plain tutorial DDP loop, lightning_ddp.py PyTorch Lightning's Trainer with its DDP
strategy. Both are started by torchrun (`torchrun ... -m benchmarks.peers.plain_ddp`) and print one JSON
line per epoch: {"epoch", "images_per_s", "epoch_time_s", "train_loss", "world_size"}.
"""
