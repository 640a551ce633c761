import subprocess
import sys
from pathlib import Path

import pdserve.proto

PROTO_DIR = Path(pdserve.proto.__file__).parent


def test_regenerating_the_grpc_modules_gives_the_checked_in_files(tmp_path: Path) -> None:
    # protoc runs in its own process: loading grpc_tools after torch crashes the process.
    subprocess.run(
        [sys.executable, "-m", "pdserve.proto.generate", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    written = sorted(path.name for path in tmp_path.iterdir())
    # The .pyi stubs (mypy-protobuf) are compared too: a stale stub misleads mypy silently.
    assert {
        f"{proto}{suffix}"
        for proto in ("kv_transfer_pb2", "generate_pb2")
        for suffix in (".py", "_grpc.py", ".pyi", "_grpc.pyi")
    } <= set(written)
    for name in written:
        assert (tmp_path / name).read_text() == (PROTO_DIR / name).read_text(), name


def test_generated_modules_import_from_the_pdserve_package() -> None:
    grpc_module = (PROTO_DIR / "kv_transfer_pb2_grpc.py").read_text()
    assert "from pdserve.proto import kv_transfer_pb2 as" in grpc_module
    grpc_stub = (PROTO_DIR / "kv_transfer_pb2_grpc.pyi").read_text()
    assert "from pdserve.proto import kv_transfer_pb2 as" in grpc_stub
