"""Checkpoints (spec section 5): round trip, and every corruption refused with file, tensor and tile named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lutb_kernels.checkpoint import (
    CHECKSUMS,
    Checkpoint,
    CheckpointConfig,
    CheckpointWriter,
    LayerWeights,
    check_layer,
    file_sha256,
    write_checkpoint,
    write_checksums,
)
from lutb_kernels.errors import LutBFormatError
from lutb_kernels.tiles import pack_tiles

CONFIG = CheckpointConfig(hidden_size=256, intermediate_size=128, num_experts=6, activation="silu", dtype="bfloat16")


def _tiles(*lead: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return pack_tiles(
        torch.randint(0, 8, (*lead, 128, 128), generator=gen, dtype=torch.uint8),
        torch.randint(115, 125, (*lead, 128, 4), generator=gen, dtype=torch.uint8),
        torch.randn(*lead, 8, generator=gen).bfloat16(),
    )


def _layer(ids: list[int], seed: int, config: CheckpointConfig = CONFIG) -> LayerWeights:
    e = len(ids)
    return LayerWeights(
        _tiles(*config.w13_tiles_shape(e), seed=seed),
        _tiles(*config.w2_tiles_shape(e), seed=seed + 100),
        torch.tensor(ids, dtype=torch.int32),
    )


@pytest.fixture()
def ckpt_dir(tmp_path: Path) -> Path:
    write_checkpoint(tmp_path / "ckpt", CONFIG, {0: _layer([0, 2, 5], 1), 3: _layer([1, 2], 2)})
    return tmp_path / "ckpt"


def test_round_trip(ckpt_dir: Path) -> None:
    ckpt = Checkpoint(ckpt_dir)
    assert ckpt.config == CONFIG
    assert ckpt.layers == [0, 3]
    layer = ckpt.layer(3)
    want = _layer([1, 2], 2)
    assert all(torch.equal(a, b) for a, b in zip(layer, want))
    assert ckpt.expert_ids(0).tolist() == [0, 2, 5]
    ckpt.validate()
    assert ckpt.weight_bytes == (3 + 2) * (2 * 2 + 2 * 1) * 6672
    with safe_open(str(ckpt_dir / "layer-00000.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta == {
        "format": "lut-b", "format_version": "1", "hidden_size": "256", "intermediate_size": "128",
        "num_experts": "6", "activation": "silu", "dtype": "bfloat16", "mxfp8_scale_mode": "rceil",
    }
    with pytest.raises(KeyError, match="no layer 1"):
        ckpt.layer(1)


def test_content_hash_is_stable_and_content_sensitive(ckpt_dir: Path, tmp_path: Path) -> None:
    h = Checkpoint(ckpt_dir).content_hash()
    assert h.startswith("sha256:") and h == Checkpoint(ckpt_dir).content_hash()
    write_checkpoint(tmp_path / "other", CONFIG, {0: _layer([0, 2, 5], 1), 3: _layer([1, 2], 3)})
    assert Checkpoint(tmp_path / "other").content_hash() != h


def test_reader_accepts_tensors_split_over_files(tmp_path: Path) -> None:
    layer = _layer([4], 9)
    meta = CONFIG.to_metadata()
    save_file({"layers.7.w13": layer.w13, "layers.7.expert_ids": layer.expert_ids}, str(tmp_path / "a.safetensors"), metadata=meta)
    save_file({"layers.7.w2": layer.w2}, str(tmp_path / "b.safetensors"), metadata=meta)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.layers == [7]
    ckpt.validate()
    bad = layer.w2.clone()
    bad[0, 0, 0, 16] = 255  # a reserved E8M0 scale byte in w2, which sits in b.safetensors
    save_file({"layers.7.w2": bad}, str(tmp_path / "b.safetensors"), metadata=meta)
    with pytest.raises(LutBFormatError, match=r"a.safetensors, b.safetensors: layers.7.w2"):  # named a.safetensors alone
        Checkpoint(tmp_path).validate()


def _rewrite(path: Path, change) -> None:
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        meta = dict(f.metadata())
    change(tensors, meta)
    save_file(tensors, str(path), metadata=meta)
    if (path.parent / CHECKSUMS).exists():  # as a writer that wrote the bad tensor would: the format checks must find it
        write_checksums(path.parent, sorted(path.parent.glob("*.safetensors")))


LAYER0 = "layer-00000.safetensors"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t, m: t["layers.0.w13"][1, 0, 1].__setitem__(16, 255), r"layer-00000.safetensors: layers\.0\.w13: tile \(1, 0, 1\): scale byte 255"),
        (lambda t, m: t["layers.0.w2"][2, 1, 0, 0:2].copy_(torch.tensor([0x80, 0x7F], dtype=torch.uint8)), r"layers\.0\.w2: tile \(2, 1, 0\): LUT entry is NaN or infinite"),
        (lambda t, m: t.__setitem__("layers.0.w2", t["layers.0.w2"][..., :-1].contiguous()), r"layers\.0\.w2: last dimension must be 6672"),
        (lambda t, m: t.__setitem__("layers.0.w13", t["layers.0.w13"][:, :1].contiguous()), r"layers\.0\.w13: tile counts \(3, 1, 2\) disagree .* give \(3, 2, 2\)"),
        (lambda t, m: t.__setitem__("layers.0.expert_ids", torch.tensor([0, 5, 2], dtype=torch.int32)), r"layers\.0\.expert_ids: ids must be strictly ascending"),
        (lambda t, m: t.__setitem__("layers.0.expert_ids", torch.tensor([0, 2, 6], dtype=torch.int32)), r"layers\.0\.expert_ids: ids must lie in \[0, 6\)"),
        (lambda t, m: t.__setitem__("layers.0.expert_ids", torch.tensor([0, 2, 5], dtype=torch.int64)), r"expert_ids: must be a 1-D int32"),
    ],
)
def test_tensor_corruptions_refused(ckpt_dir: Path, change, message: str) -> None:
    _rewrite(ckpt_dir / LAYER0, change)
    with pytest.raises(LutBFormatError, match=message):
        Checkpoint(ckpt_dir).validate()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t, m: m.__setitem__("format", "gguf"), r"layer-00000.safetensors: metadata format is 'gguf'"),
        (lambda t, m: m.__setitem__("format_version", "2"), r"unsupported format_version '2'"),
        (lambda t, m: m.pop("mxfp8_scale_mode"), r"metadata lacks 'mxfp8_scale_mode'"),
        (lambda t, m: m.__setitem__("hidden_size", "25x"), r"hidden_size = '25x' is not an integer"),
        (lambda t, m: m.__setitem__("hidden_size", "200"), r"multiples of 128"),
        (lambda t, m: m.__setitem__("activation", "tanh"), r"unknown activation 'tanh'"),
        (lambda t, m: m.__setitem__("mxfp8_scale_mode", "round"), r"unknown MXFP8 scale mode"),
        (lambda t, m: m.__setitem__("dtype", "int8"), r"dtype must be one of"),
        (lambda t, m: m.__setitem__("num_experts", "7"), r"layer-00003.safetensors: metadata .* disagrees"),
        (lambda t, m: t.__setitem__("layers.0.bias", torch.zeros(1)), r"unexpected tensor 'layers.0.bias'"),
        (lambda t, m: t.pop("layers.0.w2"), r"layer 0 lacks tensor layers\.0\.w2"),
    ],
)
def test_structure_corruptions_refused_on_open(ckpt_dir: Path, change, message: str) -> None:
    _rewrite(ckpt_dir / LAYER0, change)
    with pytest.raises(LutBFormatError, match=message):
        Checkpoint(ckpt_dir)


def test_empty_or_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(LutBFormatError, match="holds no .safetensors"):
        Checkpoint(tmp_path)
    with pytest.raises(LutBFormatError, match="not a directory"):
        Checkpoint(tmp_path / "nope")


def test_writer_refuses_bad_layer_and_existing_checkpoint(ckpt_dir: Path, tmp_path: Path) -> None:
    bad = _layer([0, 1], 4)._replace(expert_ids=torch.tensor([1, 0], dtype=torch.int32))
    with pytest.raises(LutBFormatError, match="ascending"):
        write_checkpoint(tmp_path / "bad", CONFIG, {0: bad})
    with pytest.raises(FileExistsError):
        write_checkpoint(ckpt_dir, CONFIG, {0: _layer([0], 1)})
    write_checkpoint(ckpt_dir, CONFIG, {0: _layer([0], 1)}, overwrite=True)
    assert Checkpoint(ckpt_dir).layers == [0]


def test_no_mul_activation_has_i_rows(tmp_path: Path) -> None:
    config = CheckpointConfig(hidden_size=128, intermediate_size=256, num_experts=2, activation="relu2_no_mul", dtype="float32")
    assert config.w13_tiles_shape(2) == (2, 2, 1)
    write_checkpoint(tmp_path, config, {0: _layer([0, 1], 5, config)})
    Checkpoint(tmp_path).validate()


def test_content_hash_ignores_file_split_and_header_order(ckpt_dir: Path, tmp_path: Path) -> None:
    ckpt = Checkpoint(ckpt_dir)
    meta = dict(reversed(list(CONFIG.to_metadata().items())))  # another header order
    tensors = {}
    for layer in ckpt.layers:
        for part, tensor in zip(("w13", "w2", "expert_ids"), ckpt.layer(layer)):
            tensors[f"layers.{layer}.{part}"] = tensor
    save_file(tensors, str(tmp_path / "all.safetensors"), metadata=meta)
    assert Checkpoint(tmp_path).content_hash() == ckpt.content_hash()


@pytest.mark.parametrize("cut", [100, 10_000])
def test_a_truncated_file_is_refused_naming_it(ckpt_dir: Path, cut: int) -> None:
    """A damaged file once surfaced as safetensors' own error, naming no file (a traceback from lutb inspect)."""
    file = ckpt_dir / "layer-00003.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - cut])
    with pytest.raises(LutBFormatError, match="layer-00003.safetensors: unreadable safetensors file"):
        Checkpoint(ckpt_dir).layer(3)


