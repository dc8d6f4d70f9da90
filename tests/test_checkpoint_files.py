"""Checkpoint folders on disk: every file (nested ones too) is verified, rotation never deletes the
checkpoint just written, and a resume from an older checkpoint sets newer ones aside."""

from __future__ import annotations

from pathlib import Path

import torch

from trainkit.runtime.checkpoint import Checkpointer, newest_valid, problem_with, step_folders


class OneProcess:
    """The strategy side of a checkpoint for one process: a model file plus a nested shard."""

    rank, world_size, data_parallel_size = 0, 1, 1
    reshards_on_load = True

    def barrier(self):
        pass

    def save_checkpoint(self, folder: Path, model, optimizer):
        torch.save(model.state_dict(), folder / "model.pt")
        (folder / "zero").mkdir()
        torch.save({"shard": torch.ones(3)}, folder / "zero" / "shard-0.pt")

    def load_checkpoint(self, folder: Path, model, optimizer):
        model.load_state_dict(torch.load(folder / "model.pt", weights_only=True))


def save(ckpt: Checkpointer, step: int) -> Path:
    return ckpt.save(step, torch.nn.Linear(2, 2), None, {"progress": {"step": step}})


def test_nested_files_are_hashed_so_a_corrupt_shard_is_detected(tmp_path):
    ckpt = Checkpointer(tmp_path, OneProcess(), keep=3, recipe_data={"name": "r"})
    folder = save(ckpt, 4)
    assert problem_with(folder) is None
    shard = folder / "zero" / "shard-0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the shard
    shard.write_bytes(bytes(data))
    assert problem_with(folder) == "zero/shard-0.pt is corrupt (sha256 does not match meta.json)"


def test_resuming_from_an_older_checkpoint_keeps_new_saves_and_sets_newer_ones_aside(tmp_path):
    ckpt = Checkpointer(tmp_path, OneProcess(), keep=1, recipe_data={"name": "r"})
    old = save(ckpt, 50)
    save(ckpt, 100)  # keep=1: step 50 rotated away ...
    assert [f.name for f in step_folders(tmp_path)] == ["step-00000100"]
    old = save(Checkpointer(tmp_path / "other", OneProcess(), keep=1, recipe_data={"name": "r"}), 50)
    target = tmp_path / old.name
    old.rename(target)  # ... a user resumes from an older checkpoint folder of this run
    ckpt.load(target, torch.nn.Linear(2, 2), None)
    assert [f.name for f in step_folders(tmp_path)] == ["step-00000050"]
    assert any(p.name.startswith("abandoned-step-00000100") for p in tmp_path.iterdir())
    written = save(ckpt, 60)
    assert written.is_dir() and newest_valid(tmp_path) == written
    assert [f.name for f in step_folders(tmp_path)] == ["step-00000060"]
