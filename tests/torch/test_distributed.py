"""torch.distributed: calibration statistics combined across 2 real processes (gloo), DDP QAT.

One ``torch.multiprocessing.spawn`` of two ranks (module fixture ``ranks``) runs every scenario
in turn - the process start and the model captures dominate the time - and each rank writes
what it saw to ``rank<r>.pt``; the tests compare the files. After the process group is
destroyed, the ranks compute the single-process references (quantize over the union of the
shards; the QAT checkpoint loaded by a process that never joined a group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel

import quantbridge as qb
from quantbridge.calibrate import make_observer
from quantbridge.numerics import PerChannel, PerTensor
from quantbridge.torch._distributed import (
    assert_quantizers_synchronized,
    ddp_batch_range,
    is_distributed,
    local_statistics,
    sync_observer_states,
    sync_observers,
)
from quantbridge.torch._quantize import freeze
from quantbridge.zoo import DigitsCNN

WORLD = 2
METHODS = ("minmax", "percentile", "entropy")
CALIB_BATCHES, BATCH = 8, 64  # rank r calibrates on batches r, r + 2, ...: a shard of 256 images
QAT_STEPS, QAT_BATCH = 24, 32
OUTPUT = "fc2/linear_1"  # the logits' quantizer


# ---- shared between the ranks and the tests ----------------------------------------------------


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    d = load_digits()
    return torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1), torch.tensor(d.target)


def _model() -> DigitsCNN:
    torch.manual_seed(0)
    return DigitsCNN().eval()


def _recipe(method: str) -> qb.Recipe:
    base = qb.Recipe()
    return dataclasses.replace(
        base, activations=dataclasses.replace(base.activations, method=method)
    )


def _calibration_batches() -> list[torch.Tensor]:
    return list(_digits()[0][: CALIB_BATCHES * BATCH].split(BATCH))


def _qparams(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        name: (q.current_scale().clone(), q.zero_point.detach().clone())
        for name, q in model.quantizers().items()
        if hasattr(q, "zero_point")
    }


# Observer-level cases: (method, granularity, options, ranks that get data)
OBSERVER_CASES = [
    ("minmax", PerTensor(), {}, (0, 1)),
    ("minmax", PerChannel(1), {}, (0, 1)),
    ("minmax", PerChannel(1), {}, (1,)),  # rank 0 saw nothing
    ("moving_average_minmax", PerTensor(), {}, (0, 1)),
    ("moving_average_minmax", PerChannel(1), {}, (0,)),
    ("percentile", PerTensor(), {"percentile": 99.0, "num_bins": 256}, (0, 1)),
    ("entropy", PerTensor(), {"num_bins": 1024}, (0,)),  # rank 1 saw nothing
    ("mse", PerTensor(), {"num_bins": 512}, (0, 1)),
]


def _observer_batches(case: int, rank: int) -> list[np.ndarray]:
    """Rank ``rank``'s batches for case ``case``: different scales, so ranges differ by rank."""
    *_, ranks = OBSERVER_CASES[case]
    if rank not in ranks:
        return []
    rng = np.random.default_rng(100 * case + rank)
    return [rng.normal(0.5 * rank, 1.0 + 3.0 * rank, size=(4, 3, 5)) for _ in range(2 + rank)]


def _observers(rank: int | None) -> list:
    """Fresh observers of every case, fed with ``rank``'s batches (``None``: all ranks' data)."""
    observers = []
    for case, (method, granularity, options, _) in enumerate(OBSERVER_CASES):
        obs = make_observer(method, granularity, **options)
        for r in range(WORLD) if rank is None else (rank,):
            for batch in _observer_batches(case, r):
                obs.update(batch)
        observers.append(obs)
    return observers


