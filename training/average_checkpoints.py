"""Average the weights of the last k checkpoints of a run (paper §6.1: the last 5 for base models, 20 for big).

Checkpoints are the `checkpoint-<step>` directories the Trainer writes (keep enough with --save_total_limit). Only
complete checkpoints count (a save that was interrupted leaves no `trainer_state.json`, which the Trainer writes
last), and only checkpoints of one run: the training scripts stamp each checkpoint with their run's id, and
checkpoints with different ids are never averaged together. The output directory is a copy of the newest
checkpoint's model files (config, tokenizer, code) with averaged weights, loadable with `from_pretrained` like any
saved model.

    python training/average_checkpoints.py --run_dir out/demo --last_k 5 --output_dir out/demo-averaged
"""

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

# What a checkpoint holds besides the model: not copied into the averaged model (rng_state*.pth: one per process).
TRAINING_STATE_FILES = ("optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin", "rng_state")
TRAINER_STATE = "trainer_state.json"
RUN_TRACKER = "RunTracker"  # the training scripts' callback (run_common.RunTracker) that stamps the run id


def checkpoint_step(path: Path) -> int | None:
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(match.group(1)) if match and path.is_dir() else None


def trainer_state(checkpoint: Path) -> dict | None:
    """The checkpoint's trainer_state.json, or None where it is missing or cut short."""
    try:
        return json.loads((checkpoint / TRAINER_STATE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_complete(checkpoint: Path, world_size: int = 1) -> bool:
    """The Trainer writes a checkpoint's weights, optimizer, scheduler and RNG states before its trainer_state.json,
    so a state that parses and names the folder's step marks a save that finished (with several processes, each
    process's RNG state must be there too: the others write theirs alongside the main process)."""
    state = trainer_state(checkpoint)
    if state is None or state.get("global_step") != checkpoint_step(checkpoint):
        return False
    return world_size == 1 or all((checkpoint / f"rng_state_{rank}.pth").is_file() for rank in range(world_size))


def run_id(checkpoint: Path) -> str | None:
    """The id of the run that saved the checkpoint (None for checkpoints of other scripts)."""
    callback = (trainer_state(checkpoint) or {}).get("stateful_callbacks", {}).get(RUN_TRACKER, {})
    return callback.get("attributes", {}).get("run_id")


def complete_checkpoints(run_dir: str | Path, world_size: int = 1) -> list[Path]:
    """The complete checkpoint directories of `run_dir`, oldest first."""
    steps = {checkpoint_step(path): path for path in Path(run_dir).iterdir()}
    steps.pop(None, None)
    return [steps[step] for step in sorted(steps) if is_complete(steps[step], world_size)]


def last_checkpoints(run_dir: str | Path, last_k: int) -> list[Path]:
    """The `last_k` complete checkpoints of `run_dir` with the highest step numbers, oldest first, all of one run."""
    if last_k < 1:
        raise ValueError(f"last_k must be at least 1, got {last_k}.")
    checkpoints = complete_checkpoints(run_dir)
    if len(checkpoints) < last_k:
        raise ValueError(f"{run_dir} has {len(checkpoints)} complete checkpoints, fewer than last_k={last_k}.")
    checkpoints = checkpoints[-last_k:]
    runs = {path.name: run_id(path) for path in checkpoints}
    if len(set(runs.values())) > 1:
        raise ValueError(f"The last {last_k} checkpoints of {run_dir} come from different runs (run ids {runs}).")
    return checkpoints


def average_state_dicts(state_dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of floating-point tensors (accumulated in float64); other tensors are taken from the last."""
    if not state_dicts:
        raise ValueError("Nothing to average.")
    keys = state_dicts[-1].keys()
    for index, state_dict in enumerate(state_dicts):
        if state_dict.keys() != keys:
            raise ValueError(f"Checkpoint {index} has different tensors: {sorted(state_dict.keys() ^ keys)[:5]}.")
    averaged = {}
    for key, last in state_dicts[-1].items():
        if last.is_floating_point():
            total = sum(state_dict[key].to(torch.float64) for state_dict in state_dicts)
            averaged[key] = (total / len(state_dicts)).to(last.dtype)
        else:
            averaged[key] = last.clone()
    return averaged


def weight_shards(checkpoint: Path) -> list[Path]:
    shards = sorted(checkpoint.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{checkpoint} holds no *.safetensors weights.")
    return shards


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """All the checkpoint's weight shards as one state dict."""
    return {name: tensor for shard in weight_shards(checkpoint) for name, tensor in load_file(str(shard)).items()}


def averaged_weights(checkpoints: list[Path]) -> dict[str, torch.Tensor]:
    """The averaged weights in memory (for a model that is in memory anyway)."""
    return average_state_dicts([checkpoint_weights(checkpoint) for checkpoint in checkpoints])


def average_checkpoints(checkpoints: list[Path], output_dir: str | Path) -> Path:
    """Write the averaged model to `output_dir` and return it. Works shard by shard (`*.safetensors`)."""
    newest = checkpoints[-1]
    shards = weight_shards(newest)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for path in newest.iterdir():  # config, generation config, tokenizer, code files, shard index
        if path.is_file() and path.suffix != ".safetensors" and not path.name.startswith(TRAINING_STATE_FILES):
            shutil.copy(path, output_dir / path.name)
    for shard in shards:
        with safe_open(str(shard), framework="pt") as file:
            metadata = file.metadata()
        averaged = average_state_dicts([load_file(str(checkpoint / shard.name)) for checkpoint in checkpoints])
        save_file(averaged, str(output_dir / shard.name), metadata=metadata)
    return output_dir


# What marks a folder as holding a run or a model that averaging into it would replace or mix with.
RUN_FILES = ("checkpoint-*", "*.safetensors", "run_arguments.json", TRAINER_STATE)


def output_dir_refusal(output_dir: Path, run_dir: Path) -> str | None:
    """Why the averaged model may not go to `output_dir`, or None: it is a file, the run averaged (its kept final
    weights would be replaced), or holds a run, a checkpoint or a model."""
    if output_dir.exists() and not output_dir.is_dir():
        return "is a file"
    if output_dir.resolve() == run_dir.resolve():
        return "is the run averaged (its final weights would be replaced)"
    held = next((path for pattern in RUN_FILES for path in sorted(output_dir.glob(pattern))), None)
    return f"holds a run or a model ({held.name})" if held else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run_dir", required=True, help="A training output directory with checkpoint-* folders.")
    parser.add_argument("--last_k", type=int, default=5, help="How many of the newest checkpoints (paper: 5).")
    parser.add_argument("--output_dir", required=True, help="Where to write the averaged model.")
    args = parser.parse_args()
    refusal = output_dir_refusal(Path(args.output_dir), Path(args.run_dir))
    if refusal:
        parser.error(f"--output_dir {args.output_dir} {refusal}; give a new or empty folder.")
    checkpoints = last_checkpoints(args.run_dir, args.last_k)
    average_checkpoints(checkpoints, args.output_dir)
    print(f"Averaged {[path.name for path in checkpoints]} into {args.output_dir}")


if __name__ == "__main__":
    main()
