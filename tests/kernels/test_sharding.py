"""Expert-parallel sharding: placements, shard checkpoints, and shard outputs adding up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lutb_kernels.checkpoint import Checkpoint, CheckpointWriter
from lutb_kernels.experts import ReferenceExperts
from lutb_kernels.sharding import (
    balanced_placement,
    contiguous_placement,
    plan_placement,
    read_load_file,
    write_load_file,
    write_shards,
)
from lutb_kernels.synth import make_synthetic_checkpoint
from lutb_server.cli import main


@pytest.mark.parametrize("experts, shards", [(8, 1), (8, 3), (7, 7), (128, 4)])
def test_contiguous_placement_covers_each_expert_once(experts: int, shards: int) -> None:
    plan = contiguous_placement(list(range(experts)), shards)
    assert [e for part in plan for e in part] == list(range(experts))
    assert max(map(len, plan)) - min(map(len, plan)) <= 1


def test_placements_refuse_impossible_splits() -> None:
    with pytest.raises(ValueError, match="cannot split 3 experts into 4 shards"):
        contiguous_placement([0, 1, 2], 4)
    with pytest.raises(ValueError, match="at least 2 shards"):
        balanced_placement({0: 1.0, 1: 2.0}, 1, replicas=1)


def test_an_empty_placement_is_refused(tmp_path: Path) -> None:
    """A placement of no layers (as from a checkpoint of none) crashed with a bare StopIteration."""
    make_synthetic_checkpoint(tmp_path / "src", layers=1, experts=4, hidden=128, intermediate=128)
    with pytest.raises(ValueError, match="holds no layers"):
        write_shards(Checkpoint(tmp_path / "src"), tmp_path / "out", {})
    assert not (tmp_path / "out").exists()


def test_balanced_placement_spreads_hot_experts() -> None:
    gen = torch.Generator().manual_seed(0)
    load = {e: float(v) for e, v in enumerate((torch.rand(32, generator=gen) ** 4 * 1000).tolist())}
    shards = 4
    plan = balanced_placement(load, shards)
    assert sorted(e for part in plan for e in part) == list(range(32))
    assert {len(p) for p in plan} == {8}
    totals = [sum(load[e] for e in p) for p in plan]
    naive = [sum(load[e] for e in p) for p in contiguous_placement(list(range(32)), shards)]
    assert max(totals) - min(totals) <= max(naive) - min(naive)
    assert max(totals) <= sum(totals) / shards + max(load.values())


@pytest.mark.parametrize("experts, shards, replicas", [(7, 3, 0), (18, 8, 0), (5, 5, 0), (33, 4, 0), (12, 3, 3), (9, 4, 2)])
def test_balanced_placement_gives_shards_equal_counts(experts: int, shards: int, replicas: int) -> None:
    """Equal memory per shard: expert counts differ by at most one, whatever the load (a hot expert
    once left its shard short: {0: 100, 1..6: 1} over 3 shards gave 1/3/3)."""
    skewed = {0: 100.0, **{e: 1.0 for e in range(1, experts)}}
    gen = torch.Generator().manual_seed(experts * 31 + shards)
    for load in (skewed, {e: float(v) for e, v in enumerate((torch.rand(experts, generator=gen) ** 6 * 1e3).tolist())}):
        plan = balanced_placement(load, shards, replicas)
        counts = [len(p) for p in plan]
        assert max(counts) - min(counts) <= 1, (load, plan)
        assert sum(counts) == experts + replicas


@pytest.mark.parametrize("load, shards, replicas", [
    ({0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 1.0, 5: 1.0}, 3, 6),  # every expert twice: gave 3/5/4
    ({0: 259.0, 1: 13.0, 2: 12005.0, 3: 11.0, 4: 16.0, 5: 25.0, 6: 16.0, 7: 25.0, 8: 16.0, 9: 22.0, 10: 13.0,
      11: 19.0, 12: 10.0, 13: 21.0, 14: 14.0, 15: 64.0}, 3, 4),  # one very hot expert: gave 5/7/8
])
def test_many_replicas_keep_counts_equal(load: dict[int, float], shards: int, replicas: int) -> None:
    """When the shards with room already hold an expert, its copy goes elsewhere and the counts drift apart; they are
    evened out afterwards, each expert still at most once per shard and the hottest ones twice."""
    plan = balanced_placement(load, shards, replicas)
    counts = [len(p) for p in plan]
    assert max(counts) - min(counts) <= 1, plan
    assert all(len(p) == len(set(p)) for p in plan)
    hottest = sorted(load, key=lambda e: (-load[e], e))[:replicas]
    assert all(sum(e in p for p in plan) == (2 if e in hottest else 1) for e in load)


def test_balanced_replicas_put_copies_of_the_hottest_on_two_shards() -> None:
    load = {e: float(e) for e in range(12)}  # 11, 10, 9 hottest
    plan = balanced_placement(load, 3, replicas=3)
    for hot in (11, 10, 9):
        assert sum(hot in p for p in plan) == 2
    for cold in range(9):
        assert sum(cold in p for p in plan) == 1
    assert all(len(p) == len(set(p)) for p in plan)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    out = tmp_path_factory.mktemp("whole")
    make_synthetic_checkpoint(out, layers=2, experts=6, hidden=128, intermediate=128, dtype="float32", seed=3)
    return Checkpoint(out)


def test_shard_outputs_add_up_to_the_whole_layer(ckpt: Checkpoint, tmp_path: Path) -> None:
    load = {layer: [1.0, 50.0, 3.0, 40.0, 2.0, 9.0] for layer in ckpt.layers}
    plan = plan_placement(ckpt, 3, placement="balanced", load=load)
    dirs = write_shards(ckpt, tmp_path, plan)
    manifest = json.loads((tmp_path / "shards.json").read_text())
    assert manifest["shards"] == ["shard-0", "shard-1", "shard-2"]
    assert manifest["source_content_hash"] == ckpt.content_hash()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 128, generator=gen)
    ids = torch.randint(0, 6, (40, 2), generator=gen)
    weights = torch.rand(40, 2, generator=gen)
    for layer in ckpt.layers:
        whole = ReferenceExperts(ckpt.config, ckpt.layer(layer), "cpu").forward(x, ids, weights)
        parts = []
        for d in dirs:
            shard = Checkpoint(d)
            shard.validate()
            assert shard.config == ckpt.config
            parts.append(ReferenceExperts(shard.config, shard.layer(layer), "cpu").forward(x, ids, weights))
        assert sorted(e for d in dirs for e in Checkpoint(d).expert_ids(layer).tolist()) == list(range(6))
        rel = ((sum(parts) - whole).norm() / whole.norm()).item()
        assert rel <= 1e-5


def test_shard_help_says_outputs_add_up_only_without_replicas() -> None:
    """`lutb shard --help` promised that the shards' outputs add up to the whole layer, false with --replicas:
    a replicated expert's routes sent to both holders count twice."""
    from lutb_server.cli import build_parser

    sub = next(a for a in build_parser()._subparsers._group_actions if isinstance(a.choices, dict))
    text = " ".join(sub.choices["shard"].description.split())
    assert "the shards' outputs add up to the whole layer" not in text
    assert "Without --replicas every expert is on exactly one shard, so the shards' outputs for a call add up" in text
    assert "each route must go to exactly one of its holders" in text


