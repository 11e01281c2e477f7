"""Imported at start-up by every Python process the tests launch (subprocess_env puts this folder on PYTHONPATH):
the interpreter's last garbage collection is skipped at exit. It walks the hundreds of thousands of objects that
importing torch and torchvision creates (about 330,000), which the exit frees anyway: 1 to 2 s of every such
process's end on a 2-core AMD EPYC, and a test launch ends 2 or 3 of them. Registered first, gc.freeze runs after
every other atexit handler (the scripts', torch's, multiprocessing's), so those run as for a user; the modules are
still torn down, only cyclic garbage is left to the exit. Not for users: a training run ends once."""
import atexit
import gc

atexit.register(gc.freeze)
