"""The CPU server's allocator: tcmalloc preloaded where installed, the operator's choice kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.sglang import allocator
from sglang_adatree.sglang.serve import build_command
from sglang_adatree.tools.bench.configurations import ServerSettings, parse_configurations

LIB = Path("/opt/lib/libtcmalloc_minimal.so.4")


def test_tcmalloc_goes_first_in_the_preload_unless_another_allocator_is_there():
    assert allocator.preload({}, LIB) == str(LIB)
    assert allocator.preload({"LD_PRELOAD": "/x/libiomp5.so"}, LIB) == f"{LIB}:/x/libiomp5.so"
    # The operator's own allocator, or glibc's by choice, is left alone.
    assert allocator.preload({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, LIB) is None
    assert allocator.preload({"ADATREE_ALLOCATOR": "system"}, LIB) is None
    assert allocator.preload({"ADATREE_ALLOCATOR": " TCMalloc "}, LIB) == str(LIB)
    with pytest.raises(ValueError, match="ADATREE_ALLOCATOR='glibc': expected one of tcmalloc"):
        allocator.preload({"ADATREE_ALLOCATOR": "glibc"}, LIB)


def test_a_missing_tcmalloc_is_said_once_and_changes_nothing(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert allocator.preload({}) is None
    assert "libtcmalloc-minimal4" in (allocator.missing_note({}) or "")
    assert allocator.missing_note({"ADATREE_ALLOCATOR": "system"}) is None
    env: dict[str, str] = {}
    build_command(["--model-path", "T", "--device", "cpu"], env)
    assert "LD_PRELOAD" not in env


def test_serve_and_every_bench_configuration_on_a_cpu_get_the_same_preload(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: LIB)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("ADATREE_ALLOCATOR", raising=False)
    env: dict[str, str] = {}
    build_command(["--model-path", "T", "--device", "cpu"], env)
    assert env["LD_PRELOAD"] == str(LIB)
    env = {}
    build_command(["--model-path", "T", "--device", "cuda"], env)
    assert "LD_PRELOAD" not in env  # only the CPU path
    with pytest.raises(SystemExit, match="adatree serve: ADATREE_ALLOCATOR"):
        build_command(["--model-path", "T", "--device", "cpu"], {"ADATREE_ALLOCATOR": "x"})
    # ar and adatree alike, so a comparison measures the policies on one allocator.
    configs = parse_configurations(
        ["ar", "static:2,2,4", "adatree"], "eagle", (TreeShape(2, 2, 4),)
    )
    cpu, gpu = ServerSettings("cpu"), ServerSettings("cuda")
    assert {c.env(cpu)["LD_PRELOAD"] for c in configs} == {str(LIB)}
    assert all("LD_PRELOAD" not in c.env(gpu) for c in configs)
    monkeypatch.setenv("ADATREE_ALLOCATOR", "system")
    assert all("LD_PRELOAD" not in c.env(cpu) for c in configs)


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="tcmalloc is not installed")
def test_a_process_started_with_the_preload_runs_on_tcmalloc():
    # The real library in a real process: what the server's processes inherit.
    code = "import os, sys; sys.stdout.write(open(f'/proc/{os.getpid()}/maps').read())"
    env = {**os.environ, "LD_PRELOAD": allocator.preload({}) or ""}
    maps = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "libtcmalloc" in maps.stdout
    code = "import time; print('up', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        assert allocator.mapped_allocator(child.pid) == "tcmalloc"
    finally:
        child.kill()
        child.wait()
    assert allocator.mapped_allocator(os.getpid()) == "system"
    assert allocator.mapped_allocator(2**22 + 12345) == "unknown"
