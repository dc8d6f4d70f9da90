"""The `parallel:` block (issue 30) as a user meets it, before anything runs: `trainkit validate`
refuses a mesh that does not fill the world, a dimension the strategy does not lay ranks out on,
tensor parallel on a model without a plan, a pipeline whose data_parallel disagrees and an elastic
launch without a -1 dimension, each at the file:line:col of what to change; `trainkit plan` shows
the groups `init_device_mesh` builds and the global batch over the data-parallel dimensions only.

In-process through the CLI's entry function, on real recipe files (one subprocess checks that
validating a mesh imports no torch)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainkit.cli import main

REPO = Path(__file__).resolve().parent.parent

TEMPLATE = """\
name: mesh
task: {{name: causal_lm}}
model:
  name: {model}
  args: {args}
data: {{name: text, files: [train.txt], tokenizer: tokenizer.json, seq_len: 16, batch_size: 4}}
strategy: {strategy}
trainer: {{max_steps: 2}}
launch: {launch}
parallel: {parallel}
"""
TRANSFORMER_ARGS = "{vocab_size: 264, dim: 32, layers: 2, heads: 4, seq_len: 16}"
PARALLEL_LINE = 10  # the line `parallel:` is written on, in every recipe these tests write


def write(tmp_path: Path, parallel: str, *, strategy: str = "{name: fsdp}", launch: str = "{nproc_per_node: 4}",
          model: str = "transformer", args: str = TRANSFORMER_ARGS) -> Path:
    path = tmp_path / "mesh.yaml"
    path.write_text(TEMPLATE.format(model=model, args=args, strategy=strategy, launch=launch, parallel=parallel))
    return path


def at(path: Path, key: str = "") -> str:
    """`file:line:col` of the `parallel:` block's mapping, or of the value of its `key`."""
    line = path.read_text().splitlines()[PARALLEL_LINE - 1]
    col = line.index(f"{key}: ") + len(key) + 3 if key else line.index("{") + 1
    return f"{path}:{PARALLEL_LINE}:{col}"


def validate(capsys, path: Path) -> tuple[int, list[str]]:
    """Exit code and the problem lines `trainkit validate` prints."""
    code = main(["validate", str(path)])
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    return code, [line for line in (out.err + out.out).splitlines() if line.startswith(str(path))]


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> Path:
    """A folder with the train.txt and tokenizer.json that `plan` reads (a few lines, a byte-level tokenizer)."""
    from trainkit.runtime.text_data import train_tokenizer

    folder = tmp_path_factory.mktemp("text")
    (folder / "train.txt").write_text("the mesh lays the ranks out\n" * 20)
    train_tokenizer([str(folder / "train.txt")], folder / "tokenizer.json", vocab_size=260)
    return folder


