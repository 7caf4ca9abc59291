"""Lightning and Hugging Face Trainer integrations: train a tiny model, checkpoint through tiercache, resume.

Each test compares an interrupted-and-resumed run against an uninterrupted one, bit for bit.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import Trainer, TrainingArguments

import tiercache
from tiercache.integrations.hf import TierCacheCallback, restore_checkpoint
from tiercache.integrations.lightning import TierCacheCheckpointIO


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 4, generator=g)
    return x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(32, generator=g)


# ----------------------------------------------------------------------------------------- Lightning


class TinyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _fit(root: Path, epochs: int, plugin: TierCacheCheckpointIO | None, ckpt_path: str | None = None,
         dirpath: Path | str | None = None) -> TinyModule:
    L.seed_everything(0)
    model = TinyModule()
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, plugins=[plugin] if plugin else None,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt" if dirpath is None else dirpath, save_top_k=-1)],
    )
    x, y = _data()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8), ckpt_path=ckpt_path)
    return model


def test_lightning_checkpoint_io_resume_is_identical(tmp_path: Path) -> None:
    reference = _fit(tmp_path / "ref", 2, None)
    config = {"disk": {"path": str(tmp_path / "cache")}}
    with tiercache.open(config) as cache:
        _fit(tmp_path / "run", 1, TierCacheCheckpointIO(cache, wait="local"))
    ckpt = tmp_path / "run" / "ckpt" / "epoch=0-step=4.ckpt"
    assert not ckpt.exists()  # stored in the cache only
    with tiercache.open(config) as cache:
        [info] = cache.versions()
        assert (info.step, info.meta["lightning_path"]) == (4, os.path.realpath(ckpt))
        resumed = _fit(tmp_path / "run", 2, TierCacheCheckpointIO(cache), ckpt_path=str(ckpt))
        assert [v.step for v in cache.versions()] == [4, 8]
    for name, tensor in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


def test_lightning_resumes_from_a_relative_ckpt_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As the README shows it: ModelCheckpoint(dirpath="ckpt"), then ckpt_path="ckpt/epoch=0-step=4.ckpt".
    reference = _fit(tmp_path / "ref", 2, None)
    monkeypatch.chdir(tmp_path)
    with tiercache.open({"disk": {"path": "cache"}}) as cache:
        _fit(tmp_path, 1, TierCacheCheckpointIO(cache, wait="local"), dirpath="ckpt")
        resumed = _fit(tmp_path, 2, TierCacheCheckpointIO(cache), ckpt_path="ckpt/epoch=0-step=4.ckpt",
                       dirpath="ckpt")
        assert [(v.step, v.meta["lightning_path"]) for v in cache.versions()] == [
            (4, str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")), (8, str(tmp_path / "ckpt" / "epoch=1-step=8.ckpt"))]
    for name, tensor in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


def test_lightning_path_never_saved_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with tiercache.open({"disk": {"path": "cache"}}) as cache:
        io = TierCacheCheckpointIO(cache)
        with pytest.raises(tiercache.VersionNotFoundError) as none_yet:
            io.load_checkpoint("ckpt/epoch=3-step=400.ckpt")
        assert str(none_yet.value) == (
            f"no tiercache version was saved for checkpoint 'ckpt/epoch=3-step=400.ckpt' "
            f"({tmp_path}/ckpt/epoch=3-step=400.ckpt), and it is no ref either: pass a path a checkpoint was "
            "saved under (none saved yet) or a ref such as 'main' or 'main@STEP'; `tiercache ls` lists the versions"
        )
        io.save_checkpoint({"global_step": 4, "w": torch.ones(2)}, "ckpt/epoch=0-step=4.ckpt")
        cache.flush()
        saved = re.escape(f"({tmp_path}/ckpt/epoch=0-step=4.ckpt) or a ref")
        with pytest.raises(tiercache.VersionNotFoundError, match=saved):
            io.load_checkpoint("ckpt/epoch=3-step=400.ckpt")
        with pytest.raises(tiercache.VersionNotFoundError, match="'main@7'"):
            io.load_checkpoint("main@7")  # a ref, but no version of step 7
        # The path it was saved under, relative or absolute, and a ref all resolve to that version.
        for name in ("ckpt/epoch=0-step=4.ckpt", str(tmp_path / "ckpt/epoch=0-step=4.ckpt"), "main@4"):
            assert torch.equal(io.load_checkpoint(name)["w"], torch.ones(2))


# ------------------------------------------------------------------------------------- Hugging Face


class TinyRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.lin(x).squeeze(-1)
        return {"loss": F.mse_loss(out, labels), "logits": out}


def _train(out: Path, callbacks: list, resume: str | None = None) -> TinyRegressor:
    torch.manual_seed(0)
    model = TinyRegressor()
    x, y = _data()
    args = TrainingArguments(
        output_dir=str(out), max_steps=6, save_steps=3, per_device_train_batch_size=4, learning_rate=0.05,
        use_cpu=True, report_to=[], seed=0, logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    data = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train(resume_from_checkpoint=resume)
    return model


def test_hf_callback_resume_is_identical(tmp_path: Path) -> None:
    reference = _train(tmp_path / "ref", [])
    with tiercache.open({"disk": {"path": str(tmp_path / "cache")}}) as cache:
        _train(tmp_path / "run", [TierCacheCallback(cache)])
        assert [(v.step, v.meta["hf_checkpoint"]) for v in cache.versions()] == [(3, "checkpoint-3"),
                                                                                 (6, "checkpoint-6")]
        original = {p.name: p.read_bytes() for p in (tmp_path / "run" / "checkpoint-3").iterdir() if p.is_file()}
        shutil.rmtree(tmp_path / "run")
        path = restore_checkpoint(cache, "main@3", tmp_path / "restored")
        assert {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()} == original
        resumed = _train(tmp_path / "again", [], resume=str(path))
    for name, tensor in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


# ------------------------------------------------------------------------- resuming from an older step


def _resume_moves(cache: tiercache.TierCache) -> list[tuple[str, str | None]]:
    return [(m.version, m.previous) for m in cache.reflog("main") if m.why == "resume"]


def test_lightning_resume_from_an_older_checkpoint_moves_the_branch_truthfully(tmp_path: Path) -> None:
    config = {"disk": {"path": str(tmp_path / "cache")}}
    with tiercache.open(config) as cache:
        _fit(tmp_path / "run", 3, TierCacheCheckpointIO(cache, wait="local"))
        old = {v.step: v.id for v in cache.versions()}
    assert sorted(old) == [4, 8, 12]
    with tiercache.open(config) as cache:  # a new cache: nothing of the first run in memory
        ckpt = tmp_path / "run" / "ckpt" / "epoch=0-step=4.ckpt"
        _fit(tmp_path / "run", 3, TierCacheCheckpointIO(cache, wait="local"), ckpt_path=str(ckpt))
    with tiercache.open(config) as fresh:
        new = [v for v in fresh.versions() if v.id not in old.values()]
        assert [(v.step, v.parent) for v in new] == [(8, old[4]), (12, new[0].id)]
        assert fresh.refs()["branch/main"] == new[1].id
        assert (fresh.resolve("main@8"), fresh.resolve("main~2")) == (new[0].id, old[4])
        assert _resume_moves(fresh) == [(new[0].id, old[12])]
        assert fresh.gc(grace=0).versions == ()  # what the resume left behind is in the reflog


def test_hf_resume_from_an_older_checkpoint_moves_the_branch_truthfully(tmp_path: Path) -> None:
    config = {"disk": {"path": str(tmp_path / "cache")}}
    with tiercache.open(config) as cache:
        _train(tmp_path / "run", [TierCacheCallback(cache)])
        old = {v.step: v.id for v in cache.versions()}
    assert sorted(old) == [3, 6]
    with tiercache.open(config) as cache:
        path = restore_checkpoint(cache, "main@3", tmp_path / "restored")
        _train(tmp_path / "again", [TierCacheCallback(cache)], resume=str(path))
    with tiercache.open(config) as fresh:
        [new] = [v for v in fresh.versions() if v.id not in old.values()]
        assert (new.step, new.parent) == (6, old[3])
        assert fresh.resolve("main@6") == new.id and fresh.resolve("main~1") == old[3]
        assert _resume_moves(fresh) == [(new.id, old[6])]