def test_cli_shard_contiguous_and_balanced(ckpt: Checkpoint, tmp_path: Path) -> None:
    assert main(["shard", str(ckpt.path), "--out", str(tmp_path / "c"), "--shards", "2"]) == 0
    assert Checkpoint(tmp_path / "c" / "shard-1").expert_ids(0).tolist() == [3, 4, 5]
    load_file = tmp_path / "load.json"
    write_load_file(load_file, 6, {layer: [0, 0, 0, 0, 100, 90] for layer in ckpt.layers})
    assert read_load_file(load_file)[0] == [0, 0, 0, 0, 100.0, 90.0]
    out = tmp_path / "b"
    args = ["shard", str(ckpt.path), "--out", str(out), "--shards", "2", "--placement", "balanced", "--load", str(load_file), "--replicas", "1"]
    assert main(args) == 0
    held = [Checkpoint(out / f"shard-{s}").expert_ids(1).tolist() for s in range(2)]
    assert 4 in held[0] and 4 in held[1]  # the hottest expert is on both shards
    assert 5 in held[0] or 5 in held[1]
    assert not set(held[0]) >= {4, 5} or not set(held[1]) >= {4, 5}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--placement", "balanced"], "needs a load file"),
        (["--replicas", "1"], "go with --placement balanced"),
        (["--shards", "9"], "cannot split 6 experts into 9 shards"),
    ],
)
def test_cli_shard_errors(ckpt: Checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    args = ["shard", str(ckpt.path), "--out", str(tmp_path / "x"), "--shards", "2", *extra]
    if "--shards" in extra:
        args = ["shard", str(ckpt.path), "--out", str(tmp_path / "x"), *extra]
    assert main(args) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "payload, message",
    [
        ('{"format": "lutb-load-v1", "num_experts": 5, "layers": {"0": [1, 1, 1, 1, 1], "1": [1, 1, 1, 1, 1]}}',
         "counts 5 experts for layer 0; the checkpoint's model has 6"),
        ('{"format": "lutb-load-v1", "layers": {}}', "positive integer 'num_experts'"),
        ('{"format": "lutb-load-v1", "num_experts": 6, "layers": {"0": [1, 1, "x", 1, 1, 1]}}', "list of numbers"),
        ('{"format": "lutb-load-v1", "num_experts": 6, "layers": {"a": [1, 1, 1, 1, 1, 1]}}', "not a layer index"),
        ('[1, 2]', "not a load file"),
        ('{"format": "lutb-load-v1", ', "not JSON"),
    ],
)
def test_cli_shard_refuses_a_bad_load_file(ckpt: Checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           payload: str, message: str) -> None:
    """Each of these once ended in a traceback (IndexError, KeyError, TypeError, AttributeError)."""
    (tmp_path / "load.json").write_text(payload)
    args = ["shard", str(ckpt.path), "--out", str(tmp_path / "x"), "--shards", "2", "--placement", "balanced",
            "--load", str(tmp_path / "load.json")]
    assert main(args) == 1
    assert message in capsys.readouterr().err


