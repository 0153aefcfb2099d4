"""Regenerate gateway/pb from proto/ (python -m gateway.protogen).

protoc writes absolute imports (`import specgate_pb2`); they are rewritten to
package imports so the generated code needs nothing on sys.path. A test checks
the committed files equal a fresh generation.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto" / "specgate" / "v1"
OUT = Path(__file__).resolve().parent / "pb"
FILES = ("specgate_pb2.py", "specgate_pb2.pyi", "specgate_pb2_grpc.py")


def generate(out: Path) -> None:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                          f"--grpc_python_out={tmp}", str(PROTO_DIR / "specgate.proto")])
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        for name in FILES:
            text = (Path(tmp) / name).read_text()
            text = re.sub(r"^import specgate_pb2 as", "from gateway.pb import specgate_pb2 as", text, flags=re.M)
            (out / name).write_text(text)
    (out / "__init__.py").write_text('"""Generated from proto/specgate/v1/specgate.proto by gateway.protogen."""\n')


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
    print(f"generated {', '.join(FILES)} in {OUT}")
