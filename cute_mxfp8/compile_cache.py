"""On-disk cache of compiled kernels: ``@disk_cached`` under ``functools.lru_cache`` on every ``compile_*``.

A disk entry is keyed on what can change the generated code and nothing else:

* the compile function (module and qualname) and its bound arguments, defaults applied, so ``f(a, b=1)`` and
  ``f(a)`` share an entry.  Arguments must be plain values (str, int, float, bool, None, tuples of them);
* the versions of ``cute_mxfp8``, the ``nvidia-cutlass-dsl*`` distributions and ``apache-tvm-ffi``, the host
  machine type, the ``CUTE_DSL_*`` environment variables that affect compilation, and a SHA-256 of the kernel
  sources (:data:`SOURCE_GLOBS` under the package), so editing a kernel invalidates its entries.

Entries live in ``$CUTE_MXFP8_CACHE_DIR``, else ``$XDG_CACHE_HOME/cute_mxfp8``, else ``~/.cache/cute_mxfp8``, as
``<function>-<digest>.o`` (the artifact), ``.json`` (its SHA-256 and the readable key) and ``.lock``.
``CUTE_MXFP8_DISK_CACHE=0`` turns the cache off.  Concurrent compilers of one key are serialized by ``flock`` on
the key's lock file, so a second process waits and loads what the first wrote; files are written to a temporary
name in the same directory and renamed into place, so no reader ever sees half an entry.  An entry that fails
its checksum or does not load is deleted and recompiled with a :class:`CompileCacheWarning`; an unusable cache
directory also only warns.  Errors of the compile function itself propagate unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import pathlib
import platform
import tempfile
import warnings
from importlib import metadata

from .env import env_flag

ENV_DIR = "CUTE_MXFP8_CACHE_DIR"
ENV_SWITCH = "CUTE_MXFP8_DISK_CACHE"
PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent
SOURCE_GLOBS = ("kernels/**/*.py", "jit.py")
# CUTE_DSL_* variables that do not change generated code (logging, dumps, caching, diagnostics); every other
# CUTE_DSL_* variable set in the environment is part of the key.
_DSL_ENV_IGNORED = ("CUTE_DSL_LOG", "CUTE_DSL_KEEP", "CUTE_DSL_DUMP_DIR", "CUTE_DSL_CACHE_DIR", "CUTE_DSL_PRINT",
                    "CUTE_DSL_SHOW_STACKTRACE", "CUTE_DSL_FILTER_STACKTRACE", "CUTE_DSL_JIT_TIME_PROFILING",
                    "CUTE_DSL_WARNINGS_IGNORE", "CUTE_DSL_ENABLE_OPTIMIZATION_WARNINGS", "CUTE_DSL_NO_CACHE",
                    "CUTE_DSL_DISABLE_FILE_CACHING", "CUTE_DSL_JIT_CACHE_MAX_ELEMS")
_PLAIN = (str, int, float, bool, type(None))


class CompileCacheWarning(UserWarning):
    """The disk cache could not be used for one call (the kernel was compiled instead)."""


def cache_dir() -> pathlib.Path:
    """The cache directory the environment selects (not created here)."""
    if os.environ.get(ENV_DIR):
        return pathlib.Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "cute_mxfp8"


def enabled() -> bool:
    """False when ``CUTE_MXFP8_DISK_CACHE`` is 0/false/no/off; True when unset, empty or 1/true/yes/on; ValueError
    naming the variable for anything else (:func:`cute_mxfp8.env.env_flag`)."""
    return env_flag(ENV_SWITCH, True)


def source_digest() -> str:
    """SHA-256 over the relative paths and contents of the kernel sources (:data:`SOURCE_GLOBS`)."""
    h = hashlib.sha256()
    files = sorted({p for pattern in SOURCE_GLOBS for p in PACKAGE_ROOT.glob(pattern) if p.is_file()})
    for path in files:
        h.update(path.relative_to(PACKAGE_ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _toolchain() -> tuple:
    """Installed versions of the DSL distributions (compiler, libraries, CUDA flavour) and TVM-FFI; scanning the
    installed distributions takes tens of ms, so once per process."""
    dsl = {d.metadata["Name"]: d.version for d in metadata.distributions()
           if (d.metadata["Name"] or "").lower().startswith("nvidia-cutlass-dsl")}
    return tuple(sorted(dsl.items())), _version("apache-tvm-ffi")


def fingerprint() -> dict:
    """Everything outside the arguments that goes into the key."""
    from . import __version__

    dsl, tvm_ffi = _toolchain()
    return {"cute_mxfp8": __version__, "sources": source_digest(), "dsl": dict(dsl), "tvm_ffi": tvm_ffi,
            "machine": f"{platform.system()}-{platform.machine()}",
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith("CUTE_DSL_") and not k.startswith(_DSL_ENV_IGNORED)}}


def _plain(name: str, value, owner: str):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, tuple):
        return [_plain(name, v, owner) for v in value]
    raise TypeError(f"{owner}: argument {name!r} is a {type(value).__name__}; a disk-cached compile function takes "
                    f"only str/int/float/bool/None or tuples of them, which are what its compile key is made of")


class TvmFfiObjectCodec:
    """Persists a TVM-FFI compiled CuTe DSL function as a relocatable object file (``export_to_c``) and loads it
    back with ``cutlass.cute.runtime.load_module`` (in-memory JIT link, no compiler and no GPU needed to load).
    The loaded function is a positional-only ``tvm_ffi.Function`` with the same signature."""

    suffix = ".o"
    symbol = "cute_mxfp8_entry"

    def save(self, obj, path: str) -> None:
        if not hasattr(obj, "export_to_c"):
            raise TypeError(f"{type(obj).__name__} cannot be exported (not a CuTe DSL compiled function)")
        obj.export_to_c(path, function_name=self.symbol)

    def load(self, path: str):
        from cutlass.cute.runtime import load_module

        return getattr(load_module(path, enable_tvm_ffi=True), self.symbol)


class _Entry:
    """The files of one key: ``<stem>.o`` (artifact), ``<stem>.json`` (checksum + key), ``<stem>.lock``."""

    def __init__(self, directory: pathlib.Path, stem: str, key: dict, codec):
        self.key, self.codec = key, codec
        self.artifact = directory / (stem + codec.suffix)
        self.meta = directory / (stem + ".json")
        self.lock_path = directory / (stem + ".lock")

    def load(self):
        """``(obj, None)`` on success, ``(None, None)`` if absent, ``(None, reason)`` if present but unusable."""
        if not self.artifact.exists() and not self.meta.exists():
            return None, None
        try:
            meta = json.loads(self.meta.read_text())
            digest = hashlib.sha256(self.artifact.read_bytes()).hexdigest()
            if meta.get("sha256") != digest:
                return None, f"checksum mismatch (recorded {meta.get('sha256')}, file {digest})"
            return self.codec.load(str(self.artifact)), None
        except Exception as e:  # noqa: BLE001 -- any failure to read or load means: rebuild this entry
            return None, f"{type(e).__name__}: {str(e).strip()[:300]}"

    @contextlib.contextmanager
    def locked(self):
        import fcntl

        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def remove(self) -> None:
        """Delete the entry's files; one that cannot be deleted (another user's, immutable, a directory) is left,
        and the store that follows fails with a warning instead."""
        for path in (self.meta, self.artifact):
            with contextlib.suppress(OSError):
                path.unlink()

    def store(self, obj) -> None:
        """Artifact first, then its checksum record; each written to a temporary file and renamed into place."""
        directory = self.artifact.parent
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.artifact.name}.", suffix=".tmp")
        os.close(fd)
        try:
            self.codec.save(obj, tmp)
            digest = hashlib.sha256(pathlib.Path(tmp).read_bytes()).hexdigest()
            os.replace(tmp, self.artifact)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.meta.name}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"sha256": digest, **self.key}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.meta)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _warn(message: str) -> None:
    warnings.warn(message, CompileCacheWarning, stacklevel=3)


def _as_tuples(value):
    """``value`` with every list (at any depth, inside tuples too) made the tuple it equals."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


