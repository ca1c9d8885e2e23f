"""The on-disk compile cache: key derivation and invalidation, environment switches, atomic writes, two processes
compiling one key, corrupt entries; the real kernels round-trip through it (CPU: load and signature; GPU: launch
from a fresh process, bit-exact)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import cute_mxfp8
from cute_mxfp8 import compile_cache
from cute_mxfp8.compile_cache import CompileCacheWarning, disk_cached

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pythonpath() -> str:
    """The checkout first, then whatever the parent had (the DSL may live on PYTHONPATH, as on the device)."""
    import os

    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


class JsonCodec:
    """Stores plain values as JSON text: the cache logic without the DSL."""

    suffix = ".txt"

    def save(self, obj, path):
        pathlib.Path(path).write_text(json.dumps(obj))

    def load(self, path):
        return json.loads(pathlib.Path(path).read_text())


@pytest.fixture
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.setenv("CUTE_MXFP8_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUTE_MXFP8_DISK_CACHE", raising=False)
    return tmp_path / "cache"


def _counting(codec=None, **kw):
    calls = []

    @disk_cached(codec=codec or JsonCodec(), **kw)
    def compile_thing(a, b="x", flag=False):
        calls.append((a, b, flag))
        return {"a": a, "b": b, "flag": flag}

    return compile_thing, calls


def _files(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_key_is_the_bound_arguments_and_a_hit_skips_the_compile(cache):
    f, calls = _counting()
    entry = f.disk_cache_entry(1)
    assert entry == f.disk_cache_entry(1, "x") == f.disk_cache_entry(a=1, flag=False)
    assert len({entry, f.disk_cache_entry(2), f.disk_cache_entry(1, "y"), f.disk_cache_entry(1, flag=True)}) == 4
    assert entry.parent == cache and entry.name.startswith("compile_thing-")
    assert f(1) == {"a": 1, "b": "x", "flag": False} and calls == [(1, "x", False)]
    assert f(a=1, b="x") == {"a": 1, "b": "x", "flag": False} and len(calls) == 1  # loaded, not compiled
    meta = json.loads(entry.with_suffix(".json").read_text())
    assert meta["args"] == {"a": 1, "b": "x", "flag": False} and meta["function"].endswith("compile_thing")
    assert meta["environment"]["cute_mxfp8"] == cute_mxfp8.__version__
    assert meta["environment"]["dsl"].get("nvidia-cutlass-dsl")  # the DSL version is part of the key
    import hashlib
    assert meta["sha256"] == hashlib.sha256(entry.read_bytes()).hexdigest()
    assert not [n for n in _files(cache) if n.endswith(".tmp")]


def test_key_changes_with_version_kernel_sources_and_codegen_env(cache, tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "kernels" / "k.py").write_text("A = 1\n")
    (pkg / "jit.py").write_text("J = 1\n")
    (pkg / "formats.py").write_text("F = 1\n")
    monkeypatch.setattr(compile_cache, "PACKAGE_ROOT", pkg)
    f, _ = _counting()
    base = f.disk_cache_entry(1)
    (pkg / "formats.py").write_text("F = 2\n")  # not a kernel source
    monkeypatch.setenv("CUTE_DSL_LOG_LEVEL", "10")  # logging does not change code
    assert f.disk_cache_entry(1) == base
    (pkg / "kernels" / "k.py").write_text("A = 2\n")
    edited = f.disk_cache_entry(1)
    assert edited != base
    (pkg / "jit.py").write_text("J = 2\n")
    assert f.disk_cache_entry(1) not in (base, edited)
    (pkg / "kernels" / "k.py").write_text("A = 1\n")
    (pkg / "jit.py").write_text("J = 1\n")
    assert f.disk_cache_entry(1) == base  # same sources, same key
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert f.disk_cache_entry(1) != base
    monkeypatch.delenv("CUTE_DSL_LINEINFO")
    monkeypatch.setattr(cute_mxfp8, "__version__", "9.9.9")
    assert f.disk_cache_entry(1) != base


def test_real_source_digest_covers_the_kernels_and_jit():
    files = {p.relative_to(compile_cache.PACKAGE_ROOT).as_posix()
             for pattern in compile_cache.SOURCE_GLOBS for p in compile_cache.PACKAGE_ROOT.glob(pattern)}
    assert {"jit.py", "kernels/quantize.py"} <= files
    assert len(compile_cache.source_digest()) == 64


def test_cache_directory_from_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("CUTE_MXFP8_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.cache_dir() == tmp_path / "home" / ".cache" / "cute_mxfp8"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == tmp_path / "xdg" / "cute_mxfp8"
    monkeypatch.setenv("CUTE_MXFP8_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.cache_dir() == tmp_path / "mine"


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_disk_cache_switched_off(cache, monkeypatch, value):
    monkeypatch.setenv("CUTE_MXFP8_DISK_CACHE", value)
    f, calls = _counting()
    f(1), f(1)
    assert len(calls) == 2 and _files(cache) == []


@pytest.mark.parametrize("value", ["1", " yes ", "ON", ""])
def test_disk_cache_switched_on(cache, monkeypatch, value):
    monkeypatch.setenv("CUTE_MXFP8_DISK_CACHE", value)
    f, calls = _counting()
    f(1), f(1)
    assert len(calls) == 1 and _files(cache) != []


def test_disk_cache_switch_typo_is_an_error(cache, monkeypatch):
    monkeypatch.setenv("CUTE_MXFP8_DISK_CACHE", "offf")  # a typo must not silently keep (or drop) the cache
    f, calls = _counting()
    with pytest.raises(ValueError, match="CUTE_MXFP8_DISK_CACHE='offf': set it to 1 \\(on\\) or 0 \\(off\\)"):
        f(1)
    assert calls == [] and _files(cache) == []


def test_skip_if_argument_bypasses_the_disk(cache):
    f, calls = _counting(skip_if="flag")
    f(1, flag=True), f(1, flag=True)
    assert len(calls) == 2 and _files(cache) == []
    f(1), f(1)
    assert len(calls) == 3


def test_bad_arguments_are_clear_errors(cache):
    f, _ = _counting()
    with pytest.raises(TypeError, match="argument 'a' is a list; a disk-cached compile function takes only"):
        f([1])
    assert f((1, "e4m3"))["a"] == (1, "e4m3")  # tuples are plain values too
    assert f((1, "e4m3"))["a"] == [1, "e4m3"]  # (loaded back from this test's JSON codec)
    with pytest.raises(TypeError, match="skip_if='keep_ptx' is not an argument"):
        disk_cached(lambda a: a, skip_if="keep_ptx")


def test_corrupt_entries_are_deleted_and_rebuilt_with_a_warning(cache):
    f, calls = _counting()
    f(1)
    entry = f.disk_cache_entry(1)
    meta = entry.with_suffix(".json")
    entry.write_text('{"a": 666}')  # bytes changed: checksum mismatch
    with pytest.warns(CompileCacheWarning, match="unusable \\(checksum mismatch"):
        assert f(1)["a"] == 1
    assert len(calls) == 2 and f(1)["a"] == 1 and len(calls) == 2  # rebuilt entry is good
    meta.unlink()  # an interrupted write: artifact without its record
    with pytest.warns(CompileCacheWarning, match="FileNotFoundError"):
        f(1)
    assert len(calls) == 3

    class Unloadable(JsonCodec):
        def load(self, path):
            raise RuntimeError("bad object file")

    g, g_calls = _counting(codec=Unloadable())
    g(2)
    with pytest.warns(CompileCacheWarning, match="RuntimeError: bad object file"):
        assert g(2)["a"] == 2
    assert len(g_calls) == 2


def test_an_entry_that_cannot_be_deleted_still_compiles(cache):
    """A corrupt artifact that unlink refuses (here: a directory in its place) warns and compiles; no crash."""
    f, calls = _counting()
    f(1)
    entry = f.disk_cache_entry(1)
    entry.unlink()
    entry.mkdir()
    (entry / "x").write_text("not an object file")
    with pytest.warns(CompileCacheWarning):
        assert f(1)["a"] == 1
    assert len(calls) == 2


def test_failed_write_warns_and_leaves_nothing_behind(cache):
    class Failing(JsonCodec):
        def save(self, obj, path):
            pathlib.Path(path).write_text("half")
            raise OSError("disk full")

    f, calls = _counting(codec=Failing())
    with pytest.warns(CompileCacheWarning, match="could not write .*disk full"):
        assert f(1)["a"] == 1
    assert [n for n in _files(cache) if not n.endswith(".lock")] == []


def test_unusable_directory_warns_and_compiles(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("CUTE_MXFP8_CACHE_DIR", str(blocker / "cache"))
    f, calls = _counting()
    with pytest.warns(CompileCacheWarning, match="is not usable"):
        assert f(1)["a"] == 1
    assert len(calls) == 1


def test_no_file_locking_warns_and_compiles(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "fcntl", None)  # as on a system without fcntl: import fails
    f, calls = _counting()
    with pytest.warns(CompileCacheWarning, match="is not usable"):
        assert f(1)["a"] == 1
    assert len(calls) == 1


_RACE = """
import json, os, pathlib, sys, time
from cute_mxfp8.compile_cache import disk_cached