# ---- the ranks ---------------------------------------------------------------------------------


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)  # same kernels, same bits in every process
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=180),
    )
    result: dict = {"seconds": {}}
    with _timed(result["seconds"], "calibration"):
        result["calibration"] = _calibration(rank)
    with _timed(result["seconds"], "observers"):
        result["observers"] = [obs.state_dict() for obs in _synced_observers(rank)]
        result["errors"] = _errors(rank)
    with _timed(result["seconds"], "no_data"):
        result["no_data"] = _no_data(rank)
    with _timed(result["seconds"], "qat"):
        result["qat"] = _ddp_qat(rank, Path(out))
    with _timed(result["seconds"], "lsq"):
        result["lsq"] = _ddp_lsq(rank)
    dist.barrier()
    dist.destroy_process_group()
    with _timed(result["seconds"], "references"):
        result["reference"] = _references(rank, Path(out))
    torch.save(result, Path(out) / f"rank{rank}.pt")


@contextlib.contextmanager
def _timed(seconds: dict, key: str):
    start, cpu = time.perf_counter(), time.process_time()
    yield
    seconds[key] = (time.perf_counter() - start, time.process_time() - cpu)


def _calibration(rank: int) -> dict:
    """qb.quantize on this rank's shard, for each method: synchronized scales."""
    shard = _calibration_batches()[rank::WORLD]
    scales = {}
    for method in METHODS:
        qmodel = qb.quantize(_model(), shard, recipe=_recipe(method), progress=False)
        assert_quantizers_synchronized(qmodel)
        scales[method] = _qparams(qmodel)
    return scales


def _synced_observers(rank: int) -> list:
    observers = _observers(rank)
    sync_observer_states(observers)
    return observers


def _errors(rank: int) -> dict:
    """The messages of the mismatch checks (raised on every rank, never a hang)."""
    errors = {}
    mine = make_observer("minmax" if rank == 0 else "percentile")
    mine.update(np.ones(3))
    try:
        sync_observer_states([mine], names=["conv1/conv2d"])
    except ValueError as e:
        errors["layout"] = str(e)
    mine = make_observer("minmax", PerChannel(0))
    mine.update(np.ones((3 + rank, 2)))
    try:
        sync_observer_states([mine], names=["fc1/linear"])
    except ValueError as e:
        errors["channels"] = str(e)
    return errors


def _no_data(rank: int) -> dict:
    """Quantizers that saw data on rank 0 only; then quantizers no rank saw."""
    batches = _calibration_batches()[:2]
    qmodel = qb.quantize(_model(), batches, progress=False, recipe="int8")  # only a model to reset
    for q in _activations(qmodel):  # back to "placed, not calibrated"
        q.observing, q.observer = True, None
    if rank == 0:
        with torch.no_grad():
            for batch in batches:
                qmodel(batch)
    local = {q.name: q.observer.qparams(q.scheme) for q in _activations(qmodel) if rank == 0}
    sync_observers(qmodel)
    freeze(qmodel)
    assert_quantizers_synchronized(qmodel)
    result = {"local": local, "synced": _qparams(qmodel)}

    for q in _activations(qmodel):
        q.observing, q.observer = True, None
    sync_observers(qmodel)
    try:
        freeze(qmodel)
    except ValueError as e:
        result["nowhere"] = str(e)
    return result


def _activations(qmodel) -> list:
    return [q for q in qmodel.quantizers().values() if getattr(q, "kind", "") == "activation"]


def _shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _digits()
    start = CALIB_BATCHES * BATCH  # training images: after the calibration ones
    # contiguous: a strided example input would make the capture guard on its strides
    return x[start + rank :: WORLD].contiguous(), y[start + rank :: WORLD]


