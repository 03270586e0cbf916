"""Two CPU processes (gloo) train a MoE seq2seq model under DistributedDataParallel. tests/test_moe.py starts the two
ranks itself (RANK, WORLD_SIZE and a file-store INIT_METHOD in the environment); by hand,
`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ddp_moe_script.py` works too.

`find_unused_parameters=False` (the Trainer's default) makes DDP raise at the next step if any parameter got no
gradient; each rank sees different data, so different experts are hit (and dropped) on each.
"""

import os

import torch
import torch.distributed as dist
from conftest import tiny_config
from torch.nn.parallel import DistributedDataParallel

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration


def main() -> None:
    dist.init_process_group(
        "gloo",
        init_method=os.environ.get("INIT_METHOD", "env://"),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on both ranks
    config = tiny_config(num_experts=4, num_experts_per_tok=2, num_shared_experts=1, expert_capacity_factor=1.0)
    model = VanillaTransformerForConditionalGeneration(config).train()
    model.set_experts_implementation("eager")  # the per-expert loop: only the experts a rank's tokens hit run
    ddp = DistributedDataParallel(model, find_unused_parameters=False)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(100 + rank)  # different batches per rank
    for _ in range(4):
        source = torch.randint(3, config.vocab_size, (4, 6), generator=generator)
        ddp(input_ids=source, labels=source.flip(1)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    if not torch.equal(gathered[0], gathered[1]):
        raise RuntimeError("ranks diverged: gradients were not all-reduced")
    dist.destroy_process_group()
    print(f"DDP OK rank {rank}", flush=True)
    # Exit before `ddp` is freed: freeing DDP's reducer destroys the gloo process group it still holds, which joins
    # gloo's worker thread while holding the GIL, and that thread may still be releasing the last collective's
    # tensors, which needs the GIL (a deadlock seen in one clean-clone CI run in two). Nothing is left to clean up.
    os._exit(0)


if __name__ == "__main__":
    main()
