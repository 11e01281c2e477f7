"""The two errors that stop a run from inside the safety net (a divergence, a failed write), each one line on
stderr through utils.errors.exit_on_error."""
from utils.errors import OneLineError


class Diverged(OneLineError):
    """The training loss or the weights became NaN or infinite: exit status 1, and the last checkpoint is not
    overwritten."""


class StorageError(OneLineError):
    """A file could not be written (a full disk, an I/O error, a read-only file system): exit status 1; the
    previous checkpoint is intact."""
