"""Regenerate the checked-in gRPC modules from the ``.proto`` sources in this folder.

The generated files are checked in so that installing pdserve needs no protoc; this script is
how they were made, and ``tests/proto/test_proto_generated.py`` checks that running it
again yields identical files. protoc writes ``import kv_transfer_pb2`` (a top-level module);
pdserve installs no top-level modules, so that line is rewritten to import from
``pdserve.proto``.

Next to each ``.py`` module, mypy-protobuf's protoc plugins write its ``.pyi`` stub (the
runtime modules build their classes from a serialized descriptor, so without the stubs mypy
sees no message fields and no servicer methods). The plugins are the ``protoc-gen-mypy`` and
``protoc-gen-mypy_grpc`` scripts that ``pip install mypy-protobuf`` puts next to the Python
running this script; the stubs get the same import rewriting as the modules.

    python -m pdserve.proto.generate            # rewrite the files in place
    python -m pdserve.proto.generate --out DIR  # write them to DIR instead
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("kv_transfer.proto", "generate.proto")
# mypy-protobuf's plugins, as protoc's --plugin flag names them.
STUB_PLUGINS = ("protoc-gen-mypy", "protoc-gen-mypy_grpc")


def _stub_plugin_flags() -> list[str]:
    """The ``--plugin`` flags for mypy-protobuf, found in the running interpreter's bin folder.

    Looked up next to ``sys.executable`` (not on PATH) so that the stubs always come from the
    pinned mypy-protobuf of the environment that runs this script.
    """
    bin_dir = Path(sys.executable).parent
    flags: list[str] = []
    for name in STUB_PLUGINS:
        plugin = bin_dir / name
        if not plugin.is_file():
            raise RuntimeError(
                f"{plugin} not found: install the test extra (`pip install -e '.[test]'`), "
                "which pins mypy-protobuf, into the environment that runs this script"
            )
        flags.append(f"--plugin={name}={plugin}")
    return flags


def _package_relative_imports(source: str) -> str:
    return re.sub(
        r"^import (\w+_pb2) as (\w+)$",
        r"from pdserve.proto import \1 as \2",
        source,
        flags=re.MULTILINE,
    )


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc on every source and return the paths of the files written to ``out_dir``."""
    written: list[Path] = []
    plugin_flags = _stub_plugin_flags()
    with tempfile.TemporaryDirectory() as scratch:
        for proto in PROTO_FILES:
            status = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"--proto_path={PROTO_DIR}",
                    *plugin_flags,
                    f"--python_out={scratch}",
                    f"--grpc_python_out={scratch}",
                    f"--mypy_out={scratch}",
                    f"--mypy_grpc_out={scratch}",
                    str(PROTO_DIR / proto),
                ]
            )
            if status != 0:
                raise RuntimeError(f"protoc failed on {proto} with status {status}")
        generated_files = [*Path(scratch).glob("*_pb2*.py"), *Path(scratch).glob("*_pb2*.pyi")]
        for generated in sorted(generated_files):
            target = out_dir / generated.name
            target.write_text(_package_relative_imports(generated.read_text()))
            written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="folder to write into")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