def test_a_tile_tensor_of_one_dimension_is_refused(ckpt_dir: Path) -> None:
    """A w13 saved flat once raised IndexError from the cheap layer check instead of a format error."""
    file = ckpt_dir / "layer-00000.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors, metadata = {name: f.get_tensor(name) for name in f.keys()}, f.metadata()
    tensors["layers.0.w13"] = tensors["layers.0.w13"].reshape(-1)
    save_file(tensors, str(file), metadata=metadata)
    with pytest.raises(LutBFormatError, match=r"layers.0.w13: must be a uint8 tensor of tiles"):
        Checkpoint(ckpt_dir).layer(0)


@pytest.mark.parametrize("layer", [-1, 2**31])
def test_writer_refuses_a_layer_index_outside_int32(tmp_path: Path, layer: int) -> None:
    """``layers.-1.*`` was written, and then refused by the reader as an unexpected tensor name; ``layers.2147483648.*``
    was written and read, and the server failed only after loading it all (ModelInfo's layer is int32)."""
    with pytest.raises(LutBFormatError, match=r"layer index must be an integer in \[0, 2147483647\]"):
        write_checkpoint(tmp_path / "out", CONFIG, {layer: _layer([0], 1)})


def test_a_checkpoint_of_a_layer_index_above_int32_is_refused_on_open(tmp_path: Path) -> None:
    good = tmp_path / "good"
    write_checkpoint(good, CONFIG, {0: _layer([0], 1)})
    (file,) = good.glob("*.safetensors")
    with safe_open(file, "pt") as f:
        tensors = {name.replace("layers.0.", f"layers.{2**31}."): f.get_tensor(name) for name in f.keys()}
        metadata = f.metadata()
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, bad / file.name, metadata=metadata)
    with pytest.raises(LutBFormatError, match=f"{file.name}: layer index {2**31} is above 2147483647"):
        Checkpoint(bad)


