"""An engine model inside Lightning (issue 15 part 4): ``predict_step`` calls it like the float
model, ``trainer.predict`` runs it (eval mode, inference mode), and ``.train()`` is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import quantbridge as qb
from quantbridge.engine import TRAIN_MESSAGE
from quantbridge.zoo import DigitsCNN

L = pytest.importorskip("lightning")


class Predictor(L.LightningModule):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self.model(x).argmax(1), self.model(x)


def _trainer():
    return L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    x = torch.rand(40, 1, 8, 8)
    y = torch.randint(0, 10, (40,))
    qmodel = qb.quantize(DigitsCNN().eval(), [x[:16]], recipe="int8")
    fast = qb.to_engine(qmodel, "onnxruntime", example_inputs=x[:16], threads=1)
    return fast, DataLoader(TensorDataset(x, y), batch_size=16)


def test_trainer_predict_runs_the_engine_model(setup):
    fast, loader = setup
    batches = _trainer().predict(Predictor(fast), loader)
    assert [len(b[0]) for b in batches] == [16, 16, 8]  # dynamic batch: the last one is short
    for (labels, logits), (x, _) in zip(batches, loader, strict=True):
        assert torch.equal(logits, fast(x)) and torch.equal(labels, fast(x).argmax(1))
    assert not fast.training


def test_switching_the_lightning_module_to_training_refuses_with_the_message(setup):
    fast, _ = setup
    module = Predictor(fast)
    # Lightning 2.6's fit loop leaves module modes as they are (it warns about modules in eval
    # mode); a training loop's own module.train() reaches the engine model and is refused
    with pytest.raises(RuntimeError, match=TRAIN_MESSAGE):
        module.train()
    module.eval()
    assert not module.training and not fast.training
