"""PyTorch Lightning (2.6) trains on a loader: ``Trainer.fit`` gets the loader's own batches, stores the loader's
position in its checkpoints (Lightning keeps the state of a dataloader with ``state_dict`` / ``load_state_dict``),
and a fit resumed from a mid-epoch checkpoint (``ckpt_path``) takes the remaining batches and the same losses, bit
for bit, as the run that never stopped. Two ways in: the loader itself (the idiomatic one in one process) and a
``TorchDataLoader`` over the torch view with two worker processes. One module: importing Lightning is slow."""

from __future__ import annotations

import pytest
import torch
from dutycycle.loader import AugmentConfig, CacheLoader, LoaderConfig, TorchDataset

L = pytest.importorskip("lightning")

# the shared ``cache`` fixture is tests/loader/conftest.py's (162 training samples: 10 batches of 16)
CONFIG = LoaderConfig(global_batch_size=16, seed=2, mode="thread", augment=AugmentConfig(flip=True, normalize=True))
STOP = 13  # the checkpoint's step: 3 batches into the second epoch


class Tiny(L.LightningModule):
    """A linear classifier in float64 that records what each step saw: the sample ids and the loss."""

    def __init__(self, data):
        super().__init__()
        self.data = data
        self.net = torch.nn.Linear(8 * 8 * 3, 4, dtype=torch.float64)
        self.ids: list[list[str]] = []
        self.losses: list[float] = []

    def train_dataloader(self):
        return self.data

    def training_step(self, batch, index):
        loss = torch.nn.functional.cross_entropy(self.net(batch["image"].double().flatten(1)), batch["label"])
        self.ids.append(list(batch["sample_id"]))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def data_for(cache, how: str):
    loader = CacheLoader(cache, "train", config=CONFIG)
    return loader if how == "loader" else TorchDataset(loader).dataloader(num_workers=2, persistent_workers=True)


def fit(module, root, ckpt_path=None, callbacks=()):
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                        enable_checkpointing=bool(callbacks), callbacks=list(callbacks))
    trainer.fit(module, ckpt_path=ckpt_path)


@pytest.mark.parametrize("how", ["loader", "workers"])
def test_lightning_fits_on_the_loaders_batches_and_resumes_mid_epoch_exactly(cache, tmp_path, how):
    reference = CacheLoader(cache, "train", config=CONFIG)
    expected = [list(b["sample_id"]) for _ in range(2) for b in reference]  # two passes: epochs 0 and 1

    torch.manual_seed(0)
    whole = Tiny(data_for(cache, how))
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=STOP,
                                                save_top_k=-1)
    fit(whole, tmp_path, callbacks=[saver])
    assert whole.ids == expected and len(set(map(tuple, whole.ids))) == 20

    ckpt = tmp_path / "mid.ckpt"
    saved = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert [(s["epoch"], s["step"]) for s in saved] == [(1, STOP - 10)]  # the loader's position, in the checkpoint

    torch.manual_seed(0)
    resumed = Tiny(data_for(cache, how))  # a new loader, its position from the checkpoint
    fit(resumed, tmp_path, ckpt_path=str(ckpt))
    assert resumed.ids == expected[STOP:]
    assert resumed.losses == whole.losses[STOP:]  # model, optimizer and data all continued exactly
