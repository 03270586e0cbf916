"""How every training script treats its output folder, its time and its end, so that a run in a user's hands neither
loses nor mixes anything.

- The folder: a new run records its arguments in `run_arguments.json`. The same command run again resumes from the
  run's last complete checkpoint (as transformers' examples do with `get_last_checkpoint`, skipping a checkpoint whose
  save was interrupted); a folder that holds another run, or anything else, is refused unless --overwrite_output_dir.
  That run is replaced only once the new one has saved: its files are set aside (`.replaced-run`) when training
  begins, put back if the new run fails before its first save (or, killed, when the folder is next used), and its
  checkpoints and weights removed after that save. One run per folder: a run holds an OS lock on `.run.lock` for its
  life (released by the OS when the process dies), and a second run into the folder is refused, naming the first.
- The time: `RunTracker` counts the run's training time across restarts (the time a killed run trained after its
  last checkpoint included, from `.run_clock.json`), stops training cleanly at
  --max_train_minutes and evaluates/saves every --eval_every_minutes/--save_every_minutes; it stamps every checkpoint
  with the run's id, so that averaging never mixes runs.
- The end: --average_last_checkpoints k averages the last k checkpoints (paper §6.1) and keeps the averaged weights
  only where the validation set scores them better.
- Nothing silent: a non-finite loss (or gradient norm) stops training with an error before anything is saved from
  that step, keeping the last good checkpoint; so do non-finite weights about to be saved; a full disk is named.
"""

import errno
import fcntl
import functools
import json
import logging
import math
import operator
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from average_checkpoints import (
    TRAINER_STATE,
    averaged_weights,
    checkpoint_step,
    checkpoint_weights,
    complete_checkpoints,
    last_checkpoints,
    trainer_state,
)
from torch.optim.lr_scheduler import LambdaLR
from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy, SchedulerType

logger = logging.getLogger(__name__)

# transformers' schedules that are not a LambdaLR of the step: they follow a metric, so a cool-down cannot scale them.
METRIC_DRIVEN_SCHEDULES = (SchedulerType.REDUCE_ON_PLATEAU, SchedulerType.GREEDY)

