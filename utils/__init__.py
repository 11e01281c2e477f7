"""What the five training scripts share: flags, data, model, process group, SyncBatchNorm,
metrics, snapshots and logging. Everything that differs between strategies stays in the scripts."""