def _has_list(value) -> bool:
    return isinstance(value, list) or (isinstance(value, tuple) and any(_has_list(v) for v in value))


def memory_cached(fn=None, *, typed: bool = False):
    """Decorator: ``functools.lru_cache`` (unbounded, ``typed`` as there) over ``fn``, the in-memory level above
    :func:`disk_cached`.  A list argument (``cluster_mn=[2, 1]``) is taken as the tuple it equals instead of
    failing as unhashable; the two share an entry.  Keeps ``cache_clear`` / ``cache_info``, ``__wrapped__`` (the
    level below) and that level's ``disk_cache_entry``."""
    if fn is None:
        return functools.partial(memory_cached, typed=typed)
    cached = functools.lru_cache(maxsize=None, typed=typed)(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return cached(*args, **kwargs)
        except TypeError:  # unhashable (a list) -- or fn's own TypeError, re-raised when no list was given
            if not _has_list((args, tuple(kwargs.values()))):
                raise
            return cached(*_as_tuples(args), **{k: _as_tuples(v) for k, v in kwargs.items()})

    wrapper.cache_clear = cached.cache_clear
    wrapper.cache_info = cached.cache_info
    return wrapper


def disk_cached(fn=None, *, skip_if: str | None = None, codec=None):
    """Decorator: persist what ``fn`` returns on disk under its compile key (see the module docstring).

    ``skip_if`` names a boolean argument of ``fn`` that bypasses the disk (e.g. ``keep_ptx``: inspection builds).
    ``codec`` has ``suffix``, ``save(obj, path)`` and ``load(path)``; default :class:`TvmFfiObjectCodec`.
    A fresh compile returns ``fn``'s own result; a hit returns the loaded artifact.  The wrapper's
    ``disk_cache_entry(*args, **kwargs)`` gives the artifact path a call would use.
    """
    if fn is None:
        return functools.partial(disk_cached, skip_if=skip_if, codec=codec)
    codec = codec or TvmFfiObjectCodec()
    signature = inspect.signature(fn)
    owner = f"{fn.__module__}.{fn.__qualname__}"
    if skip_if is not None and skip_if not in signature.parameters:
        raise TypeError(f"disk_cached({owner}): skip_if={skip_if!r} is not an argument of the function")

    def entry_for(bound) -> _Entry:
        args = {name: _plain(name, value, owner) for name, value in bound.arguments.items()}
        key = {"function": owner, "args": args, "environment": fingerprint()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return _Entry(cache_dir(), f"{fn.__name__}-{digest}", key, codec)

    def bind(args, kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = bind(args, kwargs)
        if not enabled() or (skip_if is not None and bound.arguments[skip_if]):
            return fn(*args, **kwargs)
        entry = entry_for(bound)
        obj, _ = entry.load()  # fast path, no lock
        if obj is not None:
            return obj
        lock = contextlib.ExitStack()
        try:
            lock.enter_context(entry.locked())
        except (OSError, ImportError) as e:  # ImportError: no fcntl (not a POSIX system)
            _warn(f"compile cache directory {entry.lock_path.parent} is not usable ({e}); compiling without it")
            return fn(*args, **kwargs)
        with lock:
            obj, problem = entry.load()  # another process may have written it while we waited
            if obj is not None:
                return obj
            if problem is not None:
                _warn(f"compile cache entry {entry.artifact} is unusable ({problem}); deleting it and recompiling")
                entry.remove()
            obj = fn(*args, **kwargs)
            try:
                entry.store(obj)
            except Exception as e:  # noqa: BLE001 -- the compiled function is good; only persisting failed
                _warn(f"could not write compile cache entry {entry.artifact} ({type(e).__name__}: {e})")
            return obj

    wrapper.disk_cache_entry = lambda *args, **kwargs: entry_for(bind(args, kwargs)).artifact
    return wrapper
