"""Rank 0's progress on a terminal: a bar where the terminal can show one, the progress lines where it cannot."""
import fcntl
import os
import pty
import struct
import sys
import termios
from types import SimpleNamespace

import torch

from safety_net.progress import EpochProgress


def progress_on(terminal: int, monkeypatch) -> EpochProgress:
    monkeypatch.setattr(sys, "stderr", open(terminal, "w", closefd=False))
    env = SimpleNamespace(is_main=True, device=torch.device("cpu"), world_size=1)
    return EpochProgress(steps=4, epoch=0, epochs=1, env=env, global_batch=8, print_freq=1, lr=0.1)


def test_a_terminal_of_no_width_gets_the_progress_lines_not_an_empty_bar(monkeypatch, capsys):
    """A terminal of 0 columns (`script` run without a terminal makes one, and a new pseudo-terminal is one) shows
    nothing of tqdm's bar: the step lines are printed instead, or nothing would show until the epoch's end."""
    controller, terminal = pty.openpty()
    try:
        progress = progress_on(terminal, monkeypatch)
        assert progress.bar is None
        progress.record(torch.tensor(4.5))
        assert "epoch 1/1 step 1/4 loss 4.5000" in capsys.readouterr().out
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # 24 rows, 80 columns
        progress = progress_on(terminal, monkeypatch)
        assert progress.bar is not None
        progress.record(torch.tensor(4.5))
        progress.bar.close()
        assert "epoch 1/1 step" not in capsys.readouterr().out  # the bar carries the loss
    finally:
        os.close(controller)
        os.close(terminal)
