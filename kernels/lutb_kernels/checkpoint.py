"""LUT-B checkpoints: a directory of safetensors files (spec section 5).

Per MoE layer ``L`` a checkpoint holds ``layers.L.w13`` (uint8
``[E_local, W13_rows/128, H/128, 6672]``), ``layers.L.w2`` (uint8
``[E_local, H/128, I/128, 6672]``) and ``layers.L.expert_ids`` (int32
``[E_local]``, ascending global ids). Every file's ``__metadata__`` carries the
same :class:`CheckpointConfig` as strings.

This module writes one file per layer (``layer-00000.safetensors``), so a
converter can stream a model a layer at a time, and reads any file layout the
spec allows (tensors of one layer may sit in different files). Reading is
memory-mapped: nothing is loaded until a layer is asked for.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

try:
    import fcntl
except ImportError:  # not POSIX: staging directories go unlocked, and only the pid tells a live writer
    fcntl = None  # type: ignore[assignment]

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lutb_kernels.activations import check_activation, w13_rows
from lutb_kernels.errors import LutBFormatError
from lutb_kernels.mxfp8 import check_scale_mode
from lutb_kernels.tiles import TILE, TILE_BYTES, check_tile_layout, validate_tiles

FORMAT = "lut-b"
FORMAT_VERSION = 1
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_TENSOR_NAME = re.compile(r"layers\.(0|[1-9][0-9]*)\.(w13|w2|expert_ids)", re.ASCII)
"""A tensor name the format defines (whole name, ``fullmatch``): the layer index spelled as ``str(int)`` would, so
``layers.00.w13`` or a non-ASCII digit is an unknown tensor, never a second spelling of a layer's tensor."""
_INT_FIELDS = ("hidden_size", "intermediate_size", "num_experts")
MAX_LAYER = 2**31 - 1
"""The largest layer index: requests and ``ModelInfo`` carry layers as int32."""
CHECKSUMS = "SHA256SUMS"
"""The file a writer puts beside a checkpoint's safetensors files: one line ``<sha256 hex>  <file name>`` per file,
sorted by name, the format ``sha256sum`` writes (so ``sha256sum -c SHA256SUMS`` checks a copy too). Not part of the
spec (docs/format.md, choice (o)): a checkpoint without it opens as before, unchecked."""
_CHECKSUM_LINE = re.compile(r"([0-9a-f]{64}) [ *](?:\./)?([^/\\\x00]+)", re.ASCII)
_HASH_CHUNK = 1 << 24  # bytes per read while hashing a file


