"""Runs a training script as one rank of a job (`python ended_rank.py script.py args...`, as `python script.py
args...`), then fails the rank if the script left its process group alive: a rank that exits with it alive can abort
while the group's threads are torn down and take the job down with it."""

import runpy
import sys
from pathlib import Path

import torch.distributed as dist

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(script).parent))  # as `python script.py` puts the script's folder first
runpy.run_path(script, run_name="__main__")
if dist.is_initialized():
    sys.exit(f"{script} ended with its process group alive: end the job with accelerate's end_training().")
