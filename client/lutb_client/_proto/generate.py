"""Regenerate the committed stubs of ``proto/lutb/v1/expert_service.proto``.

Run from a source checkout (needs ``grpcio-tools``, a dev dependency)::

    python -m lutb_client._proto.generate            # rewrites client/lutb_client/_proto/lutb/v1/
    python -m lutb_client._proto.generate --out DIR  # writes DIR/lutb/v1/ instead

``grpc_tools.protoc`` writes ``expert_service_pb2.py``, ``.pyi`` and ``_pb2_grpc.py``;
this script then post-processes them so that they work inside this package and
with older runtimes:

- ``from lutb.v1 import expert_service_pb2`` becomes a package-relative import
  (``from . import expert_service_pb2``), and the messages' module is the module's
  real ``__name__``. The descriptor keeps its file name ``lutb/v1/expert_service.proto``
  and package ``lutb.v1`` (what reflection and other languages see).
- The protobuf gencode/runtime version guard is removed: the code only uses the
  descriptor-pool and builder API that protobuf runtimes from 5.27 on provide.
- The grpcio version guard asks for :data:`MIN_GRPCIO` (the project's floor) instead
  of the generator's own version.

``tests/test_proto_stubs.py`` runs :func:`generate` into a temporary directory and
fails when the committed files differ.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_FILES = ("lutb/v1/expert_service.proto",)
MIN_GRPCIO = "1.66.0"
MIN_PROTOBUF = "5.27"
PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_PROTO_ROOT = PACKAGE_DIR.parents[2] / "proto"


def _tools_version() -> str:
    try:
        from importlib.metadata import version

        return version("grpcio-tools")
    except Exception:  # pragma: no cover - metadata missing
        return "unknown"


def _postprocess(text: str, module: str) -> str:
    """Apply the rewrites the module docstring lists to one generated file."""
    # Absolute imports of sibling generated modules -> package-relative.
    text = re.sub(r"^from lutb\.v1 import (\w+) as (\w+)$", r"from . import \1 as \2", text, flags=re.M)
    # Protobuf runtime version guard (gencode of protobuf >= 5.26 emits it).
    text = text.replace("from google.protobuf import runtime_version as _runtime_version\n", "")
    text = re.sub(r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)\n", "", text, flags=re.M)
    # Message classes report this module as theirs.
    text = text.replace(f"'lutb.v1.{module}'", "__name__")
    # grpcio version guard: the project's floor, not the generator's version.
    text = re.sub(r"^GRPC_GENERATED_VERSION = '[^']*'$", f"GRPC_GENERATED_VERSION = '{MIN_GRPCIO}'", text, flags=re.M)
    header = (
        f"# Post-processed by lutb_client._proto.generate (grpcio-tools {_tools_version()}): package-relative\n"
        f"# imports, no protobuf runtime version guard; needs protobuf>={MIN_PROTOBUF}, grpcio>={MIN_GRPCIO}.\n"
    )
    return header + text


def generate(out_dir: Path, proto_root: Path = DEFAULT_PROTO_ROOT) -> list[Path]:
    """Generate and post-process the stubs into ``out_dir/lutb/v1/``; return the files written."""
    from grpc_tools import protoc  # dev dependency; imported only here

    proto_include = Path(protoc.__file__).resolve().parent / "_proto"
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{proto_include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTO_FILES,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for generated in sorted(Path(tmp).rglob("*.py*")):
            rel = generated.relative_to(tmp)
            target = out_dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            module = generated.name.split(".")[0]
            target.write_text(_postprocess(generated.read_text(), module))
            written.append(target)
    for package in ("lutb", "lutb/v1"):
        init = out_dir / package / "__init__.py"
        if not init.exists():
            shutil.copyfile(PACKAGE_DIR / package / "__init__.py", init)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR, help="directory that receives lutb/v1/ (default: this package)")
    parser.add_argument("--proto-root", type=Path, default=DEFAULT_PROTO_ROOT, help="directory holding lutb/v1/*.proto")
    args = parser.parse_args(argv)
    for path in generate(args.out, args.proto_root):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["MIN_GRPCIO", "MIN_PROTOBUF", "PROTO_FILES", "generate"]