def test_a_checkpoint_of_no_layers_is_refused_on_open(tmp_path: Path) -> None:
    """A file of metadata alone opened as a valid checkpoint of no layers, which a server then served (holding
    nothing) and ``lutb shard`` crashed on (StopIteration)."""
    good = tmp_path / "good"
    write_checkpoint(good, CONFIG, {0: _layer([0], 1)})
    (file,) = good.glob("*.safetensors")
    with safe_open(file, "pt") as f:
        metadata = f.metadata()
    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({}, empty / file.name, metadata=metadata)
    with pytest.raises(LutBFormatError, match="holds no layers"):
        Checkpoint(empty)


def test_an_output_another_writer_finished_meanwhile_is_not_replaced(tmp_path: Path) -> None:
    """Two writers of one new directory without ``overwrite``: the checks ran only when each started, so the one that
    finished second replaced the first one's checkpoint (and would have removed any file put there meanwhile)."""
    out = tmp_path / "out"
    first = CheckpointWriter(out, CONFIG)
    second = CheckpointWriter(out, CONFIG)
    first.write_layer(0, _layer([0], 1))
    second.write_layer(0, _layer([1], 2))
    first.finish()
    with pytest.raises(FileExistsError, match="already holds"):
        second.finish()
    second.discard()
    assert Checkpoint(out).expert_ids(0).tolist() == [0]  # the first writer's
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # the second's staging is gone