work = pathlib.Path(sys.argv[1])

class Codec:
    suffix = ".txt"
    def save(self, obj, path): pathlib.Path(path).write_text(json.dumps(obj))
    def load(self, path): return json.loads(pathlib.Path(path).read_text())

@disk_cached(codec=Codec())
def compile_slow(n):
    with open(work / "log", "a") as f:
        f.write(f"compile {os.getpid()}\\n")
    time.sleep(1.0)  # the other process asks for the same key meanwhile
    return {"n": n, "by": os.getpid()}

(work / f"ready-{os.getpid()}").touch()
deadline = time.time() + 60
while len(list(work.glob("ready-*"))) < 2 and time.time() < deadline:  # start both calls together
    time.sleep(0.01)
print(json.dumps(compile_slow(7)))
"""


def test_two_processes_compiling_one_key_compile_once(cache, tmp_path):
    script = tmp_path / "race.py"
    script.write_text(textwrap.dedent(_RACE))
    env = {**__import__("os").environ, "PYTHONPATH": _pythonpath()}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    log = (tmp_path / "log").read_text().splitlines()
    assert len(log) == 1  # the second process waited on the lock and loaded the first one's entry
    assert results[0] == results[1] == {"n": 7, "by": int(log[0].split()[1])}


# ---- the real kernels -------------------------------------------------------------------------------------------

ROWWISE = ("rowwise", "bfloat16", "e4m3", "rceil", False, "sm_90a")


class _NoCompile:
    def __getitem__(self, _):
        return self

    def __call__(self, *a, **k):
        raise AssertionError("cute.compile was called: the disk cache missed")


def test_every_compile_function_is_disk_cached():
    from cute_mxfp8 import jit

    names = [n for n in dir(jit) if n.startswith("compile_") and callable(getattr(jit, n))]
    assert "compile_quant" in names
    for name in names:
        fn = getattr(jit, name)
        assert hasattr(fn, "cache_clear") and hasattr(fn, "disk_cache_entry"), f"{name} lacks a cache level"


def test_memory_level_takes_a_list_as_the_equal_tuple(cache):
    """``compile_gemm_sm90(cluster_mn=[1, 1])`` failed in lru_cache (a list is unhashable); the memory level now
    takes it as ``(1, 1)``: one entry for both spellings, one compile, the disk entry shared."""
    disk_level, calls = _counting()
    compile_thing = compile_cache.memory_cached(disk_level)
    assert compile_thing([1, [2, 3]], b=("y", ["z"])) == {"a": (1, (2, 3)), "b": ("y", ("z",)), "flag": False}
    assert compile_thing((1, (2, 3)), b=("y", ("z",))) == compile_thing([1, [2, 3]], b=["y", ["z"]])
    assert calls == [((1, (2, 3)), ("y", ("z",)), False)]  # the function saw tuples, once
    assert compile_thing.cache_info().currsize == 1
    assert compile_thing.__wrapped__ is disk_level and compile_thing.disk_cache_entry((1, (2, 3))).parent == cache
    compile_thing.cache_clear()
    assert compile_thing.cache_info().currsize == 0


def test_memory_level_keeps_the_functions_own_type_error():
    """A TypeError of the function itself (no list involved) propagates once, not retried."""
    calls = []

    @compile_cache.memory_cached
    def compile_bad(a):
        calls.append(a)
        raise TypeError(f"bad {a!r}")

    with pytest.raises(TypeError, match="bad 1"):
        compile_bad(1)
    with pytest.raises(TypeError, match=r"bad \(1,\)"):
        compile_bad([1])  # retried as a tuple: the function's error for the tuple
    assert calls == [1, (1,)]
    with pytest.raises(TypeError, match="unhashable"):
        compile_bad({1: 2})  # no list to make a tuple of: lru_cache's own error


def test_compiled_kernel_round_trips_through_disk(cache, monkeypatch):
    cute = pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is a dependency; install the package")
    import tvm_ffi

    from cute_mxfp8.jit import compile_quant

    compile_quant.cache_clear()
    try:
        compile_quant(*ROWWISE)
        entry = compile_quant.disk_cache_entry(*ROWWISE)
        assert entry.suffix == ".o" and entry.read_bytes()[:4] == b"\x7fELF"  # a relocatable object file
        compile_quant.cache_clear()
        with monkeypatch.context() as m:
            m.setattr(cute, "compile", _NoCompile())
            loaded = compile_quant(*ROWWISE)
        assert isinstance(loaded, tvm_ffi.Function)
        x = torch.zeros(4, 32, dtype=torch.bfloat16)
        # the loaded function checks its arguments like the compiled one: three tensors, on the GPU
        with pytest.raises(ValueError, match=r"x: Tensor\(\[n0, n1\], bfloat16\).*device_type=cuda"):
            loaded(x, torch.zeros(4, 32, dtype=torch.float8_e4m3fn), torch.zeros(4, 1, dtype=torch.uint8))
        entry.write_bytes(entry.read_bytes()[:1000])  # truncated: recompiled with a warning
        compile_quant.cache_clear()
        with pytest.warns(CompileCacheWarning, match="checksum mismatch"):
            rebuilt = compile_quant(*ROWWISE)
        assert not isinstance(rebuilt, tvm_ffi.Function) and entry.stat().st_size > 1000
    finally:
        compile_quant.cache_clear()


def test_inspection_builds_bypass_the_disk(cache):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")
    from cute_mxfp8.jit import compile_quant

    assert ".target sm_90a" in compile_quant.__wrapped__(*ROWWISE, keep_ptx=True).__ptx__
    assert _files(cache) == []


_LAUNCH = """
import sys, torch
import cutlass.cute as cute
from cute_mxfp8 import formats
from cute_mxfp8.jit import compile_quant

