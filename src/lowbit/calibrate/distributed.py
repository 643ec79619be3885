"""Calibration shared by the processes of a torch.distributed group (launched by ``torchrun``).

How the work is shared, and why the result equals one process's bit for bit:

* Samples: sample ``i`` belongs to rank ``i % world_size``. Every rank captures the first
  block's inputs of all samples (embeddings only, cheap) but runs the blocks only on its own
  samples, so each rank keeps its own samples' hidden states and nothing else is exchanged for
  the forward passes. A block run on one sample does the same operations in any process.
* Hessians: one process adds ``xᵀx`` sample after sample into a float32 sum; an all-reduce of
  per-rank partial sums would add in another order and differ in the last bits. Here each
  shared input (q/k/v's, gate/up's, o's, down's) has an owner rank; the ranks walk their
  samples in steps (step ``t``: samples ``t·W .. t·W + W - 1``, one per rank), every input a
  linear reads is gathered to its owner, and the owner adds them in rank order, which is sample
  order: the same ``addmm_`` calls in the same order as one process. Owners are assigned round
  robin over the inputs in hook order, so the Hessian work is shared too. A rank whose sample
  of the last step is past the end runs a spare one whose input is not added.
* Solving: each owner runs GPTQ on the linears that read its inputs; the results (choice,
  packed container, dequantized weight) are broadcast in layer order, so every rank holds the
  whole quantized block before the next block's forward pass.

Only rank 0 writes the checkpoint (:func:`lowbit.api.quantize_to_directory`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lowbit.calibrate.hessian import HessianAccumulator
from lowbit.errors import LowbitError

__all__ = ["Group", "GatheredAccumulator", "init_from_env"]


@dataclass
class Group:
    """This process's place in the default torch.distributed process group.

    Attributes:
        rank: this process's rank.
        world_size: the number of processes.
        local_rank: the rank on this machine (its CUDA device under NCCL).
        splits: during a Hessian step, the split ("train", "heldout") of each rank's sample,
            None for a rank whose spare sample is not added.
        joined: :func:`init_from_env` started the process group (and :meth:`leave` ends it);
            False when the caller had started it.
    """

    rank: int
    world_size: int
    local_rank: int = 0
    splits: list[str | None] = field(default_factory=list)
    joined: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def leave(self) -> None:
        """End the process group if :func:`init_from_env` started it."""
        if self.joined:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.joined = False

    def own_samples(self, n_samples: int) -> list[int]:
        """This rank's sample indices."""
        return list(range(self.rank, n_samples, self.world_size))

    def check_samples(self, n_samples: int) -> None:
        if n_samples < self.world_size:
            raise LowbitError(
                f"{n_samples} calibration samples cannot be shared by {self.world_size} "
                f"processes; use at most {n_samples} processes or more samples"
            )

    def accumulator_factory(self):
        """A factory for :class:`~lowbit.calibrate.hessian.HessianCollector`: its ``k``-th
        accumulator (in hook order) is owned by rank ``k % world_size``."""
        created = 0

        def make(width: int, device: torch.device) -> GatheredAccumulator:
            nonlocal created
            owner = created % self.world_size
            created += 1
            return GatheredAccumulator(width, device, self, owner)

        return make

    def share(self, results: dict[str, Any], owners: dict[str, int]) -> dict[str, Any]:
        """Every rank's ``results[name]`` for the names it owns, on every rank (broadcast in the
        order of ``owners``; tensors travel through the CPU)."""
        import torch.distributed as dist

        shared = {}
        for name, owner in owners.items():
            box = [_to_cpu(results[name]) if owner == self.rank else None]
            dist.broadcast_object_list(box, src=owner)
            shared[name] = box[0]
        return shared


def _to_cpu(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(v) for v in value)
    if hasattr(value, "to") and not isinstance(value, torch.nn.Module):
        return value.to("cpu")
    return value


class GatheredAccumulator(HessianAccumulator):
    """A Hessian sum that only its owner rank holds: :meth:`add` gathers every rank's input of
    the current step to the owner, which adds those of real samples in rank (= sample) order.

    Args:
        width: input features.
        device: where the owner keeps the sums.
        group: the process group (its ``splits`` say what each rank's input is).
        owner: the rank that holds the sums (and solves the linears that read this input).
    """

    def __init__(self, width: int, device: torch.device, group: Group, owner: int):
        super().__init__(width, device)
        self.group, self.owner = group, owner

    def add(self, x: Tensor, split: str = "train") -> None:
        import torch.distributed as dist

        x = x.contiguous()  # [1, S, width]
        if self.group.rank != self.owner:
            dist.gather(x, None, dst=self.owner)
            return
        inputs = [torch.empty_like(x) for _ in range(self.group.world_size)]
        dist.gather(x, inputs, dst=self.owner)
        for rank_split, rank_x in zip(self.group.splits, inputs, strict=True):
            if rank_split is not None:
                super().add(rank_x, rank_split)


def init_from_env(device: torch.device | None) -> Group:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``): NCCL when calibration runs on CUDA, else gloo."""
    import torch.distributed as dist

    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise LowbitError(
            f"distributed calibration needs torchrun's environment ({missing[0]} is not set); "
            "launch it with torchrun --nproc-per-node N -m lowbit quantize ... --distributed"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if cuda else "gloo")
    return Group(dist.get_rank(), dist.get_world_size(), local_rank, joined=joined)
