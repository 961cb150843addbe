"""Build hook: generate the protobuf modules from proto/ at build time, and build the optional
C encoder of packed int64 fields.

Generated code is never committed. A regular build writes it into the wheel's
build directory; an editable install writes it next to the sources (git-ignored)
so `pip install -e .` regenerates it.

The C extension (``router.wire._packed``) is optional: without a compiler or Python's headers the
build warns and goes on, and ``router.wire.decode`` encodes block keys with protobuf instead.
"""

from __future__ import annotations

import pathlib

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).parent.resolve()
PROTO_DIR = ROOT / "proto"
GENERATED_PACKAGE = ("router", "wire")


def _generate(out_dir: pathlib.Path) -> list[str]:
    from grpc_tools import protoc  # build dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p) for p in PROTO_DIR.glob("*.proto"))
    if not sources:
        raise RuntimeError(f"no .proto files found in {PROTO_DIR}")
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    return [str(out_dir / (pathlib.Path(s).stem + suffix)) for s in sources for suffix in ("_pb2.py", "_pb2.pyi")]


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            target = ROOT.joinpath(*GENERATED_PACKAGE)
        else:
            target = pathlib.Path(self.build_lib).joinpath(*GENERATED_PACKAGE)
        self._generated = _generate(target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs.extend(getattr(self, "_generated", []))
        return outputs


setup(
    cmdclass={"build_py": BuildPyWithProtos},
    ext_modules=[Extension("router.wire._packed", ["router/wire/_packed.c"], optional=True)],
)