def test_shards_are_never_written_over_their_source(tmp_path: Path) -> None:
    """A shard directory that is the checkpoint being sharded is refused, even with overwrite."""
    source = tmp_path / "shard-0"
    make_synthetic_checkpoint(source, layers=1, experts=4, hidden=128, intermediate=128, dtype="float32", seed=1)
    ckpt = Checkpoint(source)
    files = sorted(p.name for p in source.iterdir())
    plan = plan_placement(ckpt, 2)
    with pytest.raises(FileExistsError, match="files being converted"):
        write_shards(ckpt, tmp_path, plan, overwrite=True)
    assert sorted(p.name for p in source.iterdir()) == files
    Checkpoint(source).validate()


def _placement(out: Path, layer: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert ids of each shard directory in ``out``, what shards.json says) for ``layer``."""
    held = [Checkpoint(d).expert_ids(layer).tolist() for d in sorted(out.glob("shard-*"))]
    return held, json.loads((out / "shards.json").read_text())["layers"][str(layer)]


@pytest.mark.parametrize("stop", ["writing a shard", "committing the shards", "swapping the directory in"])
def test_an_interrupted_reshard_leaves_the_old_shards(ckpt: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      stop: str) -> None:
    """The shard writers once committed one after another (each deleting its old files, then renaming its new
    ones), shards.json last: stopped in between, shards of two placements were left side by side, every one
    loadable, so experts were lost and duplicated while shards.json described the old placement."""
    out = tmp_path / "ep"
    write_shards(ckpt, out, plan_placement(ckpt, 2))  # contiguous: [0, 1, 2], [3, 4, 5]
    before = _placement(out, 0)
    assert before == ([[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [3, 4, 5]])
    balanced = plan_placement(ckpt, 2, placement="balanced", load={layer: [9.0, 8.0, 1.0, 0.0, 2.0, 3.0] for layer in ckpt.layers})
    assert balanced[0] != before[1]
    if stop != "swapping the directory in":
        method = "write_layer" if stop == "writing a shard" else "finish"
        real, calls = getattr(CheckpointWriter, method), []

        def stopped(self: CheckpointWriter, *args: object) -> object:
            calls.append(self.path)
            if len(calls) == (3 if method == "write_layer" else 2):  # layer 1 of shard 0 / the second shard's commit
                raise KeyboardInterrupt
            return real(self, *args)

        monkeypatch.setattr(CheckpointWriter, method, stopped)
    else:
        real_rename = Path.rename

        def stopped(self: Path, target: Path) -> Path:  # the staged output directory renamed to `out`
            if Path(target) == out.resolve() and self.name.startswith(".ep.partial-"):
                raise KeyboardInterrupt
            return real_rename(self, target)

        monkeypatch.setattr(Path, "rename", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_shards(ckpt, out, balanced, overwrite=True)
    monkeypatch.undo()
    assert _placement(out, 0) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ep"]  # no staging directory left


def test_resharding_to_fewer_shards_leaves_no_old_shard(ckpt: Checkpoint, tmp_path: Path) -> None:
    """`--overwrite` with fewer shards once kept shard-2 .. of the earlier split, loadable, holding experts the new
    shards hold too."""
    out = tmp_path / "ep"
    write_shards(ckpt, out, plan_placement(ckpt, 4))
    write_shards(ckpt, out, plan_placement(ckpt, 2), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["shard-0", "shard-1", "shards.json"]
    assert _placement(out, 1) == ([[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [3, 4, 5]])


def test_shard_output_refuses_a_directory_holding_other_files(ckpt: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ep"
    write_shards(ckpt, out, plan_placement(ckpt, 2))
    with pytest.raises(FileExistsError, match="already holds shard checkpoints"):
        write_shards(ckpt, out, plan_placement(ckpt, 3))
    (out / "README").write_text("mine")
    with pytest.raises(FileExistsError, match="README, not shard checkpoints"):
        write_shards(ckpt, out, plan_placement(ckpt, 3), overwrite=True)
    assert (out / "README").is_file() and len(_placement(out, 0)[0]) == 2


def test_cli_shard_shows_progress_while_hashing_the_source(ckpt: Checkpoint, tmp_path: Path,
                                                            stderr_while_hashing: list[str]) -> None:
    """shards.json records the source's content hash, which reads every byte: that pass once showed nothing."""
    assert main(["shard", str(ckpt.path), "--out", str(tmp_path / "ep"), "--shards", "2"]) == 0
    during = stderr_while_hashing
    assert len(during) == 1 and "hash" in during[0] and "100%" in during[0]


def test_a_damaged_source_is_not_sharded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its shards would carry fresh checksums of the damage and pass every check downstream (review)."""
    src = tmp_path / "src"
    make_synthetic_checkpoint(src, layers=2, experts=6, hidden=128, intermediate=128, dtype="float32", seed=3)
    file = src / "layer-00001.safetensors"
    data = bytearray(file.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)
    file.write_bytes(bytes(data))
    assert main(["shard", str(src), "--out", str(tmp_path / "ep"), "--shards", "2"]) != 0
    assert "layer-00001.safetensors differs from the sha256 in SHA256SUMS" in capsys.readouterr().err
    assert not (tmp_path / "ep").exists()
