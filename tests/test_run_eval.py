"""Evaluation: which samples it reads (a seeded subset of the held-out split, each once) and that
the result does not depend on how many ranks read them."""

from __future__ import annotations

import pytest

from run_helpers import mlp_recipe, summary, trainkit


def shards(size: int, world_size: int, limit, seed: int = 7) -> list[list[int]]:
    from trainkit.runtime.data import EvalSampler

    return [list(EvalSampler(size, rank=r, world_size=world_size, seed=seed, limit=limit)) for r in range(world_size)]


def test_eval_ranks_read_a_seeded_subset_once_each_without_padding():
    """Guards the eval sampler: the ranks' shards are disjoint, together they are exactly the first
    `limit` indices of the seed's permutation (the same for 1 and 2 ranks), and nothing is padded in
    when the subset does not divide by the world size (DistributedSampler repeats samples there)."""
    two, one = shards(25, 2, limit=None), shards(25, 1, limit=None)
    assert len(two[0]) == 13 and len(two[1]) == 12  # uneven, not padded to 13 + 13
    assert sorted(two[0] + two[1]) == sorted(one[0]) == list(range(25))
    sub2, sub1 = shards(100, 2, limit=32), shards(100, 1, limit=32)
    assert not set(sub2[0]) & set(sub2[1])
    assert sorted(sub2[0] + sub2[1]) == sorted(sub1[0]) and len(sub1[0]) == 32
    assert shards(100, 2, limit=32) == sub2  # fixed: the same samples at every evaluation
    assert shards(100, 2, limit=32, seed=8) != sub2


def test_a_small_eval_budget_still_spans_a_class_sorted_split():
    """Guards the shuffle: ImageFolder lists samples sorted by class, so reading the first
    eval_steps batches in order (the old behaviour) would evaluate only the first class or two."""
    labels = [i // 50 for i in range(400)]  # 8 classes x 50, sorted like scan_imagefolder
    chosen = [labels[i] for shard in shards(400, 2, limit=32) for i in shard]
    assert len(set(chosen)) >= 6


def test_make_imagefolder_writes_a_held_out_split(tmp_path):
    from trainkit.runtime.data import scan_imagefolder
    from trainkit.runtime.imagefolder_maker import make_imagefolder

    root = make_imagefolder(tmp_path / "imgs", classes=3, per_class=4, size=16, seed=0, val_per_class=2)
    train_classes, train = scan_imagefolder(root / "train")
    val_classes, val = scan_imagefolder(root / "val")
    assert train_classes == val_classes == ["class_00", "class_01", "class_02"]
    assert len(train) == 12 and len(val) == 6
    train_bytes = {p.read_bytes() for p, _ in train}
    assert not any(p.read_bytes() in train_bytes for p, _ in val)  # different images, not copies


@pytest.mark.distributed
def test_two_rank_evaluation_equals_one_process_evaluation_of_the_same_samples(tmp_path):
    """Guards unpadded, rank-independent evaluation end to end. lr 1e-9 keeps the weights fixed
    (an update of 1e-9 x grad is below fp32 resolution of the weights), so both runs evaluate the
    same model on the whole 25-sample synthetic eval split (eval_steps x batch x ranks = 32 > 25).
    With DistributedSampler's padding the 2-rank run would count one sample twice (26 samples).

    Tolerance 1e-6 relative: per-sample losses are fp32 and the sums float64, but the fp32
    per-batch sums are taken over batches of 8 (2 ranks) vs 16 (1 process) and added in a
    different order: ~1e-7 relative; a duplicated or missing sample moves eval_loss by ~4e-2."""
    common = dict(data={"num_samples": 250}, optimizer={"name": "sgd", "lr": 1e-9, "momentum": 0.0},
                  trainer={"max_steps": 2, "log_every": 1, "eval_every": 2, "eval_steps": 2,
                           "checkpoint": {"every": 100}})
    evals = {}
    for name, ranks in (("two", 2), ("one", 1)):
        sections = {**common, "data": {**common["data"], "batch_size": 16 // ranks},
                    "launch": {"nproc_per_node": ranks}}
        result = trainkit(tmp_path, "run", str(mlp_recipe(tmp_path, name, **sections)))
        assert result.returncode == 0, result.output[-4000:]
        evals[name] = summary(tmp_path / "runs" / name)["eval"]
    assert evals["two"]["eval_loss"] == pytest.approx(evals["one"]["eval_loss"], rel=1e-6)
    assert evals["two"]["eval_accuracy"] == pytest.approx(evals["one"]["eval_accuracy"], rel=1e-6)
