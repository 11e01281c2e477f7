"""The safety net of distributed_live_recovery.py: SafetyNet, and what a replica group hands one that heals from
it (torchft's state_dict and load_state_dict), with the epoch the loop then starts at and a note at the end of each
progress line. The other scripts heal nothing and import none of it."""
import copy

from safety_net import SafetyNet
from safety_net import checkpoint as checkpoints
from utils.errors import UsageError


class HealingSafetyNet(SafetyNet):
    """SafetyNet, and a live replica group's state to hand over or take (torchft's Manager calls both)."""

    def state_for_a_peer(self) -> dict:
        """What a live replica group hands one that heals from it (distributed_live_recovery.py): every part given
        to resume() as a checkpoint holds it, with the epoch and step this process has reached. Local, no
        collective: torchft calls it from a thread of its own while the training loop waits for the quorum. A copy:
        the peer reads it while this group's next forward updates BatchNorm's statistics in place."""
        epoch, step = (self.progress.epoch, self.progress.step) if self.progress else self.start_at
        weights = checkpoints.unwrap(self.checkpoint.parts["model"]).state_dict()
        return copy.deepcopy(self.checkpoint.state(weights, epoch, step, epoch_loss=(0.0, 0.0)))

    def take_state_from_a_peer(self, state: dict) -> None:
        """Every part from a live replica group's state_for_a_peer(), and its place in the run: the epoch loop
        starts there (epoch_to_start). A peer that trains another run (other flags) is a UsageError."""
        for name, value in self.options.run.items():
            if state["run"].get(name, value) != value:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"the live replica groups train with {flag} {state['run'][name]}, this one with "
                                 f"{value}: start every replica group with the same flags")
        self.checkpoint.restore(state, "a live replica group's state")
        self.checkpoint.epoch_loss = (0.0, 0.0)  # the epoch's loss so far is the peer's: this group counts its own
        self.start_at = (state["epoch"], state["step"])
        if self.env.is_main:
            print(f"healed from a live replica group: its weights, optimizer and schedule at epoch "
                  f"{state['epoch'] + 1}, step {state['step']}", flush=True)

    def epoch_to_start(self) -> int:
        """The epoch the loop starts at: the checkpoint's (resume), or the live group's a heal took (above)."""
        return self.start_at[0]

    def note_in_progress_lines(self, note) -> None:
        """note(): a few words put at the end of every progress line (called only when one is printed)."""
        self.progress_note = note
