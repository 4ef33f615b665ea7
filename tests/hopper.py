"""Kernels compiled for an H100 (sm_90) on a machine without one: their PTX and machine code (SASS),
for tests that check what the compilers emit. Run in a process without Triton's interpreter (the
CPU suite's conftest turns it on, and it patches ``triton.language`` once it has run a kernel)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping

import triton

from tests.servers import REPO, python_with_repo


def hopper_asm(kernel, signature: dict[str, str], constexprs: dict[str, object], aligned: tuple[int, ...] = (),
               num_warps: int = 4, **options) -> Mapping[str, object]:
    """The kernel compiled for sm_90: its ``asm`` (``"ptx"``; ``"sass"``, which Triton disassembles
    with the cuobjdump it ships, on demand)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                       constexprs=constexprs, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options}).asm


def hopper_ptx(kernel, signature: dict[str, str], constexprs: dict[str, object], aligned: tuple[int, ...] = (),
               num_warps: int = 4, **options) -> str:
    return hopper_asm(kernel, signature, constexprs, aligned, num_warps, **options)["ptx"]


def ptx_op(line: str) -> str:
    """The instruction of a PTX line, without its predicate guard (``@%p1``) or trailing ``;``."""
    return re.sub(r"^@!?%p\d+\s+", "", line.strip()).split()[0].rstrip(";")


def sass_op(line: str) -> str:
    """The instruction of a line of Triton's SASS listing (``ctrl\tINSTR operands;``), without its
    predicate guard (``@!P0``)."""
    instruction = line.split("\t")[-1].strip()
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].rstrip(";")


def run_compiled(code: str) -> str:
    """``code`` run in a fresh Python without the interpreter, from the repository: its stdout."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                            env=python_with_repo(env))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
