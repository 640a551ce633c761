"""Regenerate the checked-in gRPC modules from the ``.proto`` sources in this folder.

The generated files are checked in so that installing pdserve needs no protoc; this script is
how they were made, and ``tests/proto/test_proto_generated.py`` checks that running it
again yields identical files. protoc writes ``import kv_transfer_pb2`` (a top-level module);
pdserve installs no top-level modules, so that line is rewritten to import from
``pdserve.proto``.

    python -m pdserve.proto.generate            # rewrite the files in place
    python -m pdserve.proto.generate --out DIR  # write them to DIR instead
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("kv_transfer.proto", "generate.proto")


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
    with tempfile.TemporaryDirectory() as scratch:
        for proto in PROTO_FILES:
            status = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"--proto_path={PROTO_DIR}",
                    f"--python_out={scratch}",
                    f"--grpc_python_out={scratch}",
                    str(PROTO_DIR / proto),
                ]
            )
            if status != 0:
                raise RuntimeError(f"protoc failed on {proto} with status {status}")
        for generated in sorted(Path(scratch).glob("*_pb2*.py")):
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