def test_an_overwrite_of_the_working_directory_is_refused(ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out .`` replaced the directory the shell stood in: it then stood in a deleted one."""
    monkeypatch.chdir(ckpt_dir)
    with pytest.raises(FileExistsError, match="is the working directory or holds it"):
        write_checkpoint(Path("."), CONFIG, {0: _layer([0], 1)}, overwrite=True)


def test_a_read_only_checkpoint_is_overwritten_and_removed(ckpt_dir: Path) -> None:
    """The staging took the old directory's mode when made, so a read-only checkpoint made it unwritable and the first
    layer failed with a path inside a hidden directory (for a user whom permissions bind: root, as CI runs, wrote it
    anyway); the old directory's files then could not be removed either. The mode kept and the removal are checked
    for every user."""
    ckpt_dir.chmod(0o555)
    try:
        write_checkpoint(ckpt_dir, CONFIG, {0: _layer([2], 3)}, overwrite=True)
        assert Checkpoint(ckpt_dir).expert_ids(0).tolist() == [2]
        assert ckpt_dir.stat().st_mode & 0o777 == 0o555  # the old directory's mode, kept
        assert not [p for p in ckpt_dir.parent.iterdir() if p.name.startswith(f".{ckpt_dir.name}.")]
    finally:
        ckpt_dir.chmod(0o755)


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_an_overwrite_stopped_in_the_commit_leaves_the_old_checkpoint(ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """finish() once deleted the old files, then renamed the new ones one by one: stopped after the first rename,
    the directory opened as a complete checkpoint of one layer. Now the new directory is swapped in whole."""
    old_hash, before = Checkpoint(ckpt_dir).content_hash(), _siblings(ckpt_dir)
    real_rename, calls = Path.rename, []

    def stopped_at_the_second_rename(self: Path, target: Path) -> Path:  # (a KeyboardInterrupt, a failing rename)
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt("stopped in finish()")
        return real_rename(self, target)

    with pytest.raises(KeyboardInterrupt):
        with CheckpointWriter(ckpt_dir, CONFIG, overwrite=True) as writer:
            for layer in range(3):
                writer.write_layer(layer, _layer([layer], 10 + layer))
            monkeypatch.setattr(Path, "rename", stopped_at_the_second_rename)
    monkeypatch.undo()
    ckpt = Checkpoint(ckpt_dir)
    assert ckpt.layers == [0, 3] and ckpt.content_hash() == old_hash
    assert _siblings(ckpt_dir) == before  # the new layers are gone, nothing was left beside the checkpoint


def test_a_failed_conversion_leaves_the_old_checkpoint_and_nothing_else(ckpt_dir: Path) -> None:
    old_hash, before = Checkpoint(ckpt_dir).content_hash(), _siblings(ckpt_dir)
    with pytest.raises(RuntimeError, match="conversion failed"):
        with CheckpointWriter(ckpt_dir, CONFIG, overwrite=True) as writer:
            writer.write_layer(0, _layer([1], 7))
            raise RuntimeError("conversion failed")
    assert Checkpoint(ckpt_dir).content_hash() == old_hash and _siblings(ckpt_dir) == before
    with CheckpointWriter(ckpt_dir, CONFIG, overwrite=True) as writer:
        writer.write_layer(5, _layer([1], 7))
    assert Checkpoint(ckpt_dir).layers == [5] and _siblings(ckpt_dir) == before


def test_writer_refuses_a_layer_written_twice(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layer 2 was written already"):
        with CheckpointWriter(tmp_path / "ckpt", CONFIG) as writer:
            writer.write_layer(2, _layer([0], 1))
            writer.write_layer(2, _layer([1], 2))
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.iterdir())


def test_writer_refuses_to_replace_a_directory_holding_other_files(ckpt_dir: Path) -> None:
    """The writer replaces the whole directory, so one holding anything but a checkpoint is never its output."""
    (ckpt_dir / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt, not safetensors files"):
        CheckpointWriter(ckpt_dir, CONFIG, overwrite=True)
    assert (ckpt_dir / "notes.txt").read_text() == "mine" and Checkpoint(ckpt_dir).layers == [0, 3]


def test_a_killed_writers_staging_directory_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / f".ckpt.partial-{2**22 + 1}-0badf00d"  # above any pid_max: that writer's process is gone
    stale.mkdir()
    (stale / "layer-00000.safetensors").write_bytes(b"half")
    write_checkpoint(tmp_path / "ckpt", CONFIG, {0: _layer([0], 1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_live_writers_staging_directory_is_kept_whatever_its_pid(tmp_path: Path) -> None:
    """A writer in another PID namespace (another container on a shared volume) has a pid that names no process
    here: its staging directory was removed as a killed writer's while it wrote. Its lock on the directory now
    says it lives."""
    import fcntl
    import os

    live = tmp_path / f".ckpt.partial-{2**22 + 1}-0badf00d"  # a pid no process here has
    live.mkdir()
    (live / "layer-00000.safetensors").write_bytes(b"being written")
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the other writer's StagedDirectory holds it
        write_checkpoint(tmp_path / "ckpt", CONFIG, {0: _layer([0], 1)})
        assert (live / "layer-00000.safetensors").read_bytes() == b"being written"
    finally:
        os.close(fd)  # that writer is gone now: the next writer removes its leftovers
    write_checkpoint(tmp_path / "ckpt", CONFIG, {0: _layer([1], 2)}, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_writer_holds_its_staging_lock_until_it_commits_or_discards(tmp_path: Path) -> None:
    import fcntl
    import os

    writer = CheckpointWriter(tmp_path / "ckpt", CONFIG)
    staging = next(tmp_path.glob(".ckpt.partial-*"))
    fd = os.open(staging, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    writer.write_layer(0, _layer([0], 1))
    writer.finish()
    fd = os.open(tmp_path / "ckpt", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released at the commit
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", ["layers.00.w13", "layers.\u0661.w13", "layers.\uff10.w2", "layers.0.w13\n", "layers.+0.expert_ids"])
def test_another_spelling_of_a_layer_tensor_is_an_unexpected_tensor(ckpt_dir: Path, name: str) -> None:
    """The name pattern once took any (Unicode) digits: a second w13 of layer 0 as "layers.00.w13" opened and
    validated (never checked nor served, but hashed)."""
    save_file({name: _layer([0, 2, 5], 7).w13}, str(ckpt_dir / "extra.safetensors"), metadata=CONFIG.to_metadata())
    write_checksums(ckpt_dir, sorted(ckpt_dir.glob("*.safetensors")))
    with pytest.raises(LutBFormatError, match=re.escape(f"extra.safetensors: unexpected tensor {name!r}")):
        Checkpoint(ckpt_dir)


def test_a_zero_padded_layer_is_refused_as_unexpected_not_as_incomplete(tmp_path: Path) -> None:
    """All three tensors of "layers.01" once gave the false "layer 1 lacks tensor layers.1.w13"."""
    layer = _layer([1], 3)
    save_file({"layers.01.w13": layer.w13, "layers.01.w2": layer.w2, "layers.01.expert_ids": layer.expert_ids},
              str(tmp_path / "a.safetensors"), metadata=CONFIG.to_metadata())
    with pytest.raises(LutBFormatError, match=r"unexpected tensor 'layers\.01\."):
        Checkpoint(tmp_path)


class _Bar:
    """A progress bar that records what it is told."""

    def __init__(self, total: int) -> None:
        self.total, self.updates, self.closed = total, [], False

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True

    def update(self, n: int) -> None:
        self.updates.append(n)


def test_content_hash_reports_progress_over_every_byte(ckpt_dir: Path) -> None:
    """content_hash() read every byte with no way to show progress: `lutb inspect` and `lutb shard` sat silent
    for minutes on a large checkpoint."""
    bars: list[_Bar] = []
    ckpt = Checkpoint(ckpt_dir)
    h = ckpt.content_hash(progress=lambda total: bars.append(_Bar(total)) or bars[-1])
    assert h == Checkpoint(ckpt_dir).content_hash()  # the same hash with or without a bar
    (bar,) = bars
    tensors = [t for layer in ckpt.layers for t in ckpt.layer(layer)]
    assert bar.total == sum(t.nbytes for t in tensors) == sum(bar.updates) and len(bar.updates) == len(tensors)
    assert bar.closed
    assert ckpt.content_hash(progress=lambda total: bars.append(_Bar(total)) or bars[-1]) == h and len(bars) == 1  # cached


@pytest.mark.parametrize("tiles", [True, False])
def test_a_wrong_last_dimension_is_reported_with_the_real_shape(tiles: bool) -> None:
    """The cheap check (tiles=False: the server's load, sharding) once checked a 0-length slice and reported its
    shape, "(3, 2, 0, 6000)", for a tensor of shape (3, 2, 2, 6000)."""
    layer = _layer([0, 2, 5], 1)
    bad = layer._replace(w13=layer.w13[..., :6000].contiguous())
    with pytest.raises(LutBFormatError, match=r"layers\.0\.w13: last dimension must be 6672 tile bytes, got shape \(3, 2, 2, 6000\)"):
        check_layer(CONFIG, 0, bad, tiles=tiles)


def test_a_checkpoint_overwritten_while_open_is_not_read_on(ckpt_dir: Path) -> None:
    """An overwrite swapped in new files while a server loaded: the layers read after it came from the new checkpoint,
    served under the old one's content hash. Reads after the swap are refused; a process that opens the path
    again sees other files than the identity it was handed."""
    opened = Checkpoint(ckpt_dir)
    identity = opened.identity
    opened.layer(0)
    write_checkpoint(ckpt_dir, CONFIG, {0: _layer([1], 9), 3: _layer([4], 9)}, overwrite=True)
    with pytest.raises(LutBFormatError, match="changed since the checkpoint was opened"):
        opened.layer(3)
    with pytest.raises(LutBFormatError, match="its files changed since front end 0 opened them"):
        Checkpoint(ckpt_dir).expect_identity(identity, "front end 0")
    Checkpoint(ckpt_dir).expect_identity(Checkpoint(ckpt_dir).identity, "front end 0")  # the same files: fine


# -- SHA256SUMS: what the writer wrote, checked --------------------------------------------------------------------


def test_the_writer_lists_every_file_with_its_sha256(ckpt_dir: Path) -> None:
    """``sha256sum``'s format, sorted by name: ``sha256sum -c SHA256SUMS`` checks a copy too."""
    files = sorted(ckpt_dir.glob("*.safetensors"))
    assert [f.name for f in files] == ["layer-00000.safetensors", "layer-00003.safetensors"]
    assert (ckpt_dir / CHECKSUMS).read_text() == "".join(f"{file_sha256(f)}  {f.name}\n" for f in files)
    ckpt = Checkpoint(ckpt_dir)
    assert ckpt.checksums == {f.name: file_sha256(f) for f in files}
    assert ckpt.verify_files() is True
    ckpt.validate()


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # tile data: the header still parses, every tile still passes the format's rules
    path.write_bytes(bytes(data))


def _zero_tail(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # an interrupted copy into a preallocated file
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_flip_last_byte, _zero_tail], ids=["bit-flip", "zero-tail"])
def test_a_damaged_copy_is_refused_naming_its_file(ckpt_dir: Path, damage) -> None:
    damage(ckpt_dir / "layer-00003.safetensors")
    ckpt = Checkpoint(ckpt_dir)  # opening reads headers only
    with pytest.raises(LutBFormatError, match=r"layer-00003\.safetensors differs from the sha256 in SHA256SUMS"):
        ckpt.verify_files()
    with pytest.raises(LutBFormatError, match=r"layer-00003\.safetensors differs"):
        Checkpoint(ckpt_dir).validate()


def test_a_zero_tail_passes_the_format_checks_alone(ckpt_dir: Path) -> None:
    """Why the checksums: without them the same damaged copy validates (zero bytes are valid tiles)."""
    _zero_tail(ckpt_dir / "layer-00003.safetensors")
    (ckpt_dir / CHECKSUMS).unlink()
    ckpt = Checkpoint(ckpt_dir)
    assert ckpt.checksums is None and ckpt.verify_files() is False
    ckpt.validate()


def test_a_missing_or_an_added_file_is_refused_on_open(ckpt_dir: Path, tmp_path: Path) -> None:
    layer3 = ckpt_dir / "layer-00003.safetensors"
    kept = tmp_path / "kept.safetensors"
    layer3.rename(kept)
    with pytest.raises(LutBFormatError, match=r"SHA256SUMS lists layer-00003\.safetensors, missing here"):
        Checkpoint(ckpt_dir)
    kept.rename(layer3)
    save_file({"layers.9.w13": _layer([1], 4).w13, "layers.9.w2": _layer([1], 4).w2,
               "layers.9.expert_ids": torch.tensor([1], dtype=torch.int32)},
              str(ckpt_dir / "layer-00009.safetensors"), metadata=CONFIG.to_metadata())
    with pytest.raises(LutBFormatError, match=r"layer-00009\.safetensors not listed in SHA256SUMS"):
        Checkpoint(ckpt_dir)


@pytest.mark.parametrize("text", ["not a checksum\n", f"{'0' * 64} a/b.safetensors\n", f"{'A' * 64}  x.safetensors\n",
                                  f"{'0' * 64} *foo  ./bar\n", f"{'0' * 64}  ./a/b\n",
                                  f"{'0' * 64}  layer-00000.safetensors\n{'1' * 64}  layer-00000.safetensors\n"])
def test_a_malformed_checksums_file_is_refused(ckpt_dir: Path, text: str) -> None:
    (ckpt_dir / CHECKSUMS).write_text(text)
    with pytest.raises(LutBFormatError, match=r"SHA256SUMS, line \d"):
        Checkpoint(ckpt_dir)


def test_sha256sum_checks_a_checkpoint(ckpt_dir: Path) -> None:
    import shutil
    import subprocess

    if shutil.which("sha256sum") is None:
        pytest.skip("no sha256sum on this machine")
    assert subprocess.run(["sha256sum", "--quiet", "-c", CHECKSUMS], cwd=ckpt_dir).returncode == 0
    _flip_last_byte(ckpt_dir / "layer-00000.safetensors")
    assert subprocess.run(["sha256sum", "--quiet", "-c", CHECKSUMS], cwd=ckpt_dir, capture_output=True).returncode != 0


def test_overwrite_replaces_a_checkpoint_with_its_checksums(ckpt_dir: Path) -> None:
    write_checkpoint(ckpt_dir, CONFIG, {1: _layer([3], 5)}, overwrite=True)
    ckpt = Checkpoint(ckpt_dir)
    assert ckpt.layers == [1] and set(ckpt.checksums or {}) == {"layer-00001.safetensors"} and ckpt.verify_files()


@pytest.mark.parametrize("layers", [(0, 3), (1,)], ids=["same-names", "other-names"])
def test_files_replaced_while_open_are_told_apart_from_damage(ckpt_dir: Path, layers: tuple[int, ...]) -> None:
    ckpt = Checkpoint(ckpt_dir)
    write_checkpoint(ckpt_dir, CONFIG, {layer: _layer([1], 8 + layer) for layer in layers}, overwrite=True)
    with pytest.raises(LutBFormatError, match="changed since the checkpoint was opened"):
        ckpt.verify_files()


def test_checksums_as_sha256sum_writes_them_in_other_ways(ckpt_dir: Path) -> None:
    """``sha256sum ./*`` (a ``./`` prefix), ``-b`` (``*`` before the name), ``sha256sum * > SHA256SUMS`` (the file
    itself, and files besides the safetensors ones, listed): accepted, and the other files are checked too."""
    (ckpt_dir / "README.md").write_text("a checkpoint\n")
    names = ["README.md", "layer-00000.safetensors", "layer-00003.safetensors"]
    lines = [f"{file_sha256(ckpt_dir / n)} {'*' if i == 1 else ' '}{'./' if i == 2 else ''}{n}" for i, n in enumerate(names)]
    (ckpt_dir / CHECKSUMS).write_text("\n".join(lines + [f"{'0' * 64}  {CHECKSUMS}"]) + "\n")
    ckpt = Checkpoint(ckpt_dir)
    assert set(ckpt.checksums or {}) == set(names) and ckpt.verify_files()
    (ckpt_dir / "README.md").write_text("changed\n")
    with pytest.raises(LutBFormatError, match=r"README\.md differs"):
        Checkpoint(ckpt_dir).verify_files()


def test_verify_files_tells_its_progress_every_byte(ckpt_dir: Path) -> None:
    told: list[int] = []

    class Bar:
        def __init__(self, total: int) -> None:
            told.append(total)

        def __enter__(self) -> "Bar":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def update(self, n: int) -> None:
            told.append(n)

    assert Checkpoint(ckpt_dir).verify_files(Bar, threads=2)
    total = sum(f.stat().st_size for f in ckpt_dir.glob("*.safetensors"))
    assert told[0] == total == sum(told[1:])


@pytest.mark.parametrize("name", ["docs", "layer-00009.safetensors"])
def test_a_listed_entry_that_is_not_a_regular_file_is_named_so(ckpt_dir: Path, name: str) -> None:
    (ckpt_dir / name).mkdir()
    with open(ckpt_dir / CHECKSUMS, "a") as f:
        f.write(f"{'0' * 64}  {name}\n")
    with pytest.raises(LutBFormatError, match=f"lists {name}, not a regular file here"):
        Checkpoint(ckpt_dir)
