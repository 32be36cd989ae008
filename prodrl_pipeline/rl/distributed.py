"""Data-parallel training over whole trajectories with FSDP2 (`fully_shard`), under `torchrun`.

Each rank takes a share of every minibatch's trajectories (balanced by completion tokens) and
weights its tokens with the global (1/B)(1/T_i), so the gradients summed over ranks are the
single-process gradient (FSDP2 averages over ranks, so each rank's loss is scaled by the world
size). Every forward and backward of a sharded model is collective, so every rank runs
the same number of microbatches (a rank with fewer repeats one with weight 0). Metrics are reduced
over ranks, so every rank returns the same rows. With CUDA each rank trains on its own GPU
(LOCAL_RANK) over NCCL; without, on the CPU over gloo (tested here with 2 processes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import PreTrainedModel

from prodrl_pipeline.model import load_model
from prodrl_pipeline.rl.checkpoint import load_checkpoint, save_checkpoint
from prodrl_pipeline.rl.logprobs import Sequences, TokenLogprobs, token_logprobs
from prodrl_pipeline.rl.trainer import TrainerConfig, make_optimizer


class LogprobModule(torch.nn.Module):
    """`token_logprobs` as one module forward, so that FSDP2 (whose root this is) keeps the
    embedding, final norm and tied output projection gathered for the whole computation; returns
    the fields of TokenLogprobs as a tuple (FSDP2 hooks the tensors of a forward's outputs)."""

    def __init__(self, model: PreTrainedModel):
        super().__init__()
        self.model = model

    def forward(
        self, seqs: Sequences, chunk_tokens: int, w_hat: dict | None, outputs: frozenset[str]
    ) -> tuple:
        lp = token_logprobs(self.model, seqs, chunk_tokens, w_hat, outputs)
        return tuple(getattr(lp, f.name) for f in fields(lp))


@dataclass
class DataParallel:
    """This process's place in the data-parallel group, and the sharded policy it trains."""

    rank: int
    world: int
    device: torch.device = torch.device("cpu")
    module: LogprobModule | None = None
    """Set by `shard_model`."""

    def token_logprobs(
        self, seqs: Sequences, chunk_tokens: int, w_hat: dict | None, outputs: frozenset[str]
    ) -> TokenLogprobs:
        return TokenLogprobs(*self.module(seqs, chunk_tokens, w_hat, outputs))

    @classmethod
    def from_environment(cls) -> DataParallel:
        """The group torchrun started (initialized here if it is not yet): NCCL and the GPU
        LOCAL_RANK when CUDA is available, else gloo on the CPU."""
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), device)

    def share(self, tokens: dict[str, int]) -> set[str]:
        """This rank's trajectories of a minibatch (`tokens`: trajectory id -> completion tokens):
        longest first, each to the rank with the fewest tokens so far (ties to the lower rank);
        the same on every rank. A rank may get none (a minibatch smaller than the group)."""
        load = [0] * self.world
        mine = set()
        for t in sorted(tokens, key=lambda t: (-tokens[t], t)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            load[r] += tokens[t]
            if r == self.rank:
                mine.add(t)
        return mine

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks (a float64 tensor)."""
        out = values.detach().to(self.device, torch.float64, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.cpu()

    def most(self, n: int) -> int:
        """The largest `n` over ranks."""
        out = torch.tensor([n], device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return int(out)

    def lockstep(self, items: list, spare: object) -> Iterator[tuple[object, bool]]:
        """`items` as (item, real), padded with (items[0] or `spare`, False) to the longest list
        over ranks: a padding pass runs the same collectives and contributes nothing."""
        n = self.most(len(items))
        for i in range(n):
            yield (items[i], True) if i < len(items) else (items[0] if items else spare, False)


def shard_model(model: PreTrainedModel, dp: DataParallel) -> PreTrainedModel:
    """FSDP2 over each decoder layer and over the log-prob module around `model` (dp.module).
    FSDP2 averages gradients over ranks: the trainer scales each rank's loss by the world size so
    that the average is the sum (gloo has no pre-multiplied sum for a divide factor of 1)."""
    model.to(dp.device)
    mesh = init_device_mesh(dp.device.type, (dp.world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    dp.module = fully_shard(LogprobModule(model), mesh=mesh)
    return model


def _by_name(state: dict, model: torch.nn.Module) -> dict:
    """A single-process Adam state dict (parameters by index) keyed by parameter name instead,
    the layout torch.distributed.checkpoint's full optimizer state uses."""
    names = [n for n, _ in model.named_parameters()]
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def _by_index(state: dict, model: torch.nn.Module) -> dict:
    """The inverse of `_by_name`: the layout `torch.optim.Optimizer.state_dict()` has."""
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    return {
        "state": {index[n]: v for n, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def load_sharded(
    parent: str | Path, cfg: TrainerConfig, dp: DataParallel
) -> tuple[PreTrainedModel, torch.optim.Optimizer, dict]:
    """The parent checkpoint (the single-process layout) as a sharded model, its Adam state
    loaded into an optimizer over the shards, and its meta: every rank reads the whole file."""
    model, optimizer_state, meta = load_checkpoint(parent)
    by_name = _by_name(optimizer_state, model) if optimizer_state is not None else None
    shard_model(model, dp)
    optimizer = make_optimizer(model, cfg, None)
    if by_name is not None:
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
        for group in optimizer.param_groups:  # the config of this round wins, as in make_optimizer
            group["lr"], group["betas"] = cfg.lr, (cfg.beta1, cfg.beta2)
    return model, optimizer, meta


def save_consolidated(
    path: str | Path | None,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    meta: dict,
    parent: str | Path,
    dp: DataParallel,
) -> None:
    """Gather the sharded model and optimizer (collective) and, on rank 0, write them to `path`
    (unused on other ranks) as a single-process checkpoint: the next round loads it with or
    without data parallelism."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # complete on rank 0 only
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    if dp.rank == 0:
        plain = load_model(parent)
        plain.load_state_dict(model_state)
        save_checkpoint(path, plain, _by_index(optimizer_state, plain), meta)
    dist.barrier()