@dataclass(frozen=True)
class CheckpointConfig:
    """What a checkpoint's metadata says about its experts (all files agree on it)."""

    hidden_size: int
    intermediate_size: int
    num_experts: int
    activation: str = "silu"
    dtype: str = "bfloat16"
    mxfp8_scale_mode: str = "rceil"

    def __post_init__(self) -> None:
        for field in _INT_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise LutBFormatError(f"{field} must be a positive integer, got {value!r}")
        if self.hidden_size % TILE or self.intermediate_size % TILE:
            raise LutBFormatError(
                f"hidden_size ({self.hidden_size}) and intermediate_size ({self.intermediate_size}) must be multiples of {TILE}"
            )
        try:
            check_activation(self.activation)
            check_scale_mode(self.mxfp8_scale_mode)
        except ValueError as exc:
            raise LutBFormatError(str(exc)) from None
        if self.dtype not in DTYPES:
            raise LutBFormatError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def w13_rows(self) -> int:
        """Rows of each expert's W13: ``2I`` for gated activations, ``I`` for ``*_no_mul``."""
        return w13_rows(self.activation, self.intermediate_size)

    def w13_tiles_shape(self, experts: int) -> tuple[int, int, int]:
        return (experts, self.w13_rows // TILE, self.hidden_size // TILE)

    def w2_tiles_shape(self, experts: int) -> tuple[int, int, int]:
        return (experts, self.hidden_size // TILE, self.intermediate_size // TILE)

    def to_metadata(self) -> dict[str, str]:
        """The safetensors ``__metadata__`` strings of spec section 5."""
        meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION)}
        meta.update({k: str(v) for k, v in asdict(self).items()})
        return meta

    @classmethod
    def from_metadata(cls, meta: dict[str, str] | None, where: str) -> CheckpointConfig:
        """Parse and check a file's metadata; errors name ``where`` (the file)."""
        meta = meta or {}
        if meta.get("format") != FORMAT:
            raise LutBFormatError(f"{where}: metadata format is {meta.get('format')!r}, expected {FORMAT!r}")
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise LutBFormatError(f"{where}: unsupported format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
        fields = {}
        for key in (*_INT_FIELDS, "activation", "dtype", "mxfp8_scale_mode"):
            if key not in meta:
                raise LutBFormatError(f"{where}: metadata lacks {key!r}")
            fields[key] = meta[key]
        for key in _INT_FIELDS:
            try:
                fields[key] = int(fields[key])
            except ValueError:
                raise LutBFormatError(f"{where}: metadata {key} = {fields[key]!r} is not an integer") from None
        try:
            return cls(**fields)
        except LutBFormatError as exc:
            raise LutBFormatError(f"{where}: {exc}") from None


class LayerWeights(NamedTuple):
    """One MoE layer's packed experts.

    ``w13``: uint8 ``[E_local, W13_rows/128, H/128, 6672]``; ``w2``: uint8
    ``[E_local, H/128, I/128, 6672]``; ``expert_ids``: int32 ``[E_local]``, ascending.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    expert_ids: torch.Tensor


def check_layer(config: CheckpointConfig, layer: int, weights: LayerWeights, *, tiles: bool = True, where: str = "") -> None:
    """Validate one layer against ``config``; errors name the tensor (and tile).

    Args:
        tiles: also run every per-tile rule of spec section 1 (reads all tile bytes).
    """
    prefix = f"{where}: " if where else ""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= MAX_LAYER:
        # (the reader's names need >= 0; requests and ModelInfo carry the index as int32)
        raise LutBFormatError(f"{prefix}layer index must be an integer in [0, {MAX_LAYER}], got {layer!r}")
    ids = weights.expert_ids
    name = f"{prefix}layers.{layer}.expert_ids"
    _check_ids_tensor(ids, name)
    if ids.numel() == 0:
        raise LutBFormatError(f"{name}: holds no experts")
    if int(ids.min()) < 0 or int(ids.max()) >= config.num_experts:
        raise LutBFormatError(f"{name}: ids must lie in [0, {config.num_experts}), got [{int(ids.min())}, {int(ids.max())}]")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise LutBFormatError(f"{name}: ids must be strictly ascending")
    experts = ids.numel()
    for tensor_name, tensor, shape in (
        ("w13", weights.w13, config.w13_tiles_shape(experts)),
        ("w2", weights.w2, config.w2_tiles_shape(experts)),
    ):
        full = f"{prefix}layers.{layer}.{tensor_name}"
        if tensor.dim() < 2:
            raise LutBFormatError(f"{full}: must be a uint8 tensor of tiles {shape + (TILE_BYTES,)}, got {tensor.dtype} {tuple(tensor.shape)}")
        (validate_tiles if tiles else check_tile_layout)(tensor, full, shape)


def _check_ids_tensor(ids: torch.Tensor, name: str) -> None:
    """Refuse an ``expert_ids`` tensor (called ``name`` in the error) that is not 1-D int32."""
    if ids.dtype != torch.int32 or ids.dim() != 1:
        raise LutBFormatError(f"{name}: must be a 1-D int32 tensor, got {ids.dtype} {tuple(ids.shape)}")


@contextmanager
def open_safetensors(file: str | Path) -> Iterator[SafetensorsFile]:
    """``safe_open(file)`` for reading tensors (as a :class:`SafetensorsFile`).

    A missing, unreadable or corrupt file, found on opening or by a read of the handle, raises
    :class:`LutBFormatError` naming it. Any other error raised in the ``with`` body (e.g. writing an
    output while the source is open) passes through unchanged: it is not the file's fault.
    """
    try:
        handle = safe_open(str(file), framework="pt")
    except (OSError, SafetensorError) as exc:
        raise _unreadable(file, exc) from None
    with handle:
        yield SafetensorsFile(handle, Path(file))


class SafetensorsFile:
    """A ``safe_open`` handle whose read errors raise :class:`LutBFormatError` naming the file."""

    def __init__(self, handle: Any, file: Path) -> None:
        self._handle = handle
        self.file = file

    def keys(self) -> list[str]:
        return self._read("keys")

    def metadata(self) -> dict[str, str] | None:
        return self._read("metadata")

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._read("get_tensor", name)

    def get_slice(self, name: str) -> Any:
        return self._read("get_slice", name)

    def _read(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._handle, method)(*args)
        except (OSError, SafetensorError) as exc:
            raise _unreadable(self.file, exc, *args) from None


def _unreadable(file: str | Path, exc: BaseException, tensor: str | None = None) -> LutBFormatError:
    detail = f"{tensor}: {exc}" if tensor else str(exc)
    return LutBFormatError(f"{Path(file).name}: unreadable safetensors file ({detail})")


class StagedDirectory:
    """An output directory built beside its place and swapped in whole: all or nothing.

    The content goes to :attr:`staging`, a hidden sibling of ``path`` (``.<name>.partial-<pid>-<hex>``,
    on the same file system), which no reader looks at. :meth:`commit` fsyncs it, renames the directory
    ``path`` holds (if any) aside to ``.<name>.old-<pid>-<hex>``, renames :attr:`staging` to ``path`` and
    removes the old one: until the second rename ``path`` is the old directory untouched, after it the
    complete new one. A failure in between (also a KeyboardInterrupt) puts the old one back. Only a kill
    between the two renames (two system calls) leaves no ``path``; the old directory is then the
    ``.<name>.old-*`` sibling, which nothing deletes. :meth:`discard` removes :attr:`staging`.

    ``path`` is replaced as a whole, so the constructor refuses one that holds anything but the kind of
    output being written. A symbolic link is followed: the directory it names is replaced.

    Args:
        path: the output directory.
        owns: whether an entry of an existing ``path`` is output of this kind (replaceable).
        what: that output, for messages (e.g. ``"safetensors files"``).
        overwrite: replace a ``path`` holding such output (else refuse it; an empty one is fine).
        sources: the files being converted: a ``path`` holding any of them, at any depth, is refused
            even with ``overwrite``, so that it never deletes its own input.

    Raises:
        FileExistsError: ``path`` is a file or a mount point, holds a source, holds other entries than
            ``owns`` accepts, or holds output without ``overwrite``.
    """

    def __init__(self, path: str | Path, *, owns: Callable[[Path], bool], what: str, overwrite: bool = False,
                 sources: Iterable[str | Path] = ()) -> None:
        self.path = Path(path)
        self._target = self.path.resolve()
        self._rules = (owns, what, overwrite, tuple(sources))
        self._check()
        parent = self._target.parent
        parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(parent, self._target.name)
        self.staging = parent / f".{self._target.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        self.staging.mkdir()
        self._lock = _lock_directory(self.staging)  # held while this writer lives: the staging is not stale
        self.done = False

    def _check(self) -> None:
        owns, what, overwrite, sources = self._rules
        _check_replaceable(self.path, self._target, owns, what, overwrite=overwrite, sources=sources)

    def commit(self) -> None:
        """Make :attr:`staging` the directory ``path`` (durably), replacing what ``path`` held.

        The constructor's checks run again first: what ``path`` holds may have changed while the output was written
        (another writer's output, without ``overwrite``, is refused then: FileExistsError). The new directory takes
        the old one's permissions (not before: a read-only old directory would have made the staging unwritable)."""
        self._close()
        self._check()
        if self._target.is_dir():
            shutil.copymode(self._target, self.staging)
        _fsync_tree(self.staging)
        old = self._set_aside()
        try:
            self.staging.rename(self._target)
        except BaseException:
            if old is not None:
                old.rename(self._target)
            raise
        _fsync(self._target.parent)
        self._unlock()
        if old is not None:
            _remove_old(old)

    def discard(self) -> None:
        """Remove :attr:`staging`; ``path`` keeps what it held."""
        self.done = True
        shutil.rmtree(self.staging, ignore_errors=True)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _close(self) -> None:
        if self.done:
            raise RuntimeError(f"{self.path}: this output was committed or discarded already")
        self.done = True

    def _set_aside(self) -> Path | None:
        """Rename the directory ``path`` holds to a hidden sibling and return it (None if there is none)."""
        if not os.path.lexists(self._target):
            return None
        old = self._target.parent / f".{self._target.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        self._target.rename(old)
        return old


def _remove_old(old: Path) -> None:
    """Remove the directory a commit set aside (made writable by its owner first: a read-only checkpoint directory's
    files could not be unlinked); one that cannot be removed is named in a warning, not left silently."""
    try:
        old.chmod(old.stat().st_mode | 0o700)
    except OSError:
        pass
    failed: list[str] = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(old, onexc=lambda _fn, p, exc: failed.append(f"{p}: {exc}"))
    else:
        shutil.rmtree(old, onerror=lambda _fn, p, info: failed.append(f"{p}: {info[1]}"))
    if failed:
        warnings.warn(f"the replaced output {old} could not be removed ({failed[0]}); delete it by hand", stacklevel=3)


def _check_replaceable(path: Path, target: Path, owns: Callable[[Path], bool], what: str, *, overwrite: bool,
                       sources: Iterable[str | Path]) -> None:
    """The checks of :class:`StagedDirectory`; errors name ``path`` as given."""
    if not os.path.lexists(target):
        return
    if not target.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    cwd = Path.cwd().resolve()
    if cwd.is_relative_to(target):
        raise FileExistsError(f"{path} is the working directory or holds it, and the output replaces the whole "
                              f"directory: write to another one, or run from elsewhere")
    inputs = sorted(Path(f).name for f in sources if Path(f).resolve().is_relative_to(target))
    if inputs:
        raise FileExistsError(f"{path} holds the files being converted ({', '.join(inputs)}); write to another directory")
    if os.path.ismount(target):
        raise FileExistsError(f"{path} is a mount point, which the output cannot replace; write to a directory inside it")
    entries = sorted(target.iterdir())
    foreign = [e.name for e in entries if not owns(e)]
    if foreign:
        raise FileExistsError(f"{path} holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}, not {what}; "
                              f"the output replaces the whole directory: choose a new or empty one")
    if entries and not overwrite:
        raise FileExistsError(f"{path} already holds {what}; choose an empty directory")


def _lock_directory(path: Path) -> int | None:
    """An exclusive ``flock`` on directory ``path``, held until the returned descriptor is closed (None where the
    system has no ``flock``). A writer holds its staging directory's; the lock goes with its process, however it
    ends, and another process, in any PID namespace of the host, sees it."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _remove_stale_staging(parent: Path, name: str) -> None:
    """Remove staging directories of ``name`` left by writers that were killed: their process is gone (its pid is in
    the name) and nothing holds the directory's lock (:func:`_lock_directory`: a live writer in another PID
    namespace, e.g. another container on a shared volume, whose pid means nothing here, still holds it)."""
    for stale in parent.glob(f".{glob.escape(name)}.partial-*"):
        pid = stale.name.rsplit("-", 2)[-2]
        if not pid.isdigit() or _process_alive(int(pid)):
            continue
        try:
            lock = _lock_directory(stale)
        except OSError:  # locked by a live writer, or gone meanwhile
            continue
        try:
            shutil.rmtree(stale, ignore_errors=True)
        finally:
            if lock is not None:
                os.close(lock)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (``root`` included), deepest first."""
    for folder, _, files in os.walk(root, topdown=False):
        for file in files:
            _fsync(Path(folder, file))
        _fsync(Path(folder))


def is_checkpoint_file(entry: Path) -> bool:
    """Whether ``entry`` is a file a checkpoint writer owns: ``*.safetensors`` (or an earlier version's
    ``*.safetensors.partial``) and :data:`CHECKSUMS`."""
    return entry.is_file() and not entry.is_symlink() and (
        entry.name.endswith((".safetensors", ".safetensors.partial")) or entry.name == CHECKSUMS)


def file_sha256(path: Path, update: Callable[[int], object] | None = None) -> str:
    """The sha256 of ``path``'s bytes, hex (read in 16 MiB chunks; hashlib lets other threads run meanwhile);
    ``update`` is told each chunk's bytes once hashed."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            if update is not None:
                update(len(chunk))
    return digest.hexdigest()


def write_checksums(folder: Path, files: Iterable[Path]) -> Path:
    """Write :data:`CHECKSUMS` into ``folder`` for ``files`` (which lie in it); returns its path."""
    lines = [f"{file_sha256(file)}  {file.name}\n" for file in sorted(files, key=lambda f: f.name)]
    out = folder / CHECKSUMS
    out.write_text("".join(lines), encoding="ascii")
    return out


def read_checksums(folder: Path) -> dict[str, str] | None:
    """``{file name: sha256 hex}`` from ``folder``'s :data:`CHECKSUMS`, or None when it has none.

    Raises:
        LutBFormatError: the file is not in ``sha256sum``'s format, or names a file twice.
    """
    path = folder / CHECKSUMS
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise LutBFormatError(f"{path}: unreadable ({exc})") from exc
    sums: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        match = _CHECKSUM_LINE.fullmatch(line)  # a "./" before the name: ``sha256sum ./*``
        if match is None:
            raise LutBFormatError(f"{path}, line {number}: not '<64 lowercase hex digits>  <file name>' (a file of "
                                  f"this folder, its name without '/' or '\\'): {line[:120]!r}")
        digest, name = match.groups()
        if name == CHECKSUMS:  # ``sha256sum * > SHA256SUMS`` hashes the file being written: nothing to check
            continue
        if name in sums:
            raise LutBFormatError(f"{path}, line {number}: {name} is listed twice")
        sums[name] = digest
    return sums


class CheckpointWriter:
    """Writes a checkpoint one layer at a time, all or nothing::

        with CheckpointWriter(dir, config) as writer:
            writer.write_layer(0, weights)   # ... every layer

    Layers go to a hidden sibling directory of ``path`` (:class:`StagedDirectory`); leaving the
    ``with`` block normally swaps it in place of ``path`` (:meth:`finish`), leaving it by an exception
    (or :meth:`finish` failing) removes it. So a conversion that fails halfway leaves no checkpoint
    that opens as a complete one with fewer layers, and the checkpoint ``overwrite`` replaces stays as
    it was until the new one is complete.

    Args:
        overwrite: replace the checkpoint ``path`` holds already (else refuse such a directory). A
            ``path`` holding anything but ``*.safetensors`` files is refused either way: it is
            replaced whole.
        sources: the files being converted (a Hugging Face model, the checkpoint being sharded): a
            ``path`` that holds any of them is refused even with ``overwrite``, so that it never
            deletes its own input.

    Raises:
        FileExistsError: see :class:`StagedDirectory`.
    """

    def __init__(self, path: str | Path, config: CheckpointConfig, *, overwrite: bool = False,
                 sources: Iterable[str | Path] = ()) -> None:
        self.path = Path(path)
        self.config = config
        self._out = StagedDirectory(self.path, owns=is_checkpoint_file, what="safetensors files",
                                    overwrite=overwrite, sources=sources)
        self._written: dict[int, Path] = {}

    def write_layer(self, layer: int, weights: LayerWeights) -> Path:
        """Validate and write ``layers.<layer>.*``; returns the file it will have after :meth:`finish`.

        Raises:
            LutBFormatError: the layer breaks the format (:func:`check_layer`).
            ValueError: ``layer`` was written already.
            OSError: the file could not be written (the message names the output).
        """
        check_layer(self.config, layer, weights)
        if layer in self._written:
            raise ValueError(f"{self.path}: layer {layer} was written already")
        if self._out.done:
            raise RuntimeError(f"{self.path}: the writer has finished")
        name = f"layer-{layer:05d}.safetensors"
        tensors = {
            f"layers.{layer}.w13": weights.w13.contiguous().cpu(),
            f"layers.{layer}.w2": weights.w2.contiguous().cpu(),
            f"layers.{layer}.expert_ids": weights.expert_ids.contiguous().cpu(),
        }
        try:
            save_file(tensors, str(self._out.staging / name), metadata=self.config.to_metadata())
        except SafetensorError as exc:  # (how safetensors reports a failed write: a full disk, a directory gone)
            raise OSError(f"{self.path}: cannot write {name} ({exc})") from exc
        self._written[layer] = self.path / name
        return self._written[layer]

    def finish(self) -> list[Path]:
        """Write :data:`CHECKSUMS` of the layer files, then swap them in as the checkpoint ``path`` (replacing what it
        held); return the layer files."""
        if not self._out.done:
            try:
                write_checksums(self._out.staging, [self._out.staging / file.name for file in self._written.values()])
            except OSError as exc:
                raise OSError(f"{self.path}: cannot write {CHECKSUMS} ({exc})") from exc
        self._out.commit()
        return list(self._written.values())

    def discard(self) -> None:
        """Delete the layers written so far; ``path`` keeps what it held before."""
        self._out.discard()
        self._written = {}

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.discard()
            return
        try:
            self.finish()
        except BaseException:
            self.discard()
            raise


def write_checkpoint(path: str | Path, config: CheckpointConfig, layers: dict[int, LayerWeights], *, overwrite: bool = False) -> None:
    """Write a whole checkpoint at once (see :class:`CheckpointWriter` to stream)."""
    with CheckpointWriter(path, config, overwrite=overwrite) as writer:
        for layer in sorted(layers):
            writer.write_layer(layer, layers[layer])


class Checkpoint:
    """A LUT-B checkpoint opened for reading; tensors are memory-mapped on demand.

    Opening checks the metadata of every file and the presence of every tensor;
    :meth:`validate` checks every tile too.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise LutBFormatError(f"{self.path}: not a directory")
        self.files = sorted(p for p in self.path.glob("*.safetensors") if p.is_file())
        if not self.files:
            raise LutBFormatError(f"{self.path}: holds no .safetensors files")
        self.checksums: dict[str, str] | None = read_checksums(self.path)
        """The writer's sha256 of each file (:data:`CHECKSUMS`; None without it): the files present must be the files
        it lists, checked here; :meth:`verify_files` checks their bytes."""
        if self.checksums is not None:
            present = {file.name for file in self.files}
            others = sorted(set(self.checksums) - present)  # listed files besides the safetensors ones
            missing = [name for name in others if not (self.path / name).exists()]
            odd = [name for name in others if (self.path / name).exists() and not (self.path / name).is_file()]
            unlisted = sorted(present - set(self.checksums))
            if missing:
                raise LutBFormatError(f"{self.path}: {CHECKSUMS} lists {', '.join(missing)}, missing here (an "
                                      "incomplete copy?)")
            if odd:
                raise LutBFormatError(f"{self.path}: {CHECKSUMS} lists {', '.join(odd)}, not a regular file here")
            if unlisted:
                raise LutBFormatError(f"{self.path}: {', '.join(unlisted)} not listed in {CHECKSUMS} (added after the "
                                      "checkpoint was written?)")
        self._identity = {file: _file_identity(file) for file in self.files}
        self._where: dict[str, Path] = {}
        config: CheckpointConfig | None = None
        for file in self.files:
            with open_safetensors(file) as f:
                file_config = CheckpointConfig.from_metadata(f.metadata(), file.name)
                names = list(f.keys())
            if config is None:
                config = file_config
            elif file_config != config:
                raise LutBFormatError(f"{file.name}: metadata {file_config} disagrees with {self.files[0].name}: {config}")
            for name in names:
                if not _TENSOR_NAME.fullmatch(name):
                    raise LutBFormatError(f"{file.name}: unexpected tensor {name!r}; expected layers.<L>.w13, .w2 or .expert_ids")
                if name in self._where:
                    raise LutBFormatError(f"{file.name}: tensor {name} also appears in {self._where[name].name}")
                self._where[name] = file
        assert config is not None
        self.config = config
        layers = sorted({int(_TENSOR_NAME.fullmatch(n).group(1)) for n in self._where})  # type: ignore[union-attr]
        if not layers:
            raise LutBFormatError(f"{self.path}: holds no layers (no layers.<L>.w13, .w2, .expert_ids tensors)")
        for layer in layers:
            for part in ("w13", "w2", "expert_ids"):
                if f"layers.{layer}.{part}" not in self._where:
                    raise LutBFormatError(f"{self.path}: layer {layer} lacks tensor layers.{layer}.{part}")
        if layers[-1] > MAX_LAYER:
            raise LutBFormatError(f"{self._where[f'layers.{layers[-1]}.w13'].name}: layer index {layers[-1]} is above "
                                  f"{MAX_LAYER} (requests carry layers as int32)")
        self.layers: list[int] = layers
        self._hash: str | None = None

    @property
    def identity(self) -> tuple[tuple[str, int, int, int, int], ...]:
        """Which files were opened: per file (name, device, inode, size, mtime in ns), as when this object was made.
        Another process that opens the same path compares it (:meth:`expect_identity`) to be sure it reads the same
        files: an overwrite swaps in new ones."""
        return tuple((file.name, *ident) for file, ident in self._identity.items())

    def expect_identity(self, identity: Sequence[Sequence[object]], whose: str) -> None:
        """Raise :class:`LutBFormatError` unless this checkpoint's :attr:`identity` is ``identity`` (``whose``: that
        identity's holder, for the message)."""
        if self.identity != tuple(tuple(part) for part in identity):
            raise LutBFormatError(f"{self.path}: its files changed since {whose} opened them (replaced or rewritten); "
                                  "start the server again to serve what the path holds now")

    def _check_unchanged(self, file: Path) -> None:
        """Raise :class:`LutBFormatError` when ``file`` is not the file opened (replaced or rewritten since)."""
        try:
            changed = _file_identity(file) != self._identity[file]
        except OSError:
            changed = True
        if changed:  # an overwrite swapped the directory: reading on would mix two checkpoints
            raise LutBFormatError(f"{file}: changed since the checkpoint was opened (replaced or rewritten); open it "
                                  "again to read what it holds now")

    def _tensor(self, name: str) -> torch.Tensor:
        file = self._where[name]
        self._check_unchanged(file)
        with open_safetensors(file) as f:
            return f.get_tensor(name)

    def layer(self, layer: int, *, check: bool = True, tiles: bool = False) -> LayerWeights:
        """Load one layer (memory-mapped CPU tensors).

        Args:
            check: validate shapes, dtypes and expert ids (cheap).
            tiles: with ``check``, also every tile (spec section 1's rules: reads every byte of the layer, as
                :meth:`validate` does for all layers).

        Raises:
            KeyError: the checkpoint has no such layer.
            LutBFormatError: a check failed (naming file, tensor and tile).
        """
        if layer not in self.layers:
            raise KeyError(f"checkpoint {self.path} has no layer {layer}; it has {self.layers}")
        weights = LayerWeights(*(self._tensor(f"layers.{layer}.{p}") for p in ("w13", "w2", "expert_ids")))
        if check:
            check_layer(self.config, layer, weights, tiles=tiles, where=self._files_of(layer))
        return weights

    def _files_of(self, layer: int) -> str:
        """The file(s) holding ``layer``'s tensors, for error messages (one name unless a writer split them)."""
        names = (self._where[f"layers.{layer}.{part}"].name for part in ("w13", "w2", "expert_ids"))
        return ", ".join(dict.fromkeys(names))

    def expert_ids(self, layer: int) -> torch.Tensor:
        """int32 ``[E_local]`` global ids of the experts held in ``layer``.

        Only the tensor's dtype and shape are checked (so that its values can be read as a list of ids);
        :meth:`layer` and :meth:`validate` check the values too.

        Raises:
            KeyError: the checkpoint has no such layer.
            LutBFormatError: the tensor is not 1-D int32 (naming its file and name).
        """
        name = f"layers.{layer}.expert_ids"
        ids = self._tensor(name)
        _check_ids_tensor(ids, f"{self._where[name].name}: {name}")
        return ids

    def verify_files(self, progress: Callable[[int], AbstractContextManager[Any]] | None = None, *,
                     threads: int | None = None) -> bool:
        """Check the bytes of every file :data:`CHECKSUMS` lists (the safetensors files, and any other it names) against
        it, hashed in parallel by up to ``threads`` threads (default: one per file, at most 8 and the CPU count).
        Returns False when there is no such file to check against, True when every file matches.

        Args:
            progress: a progress bar for the pass, as for :meth:`content_hash` (told the bytes hashed).

        Raises:
            LutBFormatError: a file's bytes differ from what its writer wrote (naming it): a corrupted or
                truncated copy; a safetensors file was replaced or rewritten since the checkpoint was opened; or a
                listed file cannot be read (gone since).
        """
        if self.checksums is None:
            return False
        import threading
        from concurrent.futures import ThreadPoolExecutor

        files = [self.path / name for name in sorted(self.checksums)]
        workers = threads or max(1, min(8, len(files), os.cpu_count() or 1))
        lock = threading.Lock()
        unreadable: OSError | None = None
        try:
            with progress(sum(f.stat().st_size for f in files)) if progress else nullcontext() as bar:
                def told(n: int) -> None:
                    with lock:  # the threads share one bar
                        bar.update(n)

                def digest(file: Path) -> str:
                    return file_sha256(file, told if bar is not None else None)

                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lutb-sha256") as pool:
                    digests = dict(zip(files, pool.map(digest, files)))
        except OSError as exc:
            unreadable = exc
        for file in self.files:
            self._check_unchanged(file)  # an overwrite swapped in meanwhile: not a damaged (or unreadable) copy
        if unreadable is not None:
            raise LutBFormatError(f"{self.path}: cannot read a file {CHECKSUMS} lists ({unreadable})") from unreadable
        wrong = [file.name for file, digest in digests.items() if digest != self.checksums[file.name]]
        if wrong:
            raise LutBFormatError(f"{self.path}: {', '.join(wrong)} differ{'s' if len(wrong) == 1 else ''} from the "
                                  f"sha256 in {CHECKSUMS} (a corrupted or truncated copy, or rewritten since)")
        return True

    def validate(self, progress: Callable[[Iterable[int]], Iterable[int]] | None = None,
                 file_progress: Callable[[int], AbstractContextManager[Any]] | None = None) -> None:
        """Check every file's bytes against :data:`CHECKSUMS` (where the checkpoint has one; ``file_progress``: its
        progress bar, as for :meth:`verify_files`), then every tensor and tile (``progress`` wraps the layers); raise
        :class:`LutBFormatError` naming file, tensor and tile."""
        self.verify_files(file_progress)
        for layer in progress(self.layers) if progress else self.layers:
            weights = self.layer(layer, check=False)
            check_layer(self.config, layer, weights, tiles=True, where=self._files_of(layer))

    @property
    def weight_bytes(self) -> int:
        """Bytes of packed weights (w13 and w2 of every layer)."""
        total = 0
        for name, file in self._where.items():
            if not name.endswith("expert_ids"):
                with open_safetensors(file) as f:
                    total += _numel(f.get_slice(name).get_shape())
        return total

    def content_hash(self, progress: Callable[[int], AbstractContextManager[Any]] | None = None) -> str:
        """``sha256:<hex>`` of what the checkpoint holds, independent of how it is split into files.

        Covers the configuration as parsed from the metadata (:meth:`CheckpointConfig.to_metadata`,
        keys sorted: metadata keys the format does not define, and spellings that parse alike, do
        not change it) and then, for each tensor in name order, its name, dtype, shape and raw
        bytes. Two checkpoints hash alike exactly when they hold the same tensors and the same
        configuration. Computed once (reading every byte), then cached.

        Args:
            progress: makes a progress bar for the pass that reads every byte: called once, with the
                number of bytes to read, it returns a context manager whose value is told each
                tensor's bytes as they are hashed (``update(n)``), e.g.
                ``lambda total: tqdm(total=total, unit="B", unit_scale=True, desc="hash")``. Not called
                when the hash is cached. It does not change the hash.
        """
        if self._hash is None:
            digest = hashlib.sha256()
            digest.update(json.dumps(self.config.to_metadata(), sort_keys=True).encode())
            with progress(sum(map(_data_bytes, self.files))) if progress else nullcontext() as bar:
                for name in sorted(self._where):
                    tensor = self._tensor(name).contiguous()
                    digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
                    digest.update(tensor.view(torch.uint8).reshape(-1).numpy().data)
                    if bar is not None:
                        bar.update(tensor.nbytes)
            self._hash = f"sha256:{digest.hexdigest()}"
        return self._hash


def _file_identity(file: Path) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime in ns) of ``file``: what tells a file replaced or rewritten from the one opened."""
    st = os.stat(file)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _data_bytes(file: Path) -> int:
    """Bytes of the tensors a safetensors file holds: all that follows its header (the format allows no holes)."""
    with open(file, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return file.stat().st_size - 8 - header


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = [
    "CHECKSUMS",
    "FORMAT",
    "FORMAT_VERSION",
    "TILE_BYTES",
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointWriter",
    "LayerWeights",
    "SafetensorsFile",
    "StagedDirectory",
    "check_layer",
    "file_sha256",
    "is_checkpoint_file",
    "open_safetensors",
    "read_checksums",
    "write_checkpoint",
    "write_checksums",
]
