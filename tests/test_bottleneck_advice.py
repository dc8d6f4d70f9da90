"""Every advice rule of the bottleneck report, on synthetic breakdowns: it states the mechanism and
the expected effect in the recipe's own terms, and is given only where the recipe's strategy,
backend and device can act on it. No process is launched."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import yaml

from trainkit.analysis.bottleneck import diagnose
from trainkit.recipe import Recipe, resolve


def recipe(**sections) -> Recipe:
    data = {
        "name": "synthetic-advice",
        "model": {"name": "mlp"},
        "data": {"name": "synthetic", "batch_size": 64},
        "strategy": {"name": "ddp"},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "trainer": {"max_steps": 1000, "log_every": 10},
        "launch": {"nproc_per_node": 4},
    }
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(yaml.safe_dump(data))
        return resolve(path).recipe


def ranks(n=4, *, total=0.100, data_wait=0.002, forward=0.020, optimizer=0.005, comm=None, exposed=None):
    out = []
    for r in range(n):
        row = {"rank": r, "host": "node-a", "steps": 50, "total": total, "data_wait": data_wait, "forward": forward,
               "compute": total - data_wait - optimizer, "optimizer": optimizer}
        row["backward"] = row["compute"] - forward
        if comm is not None:
            row.update(comm=comm, comm_exposed=exposed)
        out.append(row)
    return out


def texts(d) -> list[str]:
    return [a.text for a in d.ranked()]


def one(d, prefix: str) -> str:
    found = [t for t in texts(d) if t.startswith(prefix)]
    assert len(found) == 1, (prefix, texts(d))
    return found[0]


def none(d, fragment: str) -> None:
    assert not [t for t in texts(d) if fragment in t], texts(d)


COMM = dict(comm=0.060, exposed=0.040)  # 40% of a 100 ms step exposed


# --------------------------------------------------------------------------- communication
def test_accumulation_advice_raises_the_global_batch_and_names_the_lr_change():
    d = diagnose(ranks(**COMM), recipe(), env={"device": "cuda", "backend": "nccl"})
    assert d.kind == "communication-bound"
    text = one(d, "raise trainer.grad_accum_steps from 1 to 4")
    assert "global batch 256 → 1024" in text and "one all-reduce per 4x more samples" in text
    assert "scale optimizer.lr accordingly (linear rule: 0.1 → 0.4" in text
    none(d, "4x smaller data.batch_size")  # the old advice: same samples per all-reduce, nothing saved


def test_accumulation_advice_uses_the_square_root_rule_for_adam():
    d = diagnose(ranks(**COMM), recipe(optimizer={"name": "adamw", "lr": 0.001}), env={"backend": "gloo"})
    assert "square-root rule for adamw: 0.001 → 0.002" in one(d, "raise trainer.grad_accum_steps")


def test_bf16_compression_only_with_nccl_and_fp16_compression_on_gloo():
    nccl = diagnose(ranks(**COMM), recipe(), env={"device": "cuda", "backend": "nccl"})
    text = one(nccl, "set strategy.comm_hook: bf16_compress")
    assert "halving the bytes of each all-reduce" in text and "up to ~20.0 of the 40.0 ms exposed" in text
    gloo = diagnose(ranks(**COMM), recipe(), env={"device": "cpu", "backend": "gloo"})
    none(gloo, "bf16_compress:")
    assert "bf16_compress needs NCCL; this run uses gloo" in one(gloo, "set strategy.comm_hook: fp16_compress")
    unknown = diagnose(ranks(**COMM), recipe())  # backend auto, an old report: no guess
    none(unknown, "strategy.comm_hook")
    already = diagnose(ranks(**COMM), recipe(strategy={"name": "ddp", "comm_hook": "fp16_compress"}),
                       env={"backend": "nccl"})
    none(already, "strategy.comm_hook")


def test_bucket_advice_only_for_tiny_buckets():
    tiny = diagnose(ranks(**COMM), recipe(strategy={"name": "ddp", "bucket_cap_mb": 0.5}), env={"backend": "gloo"})
    assert "fewer, larger ones cut most of the 40.0 ms exposed" in one(tiny, "raise strategy.bucket_cap_mb from 0.5 to 25")
    none(diagnose(ranks(**COMM), recipe(), env={"backend": "gloo"}), "bucket_cap_mb")


def test_static_graph_advice_names_what_ddp_skips_and_not_with_unused_parameters():
    d = diagnose(ranks(**COMM), recipe(), env={"backend": "gloo"})
    assert "skips its per-step search for unused parameters" in one(d, "set strategy.static_graph: true")
    none(diagnose(ranks(**COMM), recipe(strategy={"name": "ddp", "find_unused_parameters": True}),
                  env={"backend": "gloo"}), "static_graph")


def test_no_ddp_advice_for_other_strategies_a_single_rank_or_overlapped_communication():
    for r in (recipe(strategy={"name": "fsdp"}), recipe(strategy={"name": "pipeline"})):
        d = diagnose(ranks(**COMM), r, env={"backend": "nccl", "device": "cuda"})
        for key in ("strategy.", "grad_accum_steps"):
            none(d, key)
    none(diagnose(ranks(1, **COMM), recipe(), env={"backend": "gloo"}), "grad_accum_steps")
    overlapped = diagnose(ranks(comm=0.060, exposed=0.005), recipe(), env={"backend": "gloo"})
    assert overlapped.kind == "compute-bound"  # 60% in flight but only 5% exposed: judged on exposed
    none(overlapped, "strategy.")


# --------------------------------------------------------------------------- data
def test_data_advice_states_mechanism_and_share():
    d = diagnose(ranks(data_wait=0.050), recipe(data={"sleep_ms": 1.0}), env={"device": "cpu", "backend": "gloo"})
    assert d.kind == "data-bound"
    text = one(d, "set data.num_workers: ")
    assert "(now 0)" in text and "saving up to that 50%" in text
    # the mechanism is the dataset's own loading work (DataOptions.loading_work), never a guess from its name
    assert "the loader's work (the planted per-sample delay, data.sleep_ms) runs inside the training process and " \
           "stalls it 50.0 ms per step (50%)" in text


def test_an_in_memory_dataset_is_not_told_it_decodes():
    """Synthetic samples are generated in memory: the wait is batch building, not decoding or augmentation."""
    d = diagnose(ranks(data_wait=0.050), recipe(), env={"device": "cpu", "backend": "gloo"})
    text = one(d, "set data.num_workers: 1 (now 0)")
    assert "the samples are in memory (nothing to read or decode)" in text and "building batches" in text
    assert "augmentation" not in text and "loader's work" not in text
    some = diagnose(ranks(data_wait=0.050), recipe(data={"num_workers": 1}), env={"device": "cpu"})
    assert "each worker keeps 4 batches ready instead of 2" in one(some, "raise data.prefetch_factor from 2 to 4")
    assert "started again at every epoch boundary" in one(some, "set data.persistent_workers: true")


def test_an_image_loader_that_cannot_keep_up_on_a_gpu_is_told_to_decode_on_the_gpu():
    """One loader process makes 6.4 images/s against the model's 1,280 per rank: no host has the cores for
    200 of them, so the JPEG decoding itself has to move (data.decode: device); not on a CPU run, where
    the device is the same cores, and not where it has moved already."""
    slow = [{**row, "loader": 10.0} for row in ranks(data_wait=0.050)]
    images = {"name": "imagefolder", "root": "/data/train", "num_workers": 1}
    gpu = diagnose(slow, recipe(data=images), env={"device": "cuda", "backend": "nccl"})
    advice = gpu.changes()["data.decode"]
    assert advice.changes == {"data.decode": "device"} and advice.was == {"data.decode": "loader"}
    assert advice.text.startswith("set data.decode: device: the loader cannot keep up on this host's "
                                  "CPUs: one loader process makes 6 samples/s, the model alone takes 1,280 per rank, "
                                  "so 200 processes per rank are needed"), advice.text
    assert "nvJPEG" in advice.text
    none(diagnose(slow, recipe(data=images), env={"device": "cpu", "backend": "gloo"}), "data.decode")
    none(diagnose(slow, recipe(data={**images, "decode": "device"}), env={"device": "cuda"}), "data.decode")
    none(diagnose(slow, recipe(data={"num_workers": 1}), env={"device": "cuda"}), "data.decode")  # nothing to decode


def test_pin_memory_advice_only_on_cuda():
    gpu = diagnose(ranks(data_wait=0.050), recipe(), env={"device": "cuda", "backend": "nccl"})
    assert "page-locked host memory" in one(gpu, "set data.pin_memory: true")
    none(diagnose(ranks(data_wait=0.050), recipe(), env={"device": "cpu", "backend": "gloo"}), "pin_memory")
    none(diagnose(ranks(data_wait=0.050), recipe(data={"pin_memory": True}), env={"device": "cuda"}), "pin_memory")


# --------------------------------------------------------------------------- advice as data
def test_advice_carries_its_recipe_changes_mechanism_saving_and_evidence():
    d = diagnose(ranks(data_wait=0.010, **COMM), recipe(), env={"device": "cuda", "backend": "nccl"})
    changes = {key: a.changes[key] for key, a in d.changes().items()}
    assert changes == {"data.num_workers": 1, "data.pin_memory": True, "strategy.comm_hook": "bf16_compress",
                       "trainer.grad_accum_steps": 4, "strategy.static_graph": True}
    accum = d.changes()["trainer.grad_accum_steps"]
    assert accum.changes == {"trainer.grad_accum_steps": 4, "optimizer.lr": 0.4}  # the lr follows the batch
    assert accum.was == {"trainer.grad_accum_steps": 1, "optimizer.lr": 0.1} and accum.phase == "communication"
    assert accum.evidence == {"comm_exposed_ms": pytest.approx(40.0), "comm_exposed_share": pytest.approx(0.4)}
    assert accum.saving == pytest.approx(0.4 * 0.75 * 0.5)
    assert accum.text == f"raise trainer.grad_accum_steps from 1 to 4: {accum.mechanism}"  # rendered from fields
    hook = d.changes()["strategy.comm_hook"]
    assert hook.text == f"set strategy.comm_hook: bf16_compress: {hook.mechanism}"
    verdict = d.summary()
    assert verdict["advice"] == [a.text for a in d.ranked()]
    assert verdict["advice_data"][0]["changes"] == d.ranked()[0].changes


def test_advice_without_a_recipe_change_says_what_to_do():
    slow = ranks()
    slow[3] = {**slow[3], "data_wait": 0.030}
    d = diagnose(slow, recipe(), env={"backend": "gloo"})
    assert d.kind == "straggler-bound"
    advice = next(a for a in d.advice if a.phase == "straggler")
    assert advice.changes == {} and advice.key is None and "rank 3" not in d.changes()
    assert advice.text.startswith("investigate rank 3 on host node-a: its data loading + forward take")


# --------------------------------------------------------------------------- the headline agrees with the advice
def test_a_compute_bound_headline_names_the_phase_its_advice_targets():
    """Seen: "compute-bound: 99% of the step" followed only by communication advice. 20% of the step
    waits for exposed communication: compute is 78%, and the headline says where the advice points."""
    d = diagnose(ranks(comm=0.040, exposed=0.020), recipe(), env={"device": "cpu", "backend": "gloo", "bf16": False})
    assert d.kind == "compute-bound"
    assert d.headline.startswith("forward/backward/optimizer take 78% of the step")
    assert {a.phase for a in d.advice} == {"communication"}
    assert "the advice below targets the rest: exposed gradient communication 20% of the step" in d.headline
    own = diagnose(ranks(comm=0.040, exposed=0.020), recipe(), env={"device": "cpu", "backend": "gloo", "bf16": True})
    assert "targets the rest" not in own.headline  # bf16 advice is about compute itself
    quiet = diagnose(ranks(), recipe(), env={"device": "cpu", "backend": "gloo"})
    assert quiet.headline == "forward/backward/optimizer take 98% of the step" and not quiet.advice


# --------------------------------------------------------------------------- compute
def test_bf16_precision_advice_only_where_bf16_runs_fast():
    yes = diagnose(ranks(), recipe(), env={"device": "cuda", "backend": "nccl", "bf16": True})
    assert "tensor cores" in one(yes, "set precision: bf16")
    cpu = diagnose(ranks(), recipe(), env={"device": "cpu", "backend": "gloo", "bf16": True})
    assert "AMX/AVX512-BF16" in one(cpu, "set precision: bf16")
    none(diagnose(ranks(), recipe(), env={"device": "cpu", "bf16": False}), "precision")
    none(diagnose(ranks(), recipe(precision="bf16"), env={"device": "cuda", "bf16": True}), "precision")


def test_gpu_utilisation_enters_the_verdict_and_batch_advice():
    d = diagnose(ranks(), recipe(), env={"device": "cuda", "backend": "nccl"}, gpu={"busy_percent": 43.0})
    assert d.kind == "compute-bound" and "GPU busy 43% of the time" in d.headline
    assert any("GPU busy 43% of the time" in e for e in d.evidence)
    text = one(d, "raise data.batch_size from 64 to 128")
    assert "global batch 256 → 512" in text and "0.1 → 0.2" in text
    busy = diagnose(ranks(), recipe(), env={"device": "cuda"}, gpu={"busy_percent": 95.0})
    assert "GPU busy" not in busy.headline
    none(busy, "data.batch_size")
    assert d.tags()["trainkit.gpu_busy_percent"] == "43"


# --------------------------------------------------------------------------- whole-run time
WALL = dict(wall_s=100.0, train_s=70.0, eval_s=2.0, checkpoint_s=18.0, logging_s=3.0, startup_s=6.0,
            shutdown_s=1.0, checkpoints=100, evals=10, steps=1000)


def test_checkpoint_advice_projects_the_cost_of_a_longer_interval():
    d = diagnose(ranks(), recipe(trainer={"checkpoint": {"every": 10}}), wall=WALL)
    text = one(d, "raise trainer.checkpoint.every from 10 to 50: saving checkpoints costs 18% of wall time")
    every, share = re.search(r"every (\d+) would cost (\d+)%", text).groups()
    assert int(every) == 50 and int(share) <= 5  # 20 saves x 0.18 s of 85.8 s
    assert d.changes()["trainer.checkpoint.every"].changes == {"trainer.checkpoint.every": 50}
    assert ["checkpoint", "18.00", "18%"] in d.wall and "| checkpoint | 18.00 | 18% |" in d.markdown("x")
    quiet = dict(WALL, checkpoint_s=3.0, train_s=85.0)
    none(diagnose(ranks(), recipe(trainer={"checkpoint": {"every": 10}}), wall=quiet), "checkpoint.every")


def test_evaluation_advice_above_ten_percent_of_wall_time():
    wall = dict(WALL, eval_s=25.0, train_s=63.0, checkpoint_s=2.0, logging_s=3.0)
    d = diagnose(ranks(), recipe(trainer={"eval_every": 100, "eval_steps": 50}), wall=wall)
    text = one(d, "raise trainer.eval_every from 100 to ")
    assert "evaluation costs 25% of wall time (10 evaluations of 50 batches, 2.50 s each)" in text
    assert "would cost" in text and "lower trainer.eval_steps from 50" in text
    final_only = diagnose(ranks(), recipe(trainer={"eval_every": 1000, "eval_steps": 50}), wall=wall)
    assert "evaluation costs 25% of wall time" in one(final_only, "lower trainer.eval_steps from 50 to 25")


def test_logging_advice_when_tracking_costs_more_than_ten_percent():
    wall = dict(WALL, logging_s=15.0, train_s=75.0, checkpoint_s=2.0)
    d = diagnose(ranks(), recipe(trainer={"log_every": 1}), wall=wall)
    assert "costs 15% of wall time" in one(d, "raise trainer.log_every from 1 to 10")


def test_verdict_tags_for_mlflow():
    d = diagnose(ranks(**COMM), recipe(), env={"backend": "nccl", "device": "cuda"}, wall=WALL)
    tags = d.tags()
    assert tags["trainkit.bottleneck"] == "communication-bound"
    assert tags["trainkit.advice.1"] == d.ranked()[0].text
    assert float(tags["trainkit.step_ms"]) == pytest.approx(100.0)
    assert float(tags["trainkit.time.checkpoint_share"]) == pytest.approx(0.18)