arch = "sm_100f" if torch.cuda.get_device_capability()[0] == 10 else "sm_90a"
key = ("rowwise", "bfloat16", "e4m3", "rceil", False, arch)
if sys.argv[1] == "compile":
    compile_quant(*key)
    sys.exit(0)

class NoCompile:
    def __getitem__(self, _): return self
    def __call__(self, *a, **k): raise AssertionError("cute.compile was called: the disk cache missed")

cute.compile = NoCompile()
fn = compile_quant(*key)
g = torch.Generator().manual_seed(0)
x = (torch.randn(257, 4096, generator=g) * torch.logspace(-8, 8, 4096)).to(torch.bfloat16)
x[0, :32] = float("nan")
q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
s = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.uint8, device="cuda")
fn(x.cuda(), q, s)
torch.cuda.synchronize()
ref_q, ref_s = formats.quantize_mxfp8(x, scale_mode="rceil", elem_dtype=torch.float8_e4m3fn)
assert torch.equal(q.view(torch.uint8).cpu(), ref_q.view(torch.uint8)), "data differs"
assert torch.equal(s.cpu(), ref_s.view(torch.uint8)), "scales differ"
print("bit-exact from disk:", type(fn).__name__)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
                    reason="needs an SM90 or SM100 GPU (run on the H200 with -m gpu)")
