"""The card's small module: what every training script needs to train and nobody comes to learn. The data
(CIFAR-100, the synthetic set, their augmentation, the resumable sampler), the model, SyncBatchNorm for the CPU,
exact evaluation with its reductions over the ranks, the launch environment, the flags the scripts share, and the
one-line errors. It imports nothing of safety_net/ (the run's checkpoints, stop signals and metrics) or speed/ (the
speed techniques); the calls a strategy is made of (the process group, the wrap, the sampler, the DataLoader, the
optimizer, the strategy's own lines) stay in the scripts. utils/spawn.py, precision.py, gpus.py and
live_recovery.py each serve the scripts named in their docstrings."""
