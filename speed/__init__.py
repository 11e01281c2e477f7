"""The speed techniques, each behind a flag whose cost and gain the benchmark measures (docs/speed.md):
techniques.py maps the flags onto torch's own parts (DDP's settings, gradient compression, channels-last,
torch.compile, the optimizer's kernel); the fast GPU path of distributed_apex.py, the one the README sends you to
for speed, is device_loader.py (--loader device: the data set held on the GPU) and cuda_graphs.py (--cuda-graphs:
each step replayed from one CUDA graph). Without a flag, training runs as torch ships it."""
