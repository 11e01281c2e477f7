"""What the training scripts need to train and nobody comes to learn: flags, data, model, launch plumbing,
SyncBatchNorm for the CPU, exact evaluation and error reporting. It imports nothing of safety_net/ (the
run's checkpoints, stop signals and metrics); the calls a strategy is made of (the process group, the
wrap, the sampler, the strategy's own lines) stay in the scripts."""