def _ddp_qat(rank: int, out: Path) -> dict:
    """Moving-average QAT under DDP without buffer syncs in forward: scales equal by the sync."""
    x, y = _shard(rank)
    qmodel = qb.prepare_qat(_model(), "int8", list(x[:256].split(BATCH)), progress=False)
    assert_quantizers_synchronized(qmodel)
    ddp = DistributedDataParallel(qmodel, forward_sync_buffers=False)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    losses, scales_seen = [], []
    for step in range(QAT_STEPS):
        i = step * QAT_BATCH % (len(x) - QAT_BATCH)
        loss = F.cross_entropy(ddp(x[i : i + QAT_BATCH]), y[i : i + QAT_BATCH])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        scales_seen.append(qmodel.quantizers()[OUTPUT].scale.item())
        if step in (0, QAT_STEPS // 2):
            assert_quantizers_synchronized(ddp)
    qb.freeze_observers(qmodel)
    # batch-norm statistics differ per rank (each saw its own batches): freeze_batchnorm takes
    # rank 0's before folding, so folded weights stay identical (compared in the test)
    qb.freeze_batchnorm(qmodel)
    assert_quantizers_synchronized(qmodel)
    qmodel.eval()
    probe = _digits()[0][-64:]
    with torch.no_grad():
        outputs = qmodel(probe)
    if rank == 0:
        qb.save(qmodel, out / "qat.qb")
    return {
        "losses": losses,
        "output_scales": scales_seen,
        "parameters": {k: v.detach().clone() for k, v in qmodel.named_parameters()},
        "qparams": _qparams(qmodel),
        "outputs": outputs,
    }


def _ddp_lsq(rank: int) -> dict:
    """LSQ under DDP (buffers broadcast, the default): scales are parameters, averaged by DDP."""
    x, y = _shard(rank)
    qmodel = qb.prepare_qat(
        _model(), "int8", list(x[:128].split(BATCH)), learn_scales=True, progress=False
    )
    initial = {k: v.detach().clone() for k, v in qmodel.named_parameters()}
    ddp = DistributedDataParallel(qmodel)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    losses = []
    for step in range(QAT_STEPS // 3):
        i = step * QAT_BATCH
        loss = F.cross_entropy(ddp(x[i : i + QAT_BATCH]), y[i : i + QAT_BATCH])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert_quantizers_synchronized(ddp)
    return {
        "losses": losses,
        "initial": initial,
        "parameters": {k: v.detach().clone() for k, v in qmodel.named_parameters()},
    }


def _references(rank: int, out: Path) -> dict:
    """Single-process runs, split between the two (now independent) processes."""
    assert not dist.is_initialized()
    references = {}
    union = _calibration_batches()
    for method in METHODS[rank::WORLD]:
        qmodel = qb.quantize(_model(), union, recipe=_recipe(method), progress=False)
        references[method] = _qparams(qmodel)
    if rank == 0:
        qmodel = qb.quantize(_model(), union[rank::WORLD], progress=False, recipe="int8")
        references["rank0_alone"] = _qparams(qmodel)
    if rank == 1:  # the QAT checkpoint, loaded by a process outside any group
        qmodel = qb.load(out / "qat.qb", _model()).eval()
        with torch.no_grad():
            references["qat_outputs"] = qmodel(_digits()[0][-64:])
        references["qat_qparams"] = _qparams(qmodel)
    return references


# ---- the tests ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("distributed")
    start = time.perf_counter()
    torch.multiprocessing.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    results[0]["seconds"]["total"] = (time.perf_counter() - start, 0.0)
    if os.environ.get("QB_PRINT_TIMES"):
        print({r: res["seconds"] for r, res in enumerate(results)})
    return results


def _assert_same_qparams(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), what
    for name in a:
        for x, y in zip(a[name], b[name], strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {name}: {x} != {y}"


@pytest.mark.parametrize("method", METHODS)
def test_calibration_gives_every_rank_the_single_process_scales(ranks, method):
    r0, r1 = (r["calibration"][method] for r in ranks)
    _assert_same_qparams(r0, r1, "rank 0 vs rank 1")
    # minmax, and the histogram methods, merge exactly: the union in one process, bit for bit
    reference = ranks[METHODS.index(method) % WORLD]["reference"][method]
    _assert_same_qparams(r0, reference, "ranks vs one process over the union")


def test_ranks_alone_would_disagree(ranks):
    """Rank 0's shard alone gives other scales: equality above is the sync's doing."""
    alone, synced = ranks[0]["reference"]["rank0_alone"], ranks[0]["calibration"]["minmax"]
    assert any(not torch.equal(alone[n][0], synced[n][0]) for n in synced)


def test_observer_statistics_combine_exactly(ranks):
    union = _observers(None)
    for case, (method, granularity, _, _) in enumerate(OBSERVER_CASES):
        expected = make_observer(method, granularity, **OBSERVER_CASES[case][2])
        expected.load_state_dict(_observers(0)[case].state_dict())
        expected.merge(_observers(1)[case])  # the gather path: rank 0, then rank 1 merged
        for r in range(WORLD):
            got = ranks[r]["observers"][case]
            for key, value in expected.state_dict().items():
                np.testing.assert_array_equal(got[key], value, err_msg=f"case {case} {key}")
        if method != "moving_average_minmax":  # exact merges: one observer over all the data
            for key, value in union[case].state_dict().items():
                np.testing.assert_array_equal(got[key], value, err_msg=f"case {case} {key}")


def test_mismatched_ranks_raise_on_every_rank_instead_of_hanging(ranks):
    for r in ranks:
        assert "'conv1/conv2d|MinMaxObserver" in r["errors"]["layout"]
        assert "PercentileObserver" in r["errors"]["layout"]
        assert "fc1/linear: ranks hold different channel counts [3, 4]" in r["errors"]["channels"]


def test_rank_without_data_takes_part(ranks):
    local = ranks[0]["no_data"]["local"]
    assert local, "rank 0 observed"
    for r in ranks:
        synced = r["no_data"]["synced"]
        for name, (scale, zero_point) in local.items():
            assert synced[name][0].numpy() == scale and synced[name][1].numpy() == zero_point
    _assert_same_qparams(ranks[0]["no_data"]["synced"], ranks[1]["no_data"]["synced"], "ranks")


def test_quantizer_no_rank_saw_is_named_on_every_rank(ranks):
    for r in ranks:
        assert "'input/x' saw no data during calibration" in r["no_data"]["nowhere"]


def test_ddp_qat_trains_and_keeps_ranks_identical(ranks):
    qat = [r["qat"] for r in ranks]
    for q in qat:
        losses = q["losses"]
        assert np.mean(losses[-6:]) < 0.8 * np.mean(losses[:6]), losses
    assert qat[0]["output_scales"] == qat[1]["output_scales"]  # after every step
    assert len(set(qat[0]["output_scales"])) > 1, "the moving average moved"
    for name, p in qat[0]["parameters"].items():
        assert torch.equal(p, qat[1]["parameters"][name]), name
    _assert_same_qparams(qat[0]["qparams"], qat[1]["qparams"], "QAT ranks")


def test_ddp_lsq_keeps_learned_scales_identical(ranks):
    lsq = [r["lsq"] for r in ranks]
    scales = [k for k in lsq[0]["parameters"] if k.endswith(".log_scale")]
    assert scales, "LSQ scales are parameters"
    assert any(not torch.equal(lsq[0]["initial"][k], lsq[0]["parameters"][k]) for k in scales)
    for name, p in lsq[0]["parameters"].items():
        assert torch.equal(p, lsq[1]["parameters"][name]), name
    assert lsq[0]["losses"][-1] < lsq[0]["losses"][0]


def test_rank0_checkpoint_loads_in_a_single_process(ranks):
    saved, loaded = ranks[0]["qat"], ranks[1]["reference"]
    _assert_same_qparams(saved["qparams"], loaded["qat_qparams"], "checkpoint")
    torch.testing.assert_close(loaded["qat_outputs"], saved["outputs"], rtol=0, atol=0)


# ---- without a process group -------------------------------------------------------------------


def test_everything_is_a_no_op_without_a_process_group():
    assert not is_distributed()
    qmodel = qb.quantize(_model(), _calibration_batches()[:1], progress=False, recipe="int8")
    sync_observers(qmodel)
    assert_quantizers_synchronized(qmodel)
    observers = _observers(0)
    before = [o.state_dict() for o in observers]
    sync_observer_states(observers)
    for a, b in zip(before, (o.state_dict() for o in observers), strict=True):
        assert a.keys() == b.keys()
    lo, hi = torch.tensor(-1.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    assert ddp_batch_range(lo, hi) == (lo, hi)
    with local_statistics():
        assert not is_distributed()