RUN_RECORD = "run_arguments.json"
# Arguments that name the run's folder or say what to do with it now, not what the run trains.
NOT_PART_OF_THE_RUN = {
    "output_dir",
    "run_name",
    "overwrite_output_dir",
    "resume_from_checkpoint",
    "do_train",
    "do_eval",
    "do_predict",
    "local_rank",
    "report_to",
    "disable_tqdm",
    "hub_token",
    "dataloader_pin_memory",  # set from the machine (RunArguments)
}
# What a run leaves in its folder that a new run's files could be mixed with: removed by --overwrite_output_dir.
RUN_CLOCK = ".run_clock.json"  # the run's training time, recorded between checkpoints (`RunTracker.record_clock`)
CLOCK_EVERY_SECONDS = 10
RUN_OUTPUTS = ("checkpoint-*", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", RUN_RECORD, RUN_CLOCK)
LOCK_FILE = ".run.lock"  # locked by the run that uses the folder; holds its process id
REPLACED_RUN = ".replaced-run"  # the previous run's files, set aside until the run replacing it has saved
NOT_RUN_FILES = {LOCK_FILE, REPLACED_RUN}
# This process's folder locks (resolved folder -> file descriptor): held until the process ends, when the operating
# system releases them (a killed run too). A script run again in the same process keeps its lock.
HELD_LOCKS: dict[Path, int] = {}
# The folders whose previous run this process set aside and has not replaced yet: put back if the process fails.
SET_ASIDE: set[Path] = set()


@dataclass
class RunArguments:
    """The output folder, time budget and final weights of a run; mixed into every script's TrainingArguments."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a new run in an --output_dir that holds another run (or other files), removing its "
            "checkpoints and weights first; without it such a folder is refused. The same command run again always "
            "resumes its own run."
        },
    )
    max_train_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Time budget: stop training cleanly after this many minutes of training (summed over restarts, "
            "evaluations during training included) and save a checkpoint. --max_steps still applies."
        },
    )
    cooldown_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Cool the learning rate down linearly to zero over the last this many minutes of "
            "--max_train_minutes (the schedule's rate times the share of the cool-down left). A run that the clock "
            "stops does not know its last step in advance, so no step-based schedule can end there."
        },
    )
    eval_every_minutes: float | None = field(
        default=None, metadata={"help": "Also evaluate every this many minutes of training."}
    )
    save_every_minutes: float | None = field(
        default=None, metadata={"help": "Also save a checkpoint every this many minutes of training."}
    )
    average_last_checkpoints: int = field(
        default=0,
        metadata={
            "help": "After training, average the weights of the last k checkpoints (paper §6.1: 5). With --do_eval "
            "the averaged weights are kept only if they score better on the validation set (--metric_for_best_model, "
            "default loss), else the last weights are."
        },
    )

    def __post_init__(self):
        for name in ("max_train_minutes", "cooldown_minutes", "eval_every_minutes", "save_every_minutes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}.")
        if self.cooldown_minutes is not None and not (self.max_train_minutes or 0) >= self.cooldown_minutes:
            raise ValueError(
                f"--cooldown_minutes {self.cooldown_minutes} cools down the end of --max_train_minutes, which must be "
                f"set and at least as long (got {self.max_train_minutes})."
            )
        if self.average_last_checkpoints < 0:
            raise ValueError(f"--average_last_checkpoints must be 0 (off) or more, got {self.average_last_checkpoints}")
        if self.fp16 and (self.use_cpu or not torch.accelerator.is_available()):  # accelerate turns AMP off there
            raise ValueError(
                "--fp16 trains in float16 on an accelerator only; on a CPU it would silently train in float32: drop "
                "it (or pass --bf16 with --use_cpu)."
            )
        if not torch.accelerator.is_available():
            self.dataloader_pin_memory = False  # pinned memory only speeds up copies to an accelerator; torch warns
        super().__post_init__()
        noam = getattr(self, "noam_schedule", False)  # NoamArguments, in the scripts that mix them in
        if self.cooldown_minutes is not None and not noam and self.lr_scheduler_type in METRIC_DRIVEN_SCHEDULES:
            raise ValueError(
                f"--cooldown_minutes scales the learning-rate schedule step by step; --lr_scheduler_type "
                f"{self.lr_scheduler_type.value} sets the rate from evaluations instead. Choose one of them."
            )
        if self.average_last_checkpoints and self.save_strategy == SaveStrategy.NO:
            raise ValueError("--average_last_checkpoints averages saved checkpoints: it needs a --save_strategy.")
        if self.eval_every_minutes is not None and not self.do_eval:  # the Trainer would find no eval_dataset
            raise ValueError("--eval_every_minutes evaluates the validation set during training: it needs --do_eval.")


def run_record(arguments: tuple[Any, ...]) -> dict[str, Any]:
    """What defines a run: every argument of the script but those in NOT_PART_OF_THE_RUN, as JSON values."""
    values = {}
    for group in arguments:
        values.update(group.to_dict() if hasattr(group, "to_dict") else asdict(group))
    values = {name: value for name, value in values.items() if name not in NOT_PART_OF_THE_RUN}
    return json.loads(json.dumps(values, default=str, sort_keys=True))


def read_run_record(output_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((output_dir / RUN_RECORD).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # a record cut short was being written by a killed run
        return None


def write_run_record(output_dir: Path, record: dict[str, Any]) -> None:
    """Written under another name and renamed, so that a kill leaves the old record or the new one."""
    output_dir.mkdir(parents=True, exist_ok=True)
    partial = output_dir / f".{RUN_RECORD}.partial"
    partial.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(partial, output_dir / RUN_RECORD)


def differences(recorded: dict[str, Any], current: dict[str, Any], shown: int = 5) -> str:
    names = sorted(name for name in recorded.keys() | current.keys() if recorded.get(name) != current.get(name))
    listed = [f"--{name} {recorded.get(name)!r} there, {current.get(name)!r} here" for name in names[:shown]]
    return "; ".join(listed) + (f"; and {len(names) - shown} more" if len(names) > shown else "")


def is_run_output(path: Path) -> bool:
    return any(path.match(pattern) for pattern in RUN_OUTPUTS)


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def remove_interrupted_checkpoints(output_dir: Path, world_size: int) -> None:
    """Remove the checkpoints after the run's last complete one: their saves were killed, and the resumed run saves
    them again."""
    complete = complete_checkpoints(output_dir, world_size)
    last_step = checkpoint_step(complete[-1]) if complete else -1
    for path in sorted(output_dir.glob("checkpoint-*")):
        if (checkpoint_step(path) or -1) > last_step:
            logger.warning("Removing %s: its save was interrupted", path)
            shutil.rmtree(path)


def lock_output_dir(output_dir: Path) -> None:
    """Hold the folder's lock (`LOCK_FILE`, created with the folder where need be) for the rest of this process's
    life, or refuse the folder, naming the process that holds it."""
    folder = output_dir.resolve()
    if folder in HELD_LOCKS:
        return
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(descriptor, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(descriptor)
        raise ValueError(
            f"--output_dir {output_dir} is in use by another run (process {holder}): wait for it to end, or choose "
            "another --output_dir."
        ) from None
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    HELD_LOCKS[folder] = descriptor


def set_aside_previous_run(output_dir: Path) -> None:
    """Move every file of the folder's previous run into `REPLACED_RUN` (renames: nothing is copied or lost)."""
    aside = output_dir / REPLACED_RUN
    aside.mkdir()
    for path in sorted(output_dir.iterdir()):
        if path.name not in NOT_RUN_FILES:
            path.rename(aside / path.name)
    SET_ASIDE.add(output_dir.resolve())
    logger.warning("--overwrite_output_dir: the previous run is set aside in %s until this run has saved", aside)


def put_back_previous_run(output_dir: Path) -> None:
    """The run replacing the previous one failed before it saved: its files go, the previous run's come back."""
    aside = output_dir / REPLACED_RUN
    for path in output_dir.iterdir():
        if path.name not in NOT_RUN_FILES:
            remove(path)
    for path in aside.iterdir():
        path.rename(output_dir / path.name)
    aside.rmdir()
    SET_ASIDE.discard(output_dir.resolve())
    logger.warning("%s: the previous run is back as it was; the run replacing it did not save", output_dir)


def drop_previous_run(output_dir: Path) -> None:
    """The run replacing the previous one has saved: the previous run's checkpoints and weights go, and so do its
    files that the new run has written anew; its other files (notes, plots) come back."""
    aside = output_dir / REPLACED_RUN
    for path in sorted(aside.iterdir()):
        if is_run_output(path) or (output_dir / path.name).exists():
            logger.warning("--overwrite_output_dir: removing the previous run's %s", path.name)
            remove(path)
        else:
            path.rename(output_dir / path.name)
    aside.rmdir()
    SET_ASIDE.discard(output_dir.resolve())


def settle_previous_run(output_dir: Path) -> None:
    """A run killed while replacing another left the previous run set aside: dropped if the killed run had saved (a
    complete checkpoint, or its final model and state), else put back as it was."""
    if not (output_dir / REPLACED_RUN).is_dir():
        return
    if complete_checkpoints(output_dir) or (output_dir / TRAINER_STATE).is_file():
        drop_previous_run(output_dir)
    else:
        put_back_previous_run(output_dir)


def previous_run_replaced(output_dir: str | Path) -> None:
    """Call once the new run has saved: the previous run this process set aside there is dropped."""
    if Path(output_dir).resolve() in SET_ASIDE:
        drop_previous_run(Path(output_dir))


def keeps_the_previous_run(main: Callable[..., Any]) -> Callable[..., Any]:
    """A script's `main` that, whatever stops it (an error, Ctrl-C) before the new run has saved, puts back the
    previous run that --overwrite_output_dir set aside, file for file."""

    @functools.wraps(main)
    def guarded(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except BaseException:
            for folder in sorted(SET_ASIDE):
                put_back_previous_run(folder)
            raise

    return guarded


def check_resumed_checkpoint(checkpoint: str | None) -> None:
    if checkpoint is not None and not (Path(checkpoint) / TRAINER_STATE).is_file():
        found = f"not a checkpoint (no {TRAINER_STATE})" if Path(checkpoint).is_dir() else "no such folder"
        raise ValueError(f"--resume_from_checkpoint {checkpoint}: {found}.")


def check_checkpoint_model(model: torch.nn.Module, checkpoint: str | None) -> None:
    """The checkpoint a run resumes from holds a model of the script's class (its config's `architectures`): the
    Trainer would load another head's weights where their names match (a causal LM's from a masked LM's) and train
    on."""
    config = Path(checkpoint or "", "config.json")
    if checkpoint is None or not config.is_file():
        return
    saved = json.loads(config.read_text()).get("architectures") or []
    if saved and type(model).__name__ not in saved:
        raise ValueError(
            f"--resume_from_checkpoint {checkpoint} holds a {', '.join(saved)}; this script trains a "
            f"{type(model).__name__}: resume from a checkpoint of this script."
        )


@dataclass
class RunFolder:
    """What a run does to its --output_dir: decided by `check_output_dir` from reading it, done by
    `prepare_output_dir` once every other check has passed (`FolderPreparation`), so that a bad argument leaves the
    folder as it was."""

    training_args: Any
    record: dict[str, Any]
    replaces: bool = False  # --overwrite_output_dir on another run's folder: it is set aside until this run saves
    resumes: bool = False  # the same command again: the checkpoints its killed saves left go


def check_output_dir(arguments: tuple[Any, ...]) -> RunFolder | None:
    """Call first, once the arguments are parsed: refuse an --output_dir that is a file, that another process is
    using, or that holds another run (unless --overwrite_output_dir), and a --resume_from_checkpoint that is no
    checkpoint; set --resume_from_checkpoint to this run's last complete checkpoint when the same command runs again.
    Locks the folder where it exists and settles a replacement a killed run left half done; otherwise reads only
    (`prepare_output_dir` changes the folder). `arguments` are the script's argument dataclasses, TrainingArguments
    last; None without --do_train."""
    training_args = arguments[-1]
    output_dir = Path(training_args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output_dir {output_dir} is a file; give a folder.")
    if not training_args.do_train:
        return None
    check_resumed_checkpoint(training_args.resume_from_checkpoint)
    if output_dir.is_dir() and training_args.process_index == 0:
        lock_output_dir(output_dir)  # no other run changes the folder while this one reads and uses it
        settle_previous_run(output_dir)
    current = run_record(arguments)
    folder = RunFolder(training_args, current)
    world_size = training_args.world_size
    recorded, chosen = read_run_record(output_dir), training_args.resume_from_checkpoint
    not_the_runs = {RUN_RECORD, RUN_CLOCK, *NOT_RUN_FILES}
    holds_files = output_dir.is_dir() and any(path.name not in not_the_runs for path in output_dir.iterdir())
    if chosen is not None and (not holds_files or Path(chosen).resolve().parent == output_dir.resolve()):
        pass  # the user's checkpoint continues its run here, with these arguments from now on
    elif chosen is None and recorded == current:
        folder.resumes = True
        complete = complete_checkpoints(output_dir, world_size)
        if complete:
            logger.info("%s holds this run: resuming from %s", output_dir, complete[-1].name)
            training_args.resume_from_checkpoint = str(complete[-1])
    elif holds_files:
        if not training_args.overwrite_output_dir:
            held = f"another run ({differences(recorded, current)})" if recorded else f"files but no {RUN_RECORD}"
            complete = complete_checkpoints(output_dir, world_size) if recorded else []
            resume = f", or --resume_from_checkpoint {complete[-1]} to continue that run" if complete else ""
            raise ValueError(
                f"--output_dir {output_dir} holds {held}. Pass --overwrite_output_dir to replace it (its "
                f"checkpoints and weights are removed once the new run has saved), another --output_dir{resume}."
            )
        folder.replaces = True
    return folder


def prepare_output_dir(folder: RunFolder | None) -> None:
    """Do what `check_output_dir` decided (set aside another run, or remove the checkpoints of this run's killed
    saves) and record the run's arguments, on the main process while the others wait."""
    if folder is None:
        return
    training_args = folder.training_args
    output_dir = Path(training_args.output_dir)
    PartialState().wait_for_everyone()  # every process has read the folder as it was
    with training_args.main_process_first(desc="preparing the output directory"):
        if training_args.process_index == 0:
            lock_output_dir(output_dir)  # where the folder is new, it is created and locked now
            if folder.replaces:
                set_aside_previous_run(output_dir)
            if folder.resumes:
                remove_interrupted_checkpoints(output_dir, training_args.world_size)
            write_run_record(output_dir, folder.record)


class FolderPreparation(TrainerCallback):
    """`prepare_output_dir`, once, when training begins: after the script has checked its arguments, data and model
    and the Trainer has built the optimizer and schedule from their flags, wrapped the model and loaded the checkpoint
    it resumes from, each of which can still refuse an argument. The previous run it set aside goes at the first
    checkpoint (or at the final save, `RunTrainerMixin.save_model`)."""

    def __init__(self, folder: RunFolder | None):
        self.folder = folder

    def prepare(self) -> None:
        folder, self.folder = self.folder, None  # a second train() must not remove the first one's checkpoints
        prepare_output_dir(folder)

    def on_train_begin(self, args, state, control, **kwargs):
        self.prepare()

    def on_save(self, args, state, control, **kwargs):
        previous_run_replaced(args.output_dir)


class TrainingDiverged(RuntimeError):
    """A non-finite loss, gradient norm or weights: nothing from that step on is saved."""


def diverged(args: Any, state: TrainerState, what: str) -> TrainingDiverged:
    complete = complete_checkpoints(args.output_dir) if Path(args.output_dir).is_dir() else []
    kept = f"the last good checkpoint is {complete[-1]}" if complete else "no checkpoint was saved before"
    return TrainingDiverged(
        f"Training diverged at step {state.global_step}: {what}. Stopped without saving from this step on; {kept}. "
        "Lower --learning_rate, lengthen --warmup_steps or clip gradients (--max_grad_norm)."
    )


class StopOnNonFiniteLoss(TrainerCallback):
    """Stops training with `TrainingDiverged` at a logged loss or gradient norm that is NaN or infinite (read from the
    logs: no extra host sync). The Trainer logs before it saves at a step, so no checkpoint of that step is written.
    Under --fp16, loss scaling skips the steps whose gradients overflow, so only the loss is watched there."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        watched = ("loss",) if args.fp16 else ("loss", "grad_norm")
        bad = {name: value for name, value in (logs or {}).items() if name in watched and not math.isfinite(value)}
        if bad:
            raise diverged(args, state, ", ".join(f"{name} {value}" for name, value in bad.items()))


def finite_weights(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite (each process checks its own shard), with one host sync."""
    local = [getattr(parameter, "to_local", lambda p=parameter: p)() for parameter in model.parameters()]
    return not local or bool(torch.stack([tensor.isfinite().all() for tensor in local]).all())


def disk_full(error: BaseException, folder: Path) -> bool:
    """Whether `error` (or an error it came from) is a write that failed for want of space: ENOSPC, or torch's file
    writer failing (it reports no errno) on a file system with less than 64 MiB left."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    if any(getattr(link, "errno", None) == errno.ENOSPC or "No space left" in str(link) for link in chain):
        return True
    torch_writer_failed = any(word in str(link) for link in chain for word in ("unexpected pos", "file write failed"))
    existing = next((path for path in (folder, *folder.parents) if path.exists()), Path("/"))
    return torch_writer_failed and shutil.disk_usage(existing).free < 64 * 2**20


@contextmanager
def disk_errors_named(folder: str | Path) -> Iterator[None]:
    """A save that fails because the disk is full raises OSError(ENOSPC) saying so, naming --output_dir."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        if not disk_full(error, Path(folder)):
            raise
        raise OSError(
            errno.ENOSPC,
            f"No space left on device while saving into --output_dir {folder} ({error}). Free space, then run the "
            "same command again: it resumes from the last complete checkpoint",
        ) from error


class RunTracker(TrainerCallback, ExportableState):
    """A run's id and training time, saved in every checkpoint's trainer_state.json and taken back from the
    checkpoint a run resumes from. Stops training at `max_train_minutes` (and saves), evaluates and saves every
    `eval_every_minutes`/`save_every_minutes`, all counted in training time; gives the learning-rate factor of the
    budget's last `cooldown_minutes`."""

    def __init__(
        self,
        max_train_minutes: float | None = None,
        eval_every_minutes: float | None = None,
        save_every_minutes: float | None = None,
        clock: Callable[[], float] | None = None,
        cooldown_minutes: float | None = None,
    ):
        self.max_train_minutes = max_train_minutes
        self.cooldown_minutes = cooldown_minutes
        self.every_minutes = {"evaluate": eval_every_minutes, "save": save_every_minutes}
        self.clock = clock or time.monotonic
        self.run_id = uuid.uuid4().hex
        self.train_seconds = 0.0  # training time before this process started (or resumed) training
        self.started_at: float | None = None
        self.next_at: dict[str, float] = {}
        self.clock_recorded_at = -math.inf

    def elapsed_seconds(self) -> float:
        running = self.clock() - self.started_at if self.started_at is not None else 0.0
        return self.train_seconds + running

    def learning_rate_factor(self) -> float:
        """1 until the cool-down begins, then the share of it left: linearly down to 0 when the budget ends."""
        if not self.cooldown_minutes:
            return 1.0
        seconds_left = 60 * self.max_train_minutes - self.elapsed_seconds()
        return min(1.0, max(0.0, seconds_left / (60 * self.cooldown_minutes)))

    def state(self) -> dict:
        args = {
            "max_train_minutes": self.max_train_minutes,
            "eval_every_minutes": self.every_minutes["evaluate"],
            "save_every_minutes": self.every_minutes["save"],
        }
        return {"args": args, "attributes": {"run_id": self.run_id, "train_seconds": self.elapsed_seconds()}}

    def next_time(self, action: str, elapsed: float) -> float:
        """The first multiple of the action's interval after `elapsed` seconds."""
        interval = 60 * self.every_minutes[action]
        return (elapsed // interval + 1) * interval

    @staticmethod
    def saved_attributes(stateful_callbacks: dict) -> dict[str, Any]:
        saved = stateful_callbacks.get(RunTracker.__name__, {})
        return saved.get("attributes", {}) if isinstance(saved, dict) else {}

    def restore(self, state: TrainerState) -> None:
        """Take the run id and training time from the state (a resumed run's: its checkpoint's)."""
        attributes = self.saved_attributes(state.stateful_callbacks)
        self.run_id = attributes.get("run_id", self.run_id)
        self.train_seconds = attributes.get("train_seconds", self.train_seconds)

    def record_clock(self, output_dir: str, state: TrainerState, elapsed: float) -> None:
        """Every `CLOCK_EVERY_SECONDS` of training, the run's training time (`elapsed`) goes to `RUN_CLOCK` beside its
        checkpoints, so that a run killed after its last checkpoint still counts the time it trained since."""
        if not state.is_world_process_zero or elapsed - self.clock_recorded_at < CLOCK_EVERY_SECONDS:
            return
        partial = Path(output_dir, f"{RUN_CLOCK}.partial")
        partial.write_text(json.dumps({"run_id": self.run_id, "train_seconds": elapsed}))
        os.replace(partial, Path(output_dir, RUN_CLOCK))  # a kill leaves the old record or the new one
        self.clock_recorded_at = elapsed

    def add_time_lost(self, output_dir: str) -> None:
        """The training time this run recorded after the checkpoint it resumes from (its steps are trained again)."""
        try:
            recorded = json.loads(Path(output_dir, RUN_CLOCK).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return
        if recorded.get("run_id") == self.run_id and recorded.get("train_seconds", 0) > self.train_seconds:
            lost = recorded["train_seconds"] - self.train_seconds
            logger.info("Counting the %.1f s this run trained after its checkpoint before it stopped", lost)
            self.train_seconds = recorded["train_seconds"]

    def on_train_begin(self, args, state, control, **kwargs):
        self.restore(state)
        self.add_time_lost(args.output_dir)
        self.started_at = self.clock()
        actions = [action for action, minutes in self.every_minutes.items() if minutes]
        self.next_at = {action: self.next_time(action, self.train_seconds) for action in actions}

    def on_step_end(self, args, state, control, **kwargs):
        elapsed = self.elapsed_seconds()
        stop = self.max_train_minutes is not None and elapsed >= 60 * self.max_train_minutes
        for action, at in self.next_at.items():
            if elapsed >= at:
                self.next_at[action] = self.next_time(action, elapsed)
                if not (stop and action == "evaluate"):  # the evaluation after training comes next anyway
                    setattr(control, f"should_{action}", True)
        if stop:
            logger.info("The %s-minute time budget ends training at step %d", self.max_train_minutes, state.global_step)
            control.should_training_stop = True
            control.should_save = args.save_strategy != SaveStrategy.NO
        self.log_before_saving(control)
        self.record_clock(args.output_dir, state, elapsed)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.log_before_saving(control)

    @staticmethod
    def log_before_saving(control) -> None:
        """Every checkpoint's log history ends with the loss of its last step (`whole_run_train_loss`)."""
        control.should_log = control.should_log or control.should_save

    def on_train_end(self, args, state, control, **kwargs):
        self.train_seconds, self.started_at = self.elapsed_seconds(), None  # the clock stops with training


class RunTrainerMixin(Trainer):
    """A Trainer with a RunTracker built from the RunArguments; its logs carry the run's training minutes, and its
    learning-rate schedule cools down with --cooldown_minutes. `run_folder` (`check_output_dir`'s) is prepared when
    training begins."""

    def __init__(self, *args, run_folder: RunFolder | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        options = self.args
        minutes = (options.max_train_minutes, options.eval_every_minutes, options.save_every_minutes)
        self.add_callback(RunTracker(*minutes, cooldown_minutes=options.cooldown_minutes))
        self.add_callback(FolderPreparation(run_folder))
        self.add_callback(StopOnNonFiniteLoss())
        if options.average_last_checkpoints and self.is_fsdp_enabled:  # known once the accelerator is set up
            raise ValueError("--average_last_checkpoints loads whole weights into the model, which FSDP shards.")
        if options.do_train:
            check_checkpoint_model(self.model, options.resume_from_checkpoint)

    def train(self, *args, **kwargs):
        with disk_errors_named(self.args.output_dir):  # the checkpoints are saved in there
            return super().train(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Saves finite weights only (`TrainingDiverged` otherwise: the last good checkpoint stays the last); a full
        disk is named. The final save (not a checkpoint's) replaces the previous run of the folder, if any."""
        if not finite_weights(self.model):
            raise diverged(self.args, self.state, "the weights to save are not all finite")
        with disk_errors_named(self.args.output_dir):
            super().save_model(output_dir, _internal_call)
        if not _internal_call and self.args.should_save:
            previous_run_replaced(self.args.output_dir)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        new = self.lr_scheduler is None
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if new and self.args.cooldown_minutes:
            if not isinstance(scheduler, LambdaLR):
                raise ValueError(
                    f"--cooldown_minutes scales a LambdaLR schedule (the Noam schedule, or --lr_scheduler_type linear, "
                    f"cosine, constant, ...); {type(scheduler).__name__} is not one."
                )
            factor = self.run_tracker.learning_rate_factor  # read on the host: the clock, no device value
            scheduler.lr_lambdas = [lambda step, rate=rate: rate(step) * factor() for rate in scheduler.lr_lambdas]
        return scheduler

    def callback_of(self, kind: type[TrainerCallback]) -> Any:
        return next(callback for callback in self.callback_handler.callbacks if isinstance(callback, kind))

    @property
    def run_tracker(self) -> RunTracker:
        return self.callback_of(RunTracker)

    @property
    def folder_preparation(self) -> FolderPreparation:
        return self.callback_of(FolderPreparation)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs["train_minutes"] = round(self.run_tracker.elapsed_seconds() / 60, 4)
        super().log(logs, start_time)


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load saved weights. Those missing may be the tied ones (save_pretrained stores a tied weight once) and those
    the model's class says a checkpoint may lack (`_keys_to_ignore_on_load_missing`, regular expressions: HF Marian's
    fixed sinusoid tables, which it never saves); the model keeps its own values of those."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", {}))
    may_lack = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    lacking = [name for name in missing if name not in tied and not any(re.search(key, name) for key in may_lack)]
    if lacking or unexpected:
        raise ValueError(f"Weights do not fit the model: missing {sorted(lacking)}, unexpected {unexpected}.")


def keep_last_or_averaged_weights(trainer: Trainer, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Average the run's last --average_last_checkpoints checkpoints into the model. With --do_eval, evaluate both
    the last and the averaged weights and keep the better ones by --metric_for_best_model (the validation set makes
    the choice); returns the kept weights' evaluation and how many checkpoints they average (1: the last weights)."""
    args = trainer.args
    last_k = min(args.average_last_checkpoints, len(complete_checkpoints(args.output_dir)))
    if last_k < args.average_last_checkpoints:  # a time budget ran out before k checkpoints were saved
        logger.warning("Only %d checkpoints to average, not %d", last_k, args.average_last_checkpoints)
    if last_k < 2:
        return (evaluate() if args.do_eval else {}) | {"averaged_checkpoints": 1}
    checkpoints = last_checkpoints(args.output_dir, last_k)
    averaged = averaged_weights(checkpoints)
    logger.info("Averaging %s", [path.name for path in checkpoints])
    if not args.do_eval:
        load_weights(trainer.model, averaged)
        return {"averaged_checkpoints": len(checkpoints)}
    last_weights = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    last_metrics = evaluate()
    load_weights(trainer.model, averaged)
    averaged_metrics = evaluate()
    metric = "eval_" + (args.metric_for_best_model or "loss").removeprefix("eval_")
    better = operator.gt if args.greater_is_better else operator.lt
    keep_averaged = better(averaged_metrics[metric], last_metrics[metric])
    if not keep_averaged:
        load_weights(trainer.model, last_weights)
    comparison = {f"{metric}_last": last_metrics[metric], f"{metric}_averaged": averaged_metrics[metric]}
    comparison["averaged_checkpoints"] = len(checkpoints) if keep_averaged else 1
    trainer.log(dict(comparison))  # log() adds its own fields to the dict it gets
    return (averaged_metrics if keep_averaged else last_metrics) | comparison


def finished_run(checkpoint: Path, args: Any) -> bool:
    """Whether the checkpoint ends its run: its step reaches --max_steps (or the epochs' steps) or its training time
    the time budget. The Trainer resumed from such a checkpoint would still take one more step."""
    state = trainer_state(checkpoint)
    seconds = RunTracker.saved_attributes(state.get("stateful_callbacks", {})).get("train_seconds", 0.0)
    max_steps = args.max_steps if args.max_steps > 0 else state["max_steps"]
    return state["global_step"] >= max_steps or (args.max_train_minutes or float("inf")) * 60 <= seconds


def whole_run_train_loss(state: TrainerState, resumed_at: int, resumed_loss: float) -> float:
    """The mean training loss of every step of a run resumed at step `resumed_at`, from the Trainer's mean over the
    steps after it and the losses logged before it (each the mean of its steps since the previous log; the run logs
    at every save, so they reach the checkpoint's step). The resumed mean alone where they do not (a checkpoint of an
    older version)."""
    logged, previous, total = [e for e in state.log_history if "loss" in e and e["step"] <= resumed_at], 0, 0.0
    for entry in logged:
        total, previous = total + entry["loss"] * (entry["step"] - previous), entry["step"]
    if previous != resumed_at:
        logger.warning("train_loss covers the steps after %d only: the checkpoint logged no loss there", resumed_at)
        return resumed_loss
    return (total + resumed_loss * (state.global_step - resumed_at)) / state.global_step


def train_and_choose_weights(trainer: Trainer, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
    """--do_train (resuming from --resume_from_checkpoint, which check_output_dir sets when the run resumes; a
    checkpoint that ends the run is loaded, not trained on), then the weights to keep (--average_last_checkpoints;
    with --do_eval, `evaluate` scores both candidates and the kept weights' evaluation is returned)."""
    args = trainer.args
    if not args.do_train:
        return {}
    checkpoint = Path(args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    resumed_at = trainer_state(checkpoint)["global_step"] if checkpoint is not None else 0
    if checkpoint is not None and finished_run(checkpoint, args):
        logger.info("%s ends the run: its weights are loaded, nothing is trained", checkpoint)
        load_weights(trainer.model, checkpoint_weights(checkpoint))  # refused before the folder changes
        trainer.folder_preparation.prepare()  # no training begins to do it
        trainer.state = TrainerState.load_from_json(str(checkpoint / TRAINER_STATE))
        trainer.run_tracker.restore(trainer.state)
        metrics = {"train_minutes": round(trainer.run_tracker.elapsed_seconds() / 60, 4)}
    else:
        metrics = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).metrics
        if resumed_at:
            metrics["train_loss"] = whole_run_train_loss(trainer.state, resumed_at, metrics["train_loss"])
    if trainer.args.average_last_checkpoints:
        metrics |= keep_last_or_averaged_weights(trainer, evaluate)
    return metrics


def train_and_evaluate(trainer: Trainer, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
    """train_and_choose_weights, then --do_eval through `evaluate` unless choosing the weights evaluated them."""
    args = trainer.args
    metrics = train_and_choose_weights(trainer, evaluate)
    if args.do_eval and not (args.do_train and args.average_last_checkpoints):
        metrics |= evaluate()
    return metrics