def plan(capsys, monkeypatch, path: Path, text_files: Path) -> str:
    monkeypatch.chdir(text_files)  # the recipe's relative data paths
    assert main(["plan", str(path)]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_degrees_that_do_not_fill_the_world_are_refused_with_their_arithmetic(tmp_path, capsys):
    path = write(tmp_path, "{dp_replicate: 2, dp_shard: 2, tp: 2}")
    assert validate(capsys, path) == (2, [
        f"{at(path)}: parallel: dp_replicate 2 x dp_shard 2 x tp 2 = 8, but launch runs 4 ranks "
        f"(nnodes 1 x nproc_per_node 4); make the degrees multiply to 4, or set one of them to -1 to infer it "
        f"from the world size"])
    path = write(tmp_path, "{dp_replicate: 3}")  # dp_shard's default -1 cannot be 4 / 3
    assert validate(capsys, path) == (2, [
        f"{at(path)}: parallel: dp_shard -1 is inferred as the world size / (dp_replicate 3 = 3), "
        f"but launch runs 4 ranks (nnodes 1 x nproc_per_node 4), which 3 does not divide; make the other degrees "
        f"multiply to a divisor of 4"])
    assert validate(capsys, write(tmp_path, "{dp_replicate: 2}")) == (0, [])  # HSDP 2 x 2: dp_shard inferred 2


def test_degrees_are_whole_numbers_and_at_most_one_is_inferred(tmp_path, capsys):
    path = write(tmp_path, "{dp_shard: 4, tp: 0}")
    assert validate(capsys, path) == (2, [
        f"{at(path, 'tp')}: parallel.tp: a degree is a whole number >= 1, or -1 to infer it from the "
        f"world size (got 0)"])
    code, lines = validate(capsys, write(tmp_path, "{tp: -1, pp: -1}"))
    assert code == 2 and "at most one dimension may be -1 (inferred), got pp and tp" in lines[0], lines
    # a -1 written on tp takes the place of dp_shard's default: tp 4 over the 4 ranks
    assert validate(capsys, write(tmp_path, "{tp: -1}")) == (0, [])


def test_a_dimension_the_strategy_does_not_lay_ranks_out_on_is_refused_naming_one_that_does(tmp_path, capsys):
    path = write(tmp_path, "{dp_replicate: 2, dp_shard: 1, tp: 2}", strategy="{name: ddp}")
    assert validate(capsys, path) == (2, [
        f"{at(path, 'tp')}: parallel.tp: strategy ddp does not lay ranks out on tp (parallel.tp is 2; its "
        f"dimensions: dp_replicate); strategy fsdp or pipeline lays ranks out on tp: use it, or set parallel.tp: 1"])
    path = write(tmp_path, "{dp_shard: 2, tp: 2}", strategy="{name: deepspeed, zero_stage: 3}")
    code, lines = validate(capsys, path)
    assert code == 2 and lines == [f"{at(path, 'tp')}: parallel.tp: strategy deepspeed does not lay ranks "
                                   f"out on tp (parallel.tp is 2; its dimensions: dp_shard); strategy fsdp or "
                                   f"pipeline lays ranks out on tp: use it, or set parallel.tp: 1"]
    path = write(tmp_path, "{dp_replicate: 2}", strategy="{name: ddp}")  # dp_shard's default -1 makes it 2
    code, lines = validate(capsys, path)
    assert code == 2 and lines == [f"{at(path)}: parallel.dp_shard: strategy ddp does not lay ranks "
                                   f"out on dp_shard (parallel.dp_shard is 2, inferred from -1; its dimensions: "
                                   f"dp_replicate); strategy deepspeed or fsdp or pipeline lays ranks out on dp_shard: use it, "
                                   f"or set parallel.dp_shard: 1 and put the -1 on one of ddp's dimensions"]
    assert validate(capsys, write(tmp_path, "{dp_replicate: -1, dp_shard: 1}", strategy="{name: ddp}")) == (0, [])


def test_tensor_parallel_is_refused_for_a_model_without_a_plan_and_asks_the_models_facts(tmp_path, capsys):
    assert validate(capsys, write(tmp_path, "{dp_shard: 2, tp: 2}")) == (0, [])
    path = write(tmp_path, "{dp_shard: 2, tp: 2}", model="mlp", args="{in_features: 8, num_classes: 4}")
    code, lines = validate(capsys, path)
    assert code == 2 and lines == [f"{at(path, 'tp')}: parallel.tp: model mlp cannot be split over tp 2 "
                                   f"ranks: it declares no tensor-parallel plan; use parallel.tp: 1, or a model "
                                   f"whose plugin declares one (a `tensor_parallel_plan()` method on the module, and "
                                   f"model facts whose `tensor_parallel_refusal` accepts the tp; docs/plugins.md)"]
    path = write(tmp_path, "{dp_shard: 2, tp: 2}", args="{vocab_size: 264, dim: 30, layers: 2, heads: 3, seq_len: 16}")
    code, lines = validate(capsys, path)
    assert code == 2 and len(lines) == 1 and "model transformer cannot be split over tp 2 ranks" in lines[0] \
        and "heads" in lines[0], lines


def test_compile_with_tensor_parallel_is_accepted_alone_and_with_checkpointing(tmp_path, capsys):
    """Refused until issue 40 (the embedding's collective reached the first compiled block in flight and
    its gradient came back wrong); the compatibility grid now trains both (compile x tp cells)."""
    for performance in ("{compile: true}", "{compile: true, activation_checkpointing: full}"):
        for mesh in ("{dp_shard: 2, tp: 2}", "{dp_replicate: 2, dp_shard: 2}"):
            path = write(tmp_path, mesh)
            path.write_text(path.read_text() + f"performance: {performance}\n")
            assert validate(capsys, path) == (0, []), (mesh, performance)


def test_the_pipelines_data_parallel_is_an_alias_of_dp_replicate(tmp_path, capsys):
    """Left out, the parallel block's dp_replicate is the pipeline's replicas (plan shows them); given in
    both places with different values, the recipe says two things and is refused."""
    path = write(tmp_path, "{pp: 2, dp_replicate: 2, dp_shard: 1}", strategy="{name: pipeline}")
    assert validate(capsys, path) == (0, [])
    from trainkit.recipe import resolve

    resolved = resolve(path)
    assert "2 pipeline replicas" in "\n".join(resolved.recipe.strategy.plan_lines(resolved.recipe))
    path = write(tmp_path, "{pp: 2, dp_replicate: 2, dp_shard: 1}", strategy="{name: pipeline, data_parallel: 1}")
    assert validate(capsys, path) == (2, [
        f"{path}:7:43: strategy.data_parallel: strategy.data_parallel 1 and parallel.dp_replicate 2 both give the "
        f"pipeline replicas, differently; leave strategy.data_parallel out (parallel.dp_replicate sets it), or set "
        f"it to 2"])
    path = write(tmp_path, "{pp: 2, dp_replicate: 2, dp_shard: 1}", strategy="{name: pipeline, data_parallel: 2}")
    assert validate(capsys, path) == (0, [])


def test_an_elastic_launch_needs_a_dimension_that_grows_with_the_nodes(tmp_path, capsys):
    elastic = "{nproc_per_node: 2, nnodes: '1:3', rdzv_endpoint: 'node0:29400'}"
    path = write(tmp_path, "{dp_replicate: 2, dp_shard: 2}", launch=elastic)
    assert validate(capsys, path) == (2, [
        f"{at(path)}: parallel: launch.nnodes '1:3' starts 2, 4, 6 ranks (nproc_per_node 2 per node), "
        f"but dp_replicate 2 x dp_shard 2 = 4 fits one world size at most; set one dimension to -1 (e.g. "
        f"dp_shard: -1) so that it grows with the nodes"])
    path = write(tmp_path, "{tp: 2}", launch=elastic)  # dp_shard -1: 1, 2 or 3 with tp 2 on 2, 4, 6 ranks
    assert validate(capsys, path) == (0, [])
    path = write(tmp_path, "{tp: 4}", launch=elastic)  # 4 does not divide 2 or 6 ranks: the first size is named
    code, lines = validate(capsys, path)
    assert code == 2 and lines == [f"{at(path)}: parallel: dp_shard -1 is inferred as the world size "
                                   f"/ (tp 4 = 4), but launch runs 2 ranks (nnodes 1 x nproc_per_node 2), which 4 "
                                   f"does not divide; make the other degrees multiply to a divisor of 2 at every "
                                   f"node count of the elastic range"]


def init_device_mesh_groups(dims: dict[str, int]) -> dict[str, set[tuple[int, ...]]]:
    """The groups torch's own `init_device_mesh` builds for each dimension, rank by rank (fake process group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world, groups = 1, {}
    for n in dims.values():
        world *= n
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
            for name, n in dims.items():
                if n > 1:
                    groups.setdefault(name, set()).add(tuple(dist.get_process_group_ranks(mesh.get_group(name))))
        finally:
            dist.destroy_process_group()
    return groups


def planned_groups(text: str) -> dict[str, set[tuple[int, ...]]]:
    found = {}
    for dim, groups in re.findall(r"^  (\w+): +\d+ group\(s\) of \d+: (.*)$", text, re.M):
        found[dim] = {tuple(int(r) for r in g.split(",")) for g in re.findall(r"\[([\d,]+)\]", groups)}
    return found


def test_plan_shows_the_groups_init_device_mesh_builds_and_the_global_batch_over_data_parallel(tmp_path, capsys, monkeypatch,
                                                                                             text_files):
    path = write(tmp_path, "{dp_replicate: 2, dp_shard: 2, tp: 2}", launch="{nproc_per_node: 8}")
    text = plan(capsys, monkeypatch, path, text_files)
    assert ("mesh:            pp 1 x dp_replicate 2 x dp_shard 2 x tp 2 = 8 ranks (init_device_mesh order; "
            "data-parallel 4 = dp_replicate x dp_shard)") in text
    assert planned_groups(text) == init_device_mesh_groups({"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 2})
    assert "  tp:            4 group(s) of 2: [0,1] [2,3] [4,5] [6,7]" in text  # neighbours: one node's links
    # the tp ranks of one data-parallel group read the same batch: 4 x 4, not 4 x 8
    assert "global batch:    16  (batch_size 4 x data-parallel 4 x grad_accum_steps 1)" in text
    # the memory plan: FSDP shards over dp_shard 2 (HSDP's replicas hold copies), tensor parallel splits by 2
    assert re.search(r"^  parameters: +\S+ GiB  [\d,]+ x 4 B / 4$", text, re.M), text


def test_a_recipe_without_the_block_plans_as_before(tmp_path, capsys, monkeypatch, text_files):
    path = write(tmp_path, "{dp_replicate: 2}")
    path.write_text(path.read_text().replace("parallel: {dp_replicate: 2}\n", ""))
    text = plan(capsys, monkeypatch, path, text_files)
    assert "mesh:" not in text
    assert "global batch:    16  (batch_size 4 x data-parallel 4 x grad_accum_steps 1)" in text
    assert re.search(r"^  parameters: +\S+ GiB  [\d,]+ x 4 B / 4$", text, re.M), text  # FSDP over all 4


@pytest.mark.slow
def test_validating_a_mesh_imports_no_torch(tmp_path):
    path = write(tmp_path, "{dp_shard: 2, tp: 2}")
    code = ("import sys; from trainkit.cli import main\n"
            "code = main(['validate', sys.argv[1]])\n"
            "print('EXIT', code, 'HEAVY', [m for m in ('torch', 'deepspeed', 'mlflow') if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert "EXIT 0 HEAVY []" in res.stdout, res.stdout + res.stderr


def test_compile_with_tensor_parallel_inside_pipeline_stages_is_refused(tmp_path, capsys):
    """The wait before the first compiled tensor-parallel block is FSDP's (strategies/fsdp.py); sharded
    pipeline stages compile their blocks without it, so validate refuses that combination."""
    path = write(tmp_path, "{pp: 2, dp_shard: 2, tp: 2}", strategy="{name: pipeline, microbatches: 2}",
                 launch="{nproc_per_node: 8}")
    path.write_text(path.read_text() + "performance: {compile: true}\n")
    code, lines = validate(capsys, path)
    assert code == 2 and any("performance.compile with tensor parallel inside pipeline stages" in line
                             for line in lines), lines
    path = write(tmp_path, "{pp: 2, dp_shard: 2, tp: 2}", strategy="{name: pipeline, microbatches: 2}",
                 launch="{nproc_per_node: 8}")
    assert validate(capsys, path) == (0, [])  # the same mesh without compile
