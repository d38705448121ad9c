"""Quantization-aware training of the digits CNN under DistributedDataParallel (gloo, CPU).

    torchrun --nproc_per_node=2 examples/ddp_qat.py [--epochs 3] [--out digits_qat.qb]

(``python examples/ddp_qat.py`` runs the same as one process.) Every rank:

1. trains the float ``DigitsCNN`` under DDP on its ``DistributedSampler`` shard of
   scikit-learn's ``load_digits`` (75 % for training, a fixed stratified split);
2. calls ``qb.prepare_qat`` with its own shard as calibration data: the ranks' observer
   statistics are all-reduced before the scales are frozen, so every rank starts QAT with the
   same scales and zero points (those of one process over all the shards);
3. wraps the ``QuantModel`` in DDP and trains it: the moving-average activation ranges follow the
   min / max over every rank's batch, so the scales stay identical on every rank;
4. freezes the ranges (``qb.freeze_observers``) for the last epoch;
5. measures INT8 accuracy on the held-out images (each rank half of them, counts all-reduced).

Rank 0 saves the checkpoint; any single process loads it (no process group needed)::

    qmodel = qb.load("digits_qat.qb", DigitsCNN())
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import quantbridge as qb
from quantbridge.zoo import DigitsCNN


def datasets() -> tuple[TensorDataset, TensorDataset]:
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, d.target, test_size=0.25, random_state=0, stratify=d.target
    )
    return (
        TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
        TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)),
    )


def train_epoch(ddp: DistributedDataParallel, loader: DataLoader, optimizer, epoch: int) -> float:
    loader.sampler.set_epoch(epoch)
    ddp.train()
    total, count = 0.0, 0
    for x, y in loader:
        loss = F.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total, count = total + loss.item() * len(y), count + len(y)
    return total / count


def accuracy(model: torch.nn.Module, test: TensorDataset) -> float:
    """Every rank scores its part of the test set; the counts are summed over the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = test.tensors[0][rank::world].contiguous(), test.tensors[1][rank::world]
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).sum()
    counts = torch.stack([correct, torch.tensor(len(y))]).double()
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="float epochs, then QAT epochs")
    parser.add_argument("--out", default="digits_qat.qb", help="rank 0 saves the QAT model here")
    args = parser.parse_args()

    if "RANK" not in os.environ:  # plain `python examples/ddp_qat.py`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway

    train, test = datasets()
    loader = DataLoader(train, batch_size=32, sampler=DistributedSampler(train, seed=0))

    # 1. float training
    model = DigitsCNN()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    for epoch in range(args.epochs):
        loss = train_epoch(ddp, loader, optimizer, epoch)
        print(f"rank {rank}: float epoch {epoch} loss {loss:.4f}", flush=True)
    float_accuracy = accuracy(model, test)

    # 2. calibration on this rank's shard; statistics combined across the ranks
    shard = [x.contiguous() for x, _ in loader][:8]
    qmodel = qb.prepare_qat(model, "int8", shard, progress=False)

    # 3. QAT under DDP, 4. ranges frozen for the last epoch
    ddp = DistributedDataParallel(qmodel)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=5e-4)
    for epoch in range(args.epochs):
        if epoch == args.epochs - 1:
            qb.freeze_observers(qmodel)
        loss = train_epoch(ddp, loader, optimizer, args.epochs + epoch)
        print(f"rank {rank}: QAT epoch {epoch} loss {loss:.4f}", flush=True)

    # 5. accuracy; the logits' scale is the same on every rank
    int8_accuracy = accuracy(qmodel, test)
    name, logits = list(qmodel.quantizers().items())[-1]
    print(f"rank {rank}: scale of {name!r} = {logits.scale.item():.9g}", flush=True)
    if rank == 0:
        print(f"accuracy: float {float_accuracy:.4f}, INT8 after QAT {int8_accuracy:.4f}")
        qb.save(qmodel, args.out)
        print(f"rank 0 saved {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
