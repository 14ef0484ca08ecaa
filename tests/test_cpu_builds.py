"""Every instruction set's kernel library compiles, on whatever x86 CPU the tests run on.

A machine builds and tests only the sets its CPU runs (tests/test_cpu_ops.py), so a set for
another CPU kind can break unseen (a file that compiles against AVX2's ATen headers but not
AVX512's leaves every AVX512 CPU without kernels). Compiling needs no such CPU."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.utils import cpp_extension

from agentflash.kernels import cpu_ops
from skips import X86_COMPILER

_COMPILER = shutil.which("c++")


@X86_COMPILER.mark
@pytest.mark.parametrize("isa", [candidate.name for candidate in cpu_ops.ISAS
                                 # the one loaded here is built and run by test_cpu_ops.py
                                 if not (cpu_ops.available() and candidate == cpu_ops.isa())])
def test_every_instruction_set_compiles(isa):
    chosen = next(candidate for candidate in cpu_ops.ISAS if candidate.name == isa)
    sources = cpu_ops.source_paths(chosen)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    includes += [f"-I{sysconfig.get_paths()['include']}", f"-I{sources[0].parent}"]

    # its own files also with all its extras (AVX512-VNNI: a CPU may have it or not)
    extras = chosen.flags + tuple(flag for _, flag in chosen.extras)
    jobs = [(source, chosen.flags) for source in sources]
    if extras != chosen.flags:
        own = set(cpu_ops.own_sources(chosen))
        jobs += [(source, extras) for source in sources if source in own]

    def check(job):
        source, flags = job
        run = subprocess.run([_COMPILER, "-std=c++20", "-fsyntax-only", *flags, *includes,
                              str(source)], capture_output=True, text=True, timeout=600)
        return source.name, flags[len(chosen.flags):], run.returncode, run.stderr[-3000:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = [result for result in pool.map(check, jobs) if result[2] != 0]
    assert not failed, failed