def test_kernel_launches_from_disk_in_a_fresh_process(cache, tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(_LAUNCH)
    env = {**__import__("os").environ, "PYTHONPATH": _pythonpath(), "CUTE_MXFP8_CACHE_DIR": str(cache)}
    for step in ("compile", "launch"):
        res = subprocess.run([sys.executable, str(script), step], env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, f"{step}: {res.stderr[-3000:]}"
    assert "bit-exact from disk: Function" in res.stdout


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100f"])
def test_launchable_build_targets_the_arch_it_is_given(arch, monkeypatch):
    """The TVM-FFI build's options string carries the arch: without it the DSL's default (CUTE_DSL_ARCH, or the
    local GPU's) would replace the ``arch`` argument."""
    import re

    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is a dependency; install the package")
    from cute_mxfp8 import jit

    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    build = jit.compile_quant.__wrapped__.__wrapped__  # past the in-memory and disk caches
    fn = build("rowwise", "bfloat16", "e4m3", "rceil", True, arch)
    assert set(re.findall(r"sm_\d+[af]?", str(fn.ir_module))) == {arch}


def test_importing_the_package_does_not_import_the_dsl():
    """The DSL (~0.7 s to import) loads with the first kernel build, not with ``import cute_mxfp8`` and its ops and
    modules (the reference backend, the fakes and the CPU paths need none of it)."""
    code = ("import sys, cute_mxfp8, cute_mxfp8.ops, cute_mxfp8.nn, cute_mxfp8.ops.gemm_sm90\n"
            "print(sorted(m for m in sys.modules if m == 'cutlass' or m.startswith('cutlass.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
