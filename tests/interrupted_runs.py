"""Helper of tests/test_interrupted_runs.py: train_seq2seq.py's main run to its end, and SIGKILLed at chosen points
then run again with the same arguments, each in a child forked from this process (one import for all runs).

    python tests/interrupted_runs.py ROOT ARGUMENTS...   # train_seq2seq.py's arguments without --output_dir

For each scenario ROOT/<scenario> is the run's --output_dir, ROOT/<scenario>-as-killed a copy of it as the kill left
it, ROOT/<scenario>.stderr what the runs wrote; ROOT/statuses.json holds how each child ended.
"""

import json
import os
import shutil
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

import safetensors.torch  # noqa: E402
import train_seq2seq  # noqa: E402
import transformers.modeling_utils  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

KILL_AT_STEP = 6  # between the checkpoints of steps 4 and 8
CHECKPOINT_KILLED_IN_SAVE = "checkpoint-8"


def kill_this_process() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAtStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == KILL_AT_STEP:
            kill_this_process()


def kill_while_writing_weights_into(folder: Path) -> None:
    """The next time save_pretrained writes weights into `folder`, write half the file, then die."""
    write_weights = transformers.modeling_utils.safe_save_file

    def half_then_kill(tensors, filename, metadata=None):
        if Path(filename).parent.resolve() != folder.resolve():
            return write_weights(tensors, filename, metadata=metadata)
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(filename, "wb") as file:
            file.write(data[: len(data) // 2])
        kill_this_process()

    transformers.modeling_utils.safe_save_file = half_then_kill


def arm(scenario: str, output_dir: Path) -> None:
    if scenario == "killed_in_training":
        trainer_class = train_seq2seq.PaperSeq2SeqTrainer

        class KillingTrainer(trainer_class):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.add_callback(KillAtStep())

        train_seq2seq.PaperSeq2SeqTrainer = KillingTrainer
    elif scenario == "killed_in_checkpoint_save":
        kill_while_writing_weights_into(output_dir / CHECKPOINT_KILLED_IN_SAVE)
    elif scenario == "killed_in_final_save":
        kill_while_writing_weights_into(output_dir)


def run_child(scenario: str | None, argv: list[str], stderr_path: Path) -> str:
    """Run main(argv) in a forked child, armed to die at the scenario's point; how it ended."""
    pid = os.fork()
    if pid == 0:
        with open(stderr_path, "a") as stderr:
            os.dup2(stderr.fileno(), 2)
        try:
            if scenario is not None:
                arm(scenario, Path(argv[argv.index("--output_dir") + 1]))
            train_seq2seq.main(argv)
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return f"exit {os.WEXITSTATUS(status)}"


def main() -> None:
    root, arguments = Path(sys.argv[1]), sys.argv[2:]
    statuses = {}
    for scenario in ["uninterrupted", "killed_in_training", "killed_in_checkpoint_save", "killed_in_final_save"]:
        output_dir, stderr = root / scenario, root / f"{scenario}.stderr"
        argv = [*arguments, "--output_dir", str(output_dir)]
        if scenario == "uninterrupted":
            statuses[scenario] = [run_child(None, argv, stderr)]
            continue
        statuses[scenario] = [run_child(scenario, argv, stderr)]
        shutil.copytree(output_dir, root / f"{scenario}-as-killed")
        statuses[scenario].append(run_child(None, argv, stderr))  # the same command again
    (root / "statuses.json").write_text(json.dumps(statuses))


if __name__ == "__main__":
    main()
