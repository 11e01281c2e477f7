"""What the training scripts share and nobody comes to learn: flags, data, model, launch plumbing,
SyncBatchNorm for the CPU, metrics, checkpoints, stop signals and error reporting. The calls a
strategy is made of (the process group, the wrap, the sampler, the strategy's own lines) stay in
the scripts."""
