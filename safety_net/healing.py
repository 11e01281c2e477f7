"""The safety net of distributed_live_recovery.py: SafetyNet, and what a replica group hands one that heals from
it (torchft's state_dict and load_state_dict), with the epoch the loop then starts at, a note at the end of each
progress line, and the wait of a group continuing from its checkpoint for the groups of its last step. The other
scripts heal nothing and import none of it."""
import copy
import threading

from safety_net import SafetyNet
from safety_net import checkpoint as checkpoints
from utils import live_recovery
from utils.errors import UsageError


class ManagerState:
    """torchft's Manager as a part of the checkpoint: its counts of committed steps and batches (by which the quorum
    tells which group is behind), and how many replica groups took part in its last quorum."""

    def __init__(self, manager):
        self.manager, self.groups = manager, 1

    def state_dict(self) -> dict:
        if threading.current_thread() is threading.main_thread():  # a checkpoint's save: the quorum is formed
            self.groups = max(1, self.manager.num_participants())  # (torchft's thread asks within a quorum: wait)
        return {**self.manager.state_dict(), "groups": self.groups}

    def load_state_dict(self, state: dict) -> None:
        self.groups = state.get("groups", 1)  # a checkpoint from before it was recorded: no wait
        self.manager.load_state_dict({key: value for key, value in state.items() if key != "groups"})


class HealingSafetyNet(SafetyNet):
    """SafetyNet, and a live replica group's state to hand over or take (torchft's Manager calls both)."""

    def resume(self, *, manager=None, replica_groups: int = 1, lighthouse: str = "", wait_for_groups: float = 0.0,
               **parts) -> int:
        """SafetyNet.resume, with the manager's state in the checkpoint (ManagerState); each progress line then ends
        with how many of the `replica_groups` took part in the last quorum. Then, before the first quorum (HTTP, no
        collective), a group continuing from its checkpoint waits until as many replica groups beat on the lighthouse
        as took part in the checkpoint's last quorum, at most wait_for_groups seconds (--wait-for-groups).
        Trained on alone, it could reach the step another group's checkpoint holds, on other weights, and torchft
        heals only a group whose step is behind: the two would never agree again. --evaluate: no manager, only the
        model's weights read (SafetyNet.resume)."""
        if self.options.evaluate:
            return super().resume(**parts)
        self.manager_state = ManagerState(manager)
        self.progress_note = lambda: f"{manager.num_participants()} of {replica_groups} replica groups"
        start_epoch = super().resume(manager=self.manager_state, **parts)
        groups = self.manager_state.groups
        if groups > 1 and wait_for_groups > 0 and start_epoch < self.options.epochs:
            live_recovery.wait_for_replica_groups(lighthouse, groups, wait_for_groups, is_main=self.env.is_main,
                                                  stop=self.stop_received_here)
        return start_epoch

    def state_for_a_peer(self) -> dict:
        """What a live replica group hands one that heals from it (distributed_live_recovery.py): every part given
        to resume() as a checkpoint holds it, with the epoch and step this process has reached. Local, no
        collective: torchft calls it from a thread of its own while the training loop waits for the quorum. A copy:
        the peer reads it while this group's next forward updates BatchNorm's statistics in place."""
        epoch, step = (self.progress.epoch, self.progress.step) if self.progress else self.start_at
        weights = checkpoints.model_state(self.checkpoint.parts["model"])
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
