"""Average the weights of the last k checkpoints of a run (paper §6.1: the last 5 for base models, 20 for big).

Checkpoints are the `checkpoint-<step>` directories the Trainer writes (keep enough with --save_total_limit). The
output directory is a copy of the newest checkpoint's model files (config, tokenizer, code) with averaged weights,
loadable with `from_pretrained` like any saved model.

    python training/average_checkpoints.py --run_dir out/demo --last_k 5 --output_dir out/demo-averaged
"""

import argparse
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

TRAINING_STATE_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "training_args.bin")


def last_checkpoints(run_dir: str | Path, last_k: int) -> list[Path]:
    """The `last_k` checkpoint directories of `run_dir` with the highest step numbers, oldest first."""
    if last_k < 1:
        raise ValueError(f"last_k must be at least 1, got {last_k}.")
    steps = {}
    for path in Path(run_dir).iterdir():
        match = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if match and path.is_dir():
            steps[int(match.group(1))] = path
    if len(steps) < last_k:
        raise ValueError(f"{run_dir} has {len(steps)} checkpoints, fewer than last_k={last_k}.")
    return [steps[step] for step in sorted(steps)[-last_k:]]


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


def average_checkpoints(checkpoints: list[Path], output_dir: str | Path) -> Path:
    """Write the averaged model to `output_dir` and return it. Works shard by shard (`*.safetensors`)."""
    newest = checkpoints[-1]
    shards = sorted(newest.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{newest} holds no *.safetensors weights.")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for path in newest.iterdir():  # config, generation config, tokenizer, code files, shard index
        if path.is_file() and path.suffix != ".safetensors" and path.name not in TRAINING_STATE_FILES:
            shutil.copy(path, output_dir / path.name)
    for shard in shards:
        with safe_open(str(shard), framework="pt") as file:
            metadata = file.metadata()
        averaged = average_state_dicts([load_file(str(checkpoint / shard.name)) for checkpoint in checkpoints])
        save_file(averaged, str(output_dir / shard.name), metadata=metadata)
    return output_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run_dir", required=True, help="A training output directory with checkpoint-* folders.")
    parser.add_argument("--last_k", type=int, default=5, help="How many of the newest checkpoints (paper: 5).")
    parser.add_argument("--output_dir", required=True, help="Where to write the averaged model.")
    args = parser.parse_args()
    checkpoints = last_checkpoints(args.run_dir, args.last_k)
    average_checkpoints(checkpoints, args.output_dir)
    print(f"Averaged {[path.name for path in checkpoints]} into {args.output_dir}")


if __name__ == "__main__":
    main()
