"""Compile cache for the CuTe DSL kernels: one compiled function per compile key, built on first use.

The key of each ``compile_*`` function is exactly its arguments, which are exactly what changes code generation:
element and input dtypes, scale mode, layout flags and the target arch.  Shapes are symbolic (``cute.sym_int``),
so no shape ever recompiles.  Compiling needs no GPU: pass ``arch="sm_100f"`` to build for Blackwell on any
machine (the CI does this for every variant).  The DSL is imported here lazily, so importing ``cute_mxfp8`` never
needs it.

Two cache levels, stacked on every ``compile_*``: :func:`cute_mxfp8.compile_cache.memory_cached` (in memory, per
process: ``functools.lru_cache`` taking a list argument as the equal tuple) over
:func:`cute_mxfp8.compile_cache.disk_cached` (on disk, shared by processes).  The disk key adds to the arguments
the package and DSL versions and a hash of ``kernels/**/*.py`` and this file, so editing a kernel recompiles it.
A compiled function is stored as a TVM-FFI object file and loaded back (no compiler run, no GPU needed) by the
next process that asks for the same key; concurrent compilers of one key wait on a file lock and load what the
first one wrote.  The directory is ``$CUTE_MXFP8_CACHE_DIR`` (default ``$XDG_CACHE_HOME/cute_mxfp8`` or
``~/.cache/cute_mxfp8``); ``CUTE_MXFP8_DISK_CACHE=0`` turns the disk level off.  Inspection builds
(``keep_ptx=True``) bypass the disk.  A function loaded from disk is positional-only: call ``fn(*tensors)``.
New ``compile_*`` functions take the same two decorators (a test checks that every one does).
"""

from __future__ import annotations

import contextlib
import functools

from .compile_cache import disk_cached, memory_cached

_IN_DTYPES = ("bfloat16", "float32")


def _cutlass():
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


def _sym(divisibility: int = 1):
    """A fresh symbolic dimension (every tensor gets its own: TVM-FFI requires tensors sharing a symbol to agree)."""
    _, cute = _cutlass()
    return cute.sym_int(divisibility=divisibility) if divisibility > 1 else cute.sym_int()


def _fake(dtype, shape, align: int | None = None):
    """Row-major fake tensor for compiling.  By default data (fp8 / bf16 / fp32) is 16-byte aligned (the ops layer
    checks inputs and allocates outputs so); 8-bit scales and int32 offsets assume only their element alignment (a
    view such as ``s[row0:]`` of plain scales or a slice of ``offs`` may start anywhere).  ``align`` overrides."""
    cutlass, _ = _cutlass()
    from cutlass.cute.runtime import make_fake_compact_tensor

    if align is None:
        align = dtype.width // 8 if dtype in (cutlass.Uint8, cutlass.Int32) else 16
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),
                                    assumed_align=align)


def _hp_dtype(name: str):
    """The DSL dtype of a high-precision input named by ``_IN_DTYPES``."""
    cutlass, _ = _cutlass()
    return cutlass.BFloat16 if name == "bfloat16" else cutlass.Float32


def _tile_scales(blocked: bool):
    """Fake scales of a tile-kernel output: (E, blocked numel) or plain (E, rows, cols), uint8."""
    cutlass, _ = _cutlass()
    return _fake(cutlass.Uint8, (_sym(), _sym()) if blocked else (_sym(), _sym(), _sym()))


def _compile(kernel, args, arch: str, keep_ptx: bool):
    """Compile ``kernel(*args, stream)`` for ``arch``.  The launchable build takes its stream from the caller's
    context through TVM-FFI (``torch.cuda.current_stream()``), so the call is ``fn(*tensors)`` and kernels are
    ordered with the surrounding torch work on any stream.

    With ``keep_ptx`` the build is for inspection, not launchable from torch: ``.__ptx__`` (text), ``.__cubin__``
    (ELF bytes) and ``.launch_smem`` (dynamic shared memory bytes per kernel launch, ``None`` where unknown)."""
    _, cute = _cutlass()
    from cutlass.cute.runtime import make_fake_stream

    if keep_ptx:
        import tempfile

        from cutlass.base_dsl.compiler import DumpDir

        # The DSL also writes the PTX and CUBIN to files: keep them out of the caller's working directory.
        with tempfile.TemporaryDirectory(prefix="cute_mxfp8_ptx_") as tmp, _recording_launch_smem() as smem:
            fn = cute.compile[cute.GPUArch(arch), cute.KeepPTX, cute.KeepCUBIN, DumpDir(tmp)](
                kernel, *args, make_fake_stream())
        fn.launch_smem = tuple(smem) if smem else (None,)
        return fn
    # an options string replaces the bracketed options, so the arch goes into it too (else the DSL's default
    # arch, CUTE_DSL_ARCH or the local GPU's, silently wins)
    return cute.compile(kernel, *args, make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=f"--enable-tvm-ffi --gpu-arch {arch}")


@contextlib.contextmanager
def _recording_launch_smem():
    """Collects the ``smem=`` argument of every ``kernel(...).launch(...)`` traced inside (an int, ``None`` if not
    a Python int).  Yields an empty list if the DSL's launcher class is not where this expects it."""
    seen: list = []
    try:
        from cutlass.cutlass_dsl.cutlass import KernelLauncher
    except ImportError:
        yield seen
        return
    original = KernelLauncher.launch

    def launch(self, *args, **kwargs):
        smem = kwargs.get("smem", 0)
        seen.append(smem if isinstance(smem, int) else None)
        return original(self, *args, **kwargs)

    KernelLauncher.launch = launch
    try:
        yield seen
    finally:
        KernelLauncher.launch = original


@memory_cached
@disk_cached(skip_if="keep_ptx")
def compile_quant(direction: str, in_dtype: str, elem: str, scale_mode: str, blocked: bool, arch: str,
                  keep_ptx: bool = False, grouped: bool = False, batched: bool = False, scale_block: int = 32,
                  phase: str = "cast", pad_groups: bool = False, blocks_2d: bool = False, keep_run: bool = False,
                  gate_up: bool = False, packed_stores: bool = True):
    """Compiled MXFP8 cast for ``arch`` (e.g. ``"sm_90a"``).  ``direction``: ``"rowwise"``, ``"colwise"`` or
    ``"dual"``; ``grouped``: token groups along M (``offs``); ``batched``: rowwise of 3-D (E, N, K) weights.

    Kernels and call conventions (torch tensors, all contiguous; the stream is torch's current stream):

    * rowwise: :class:`~cute_mxfp8.kernels.quantize.RowwiseQuantKernel`, ``fn(x, q, s)``: x (M, K), q (M, K) fp8,
      s (M, K/32) uint8 or a 1-D blocked buffer.  Grouped (blocked only):
      :class:`~cute_mxfp8.kernels.quantize.GroupedRowwiseQuantKernel`, ``fn(x, q, s, offs, tile_starts)``.
    * colwise, dual, and batched rowwise: :class:`~cute_mxfp8.kernels.quantize_tile.TileQuantKernel`,
      ``fn(x, q, s, qt, st, offs, tile_starts)`` with 3-D tensors (a 2-D input as E = 1): x (E, M, K); rowwise
      q (E, M, K), s (E, M, K/32) or (E, blocked numel); colwise qt (E, K, Mp), st (E, K, Mp/32) or
      (E, blocked numel); offs and tile_starts (G,) int32 (any int32 tensor when not grouped).  Grouped (token
      groups along M, E = 1): qt (1, K, M) and st (1, K, 4 * (M // 128 + G)) plain or (1, blocked numel of that),
      zero-filled; rowwise blocked scales in the grouped-M layout.  Unused outputs take placeholders of the right
      rank, dtype and divisibility.  ``batched`` only selects the tile kernel for rowwise (colwise and dual
      always run on it), and takes no groups.  Then ``amax_rows``, ``amax_cols``: int32 (E, M, ceil(K/128)) and
      (E, ceil(blocks/4), K) for the two-launch ``scale_block=128`` form (zero-filled, shared by the
      ``phase="amax"`` launch and the ``"apply"`` launch after it), placeholders otherwise.
    * ``scale_block=128`` always runs the tile kernel (rowwise too, grouped or not): ``phase="cast"`` in one
      launch (one CTA per run of four 32-row blocks; what the ops use), or ``"amax"`` then ``"apply"``.
    * ``pad_groups`` (grouped colwise / dual): qt (1, K, 128 * (M // 128 + G)) in the 128-aligned group layout
      (group g from column ``128 * tile_starts[g]``, zeros up to the next group and past the last), every column
      written by the kernel, and st sized for that many tokens (``ops.shapes.colwise_shapes`` with
      ``token_align=128``), zero-filled.
    * ``blocks_2d`` (``scale_block=128``, one launch, no groups): each 128 x 128 tile of x's last two dims shares
      one scale (``formats.quantize_mxfp8(..., blocks_2d=True)``, the fast mode's 128 x 128 weight blocks).
    * ``gate_up`` (``scale_block=128``, one launch, no groups; any direction): ``fn(w1, w3, q, s, qt, st, ...)``,
      the cast of W13 = [w1; w3] (E, 2I, K) read from w1 and w3 (E, I, K) with I % 128 == 0 (no packed copy);
      outputs as above for 2I rows (the unused direction's slots take placeholders).
    * ``keep_run`` (``scale_block=128``, one launch): the CTA keeps its run's input tiles in registers between the
      reducing and the casting walk instead of reloading them (the same bytes; what the ops run for bf16 inputs,
      ``ops.cute_kernels.TILE_KEEP_RUN``).
    * ``packed_stores`` (the tile kernels; the 32-block rowwise kernel ignores it): the fp8 outputs stored as packed
      words, full 32-row blocks without per-row checks (:class:`TileQuantKernel`; the default stores' bytes, what
      the ops build unless ``CUTE_MXFP8_PACKED_STORES=0``: ``ops.cute_kernels.PACKED_STORES``).

    With ``keep_ptx`` the function is built for inspection only (its ``__ptx__`` holds the PTX).
    """
    if in_dtype not in _IN_DTYPES:
        raise ValueError(f"in_dtype must be one of {_IN_DTYPES}, got {in_dtype!r}")
    if direction not in ("rowwise", "colwise", "dual"):
        raise ValueError(f"direction must be rowwise, colwise or dual, got {direction!r}")
    if pad_groups and (direction == "rowwise" or not grouped):
        raise ValueError("pad_groups is a layout of the colwise output of token groups: colwise or dual with "
                         "grouped=True")
    cutlass, cute = _cutlass()
    x_dtype = _hp_dtype(in_dtype)
    fake, sym = _fake, _sym
    i32 = fake(cutlass.Int32, (sym(),))

    k = cute.sym_int(divisibility=32)
    if blocks_2d and (scale_block != 128 or phase != "cast" or grouped):
        raise ValueError("blocks_2d is the one-launch (phase 'cast') scale_block=128 cast of weights (no groups)")
    for name, flag in (("keep_run", keep_run), ("gate_up", gate_up)):  # (checked before the 32-block rowwise kernel)
        if type(flag) is not bool or (flag and (scale_block != 128 or phase != "cast")):
            raise ValueError(f"{name} (a bool) belongs to the one-launch (phase 'cast') scale_block=128 cast, got "
                             f"{name}={flag!r} with scale_block={scale_block!r}, phase={phase!r}")
    if direction == "rowwise" and not batched and scale_block == 32:
        from .kernels.quantize import GroupedRowwiseQuantKernel, RowwiseQuantKernel

        if grouped and not blocked:
            raise ValueError("grouped rowwise scales are only defined blocked (plain scales ignore groups)")
        kernel = GroupedRowwiseQuantKernel(elem, scale_mode) if grouped else RowwiseQuantKernel(elem, scale_mode,
                                                                                             blocked)
        m = cute.sym_int()
        x, q = fake(x_dtype, (m, k)), fake(kernel.elem_dtype, (m, k))
        s = fake(cutlass.Uint8, (cute.sym_int(),) if blocked else (m, cute.sym_int()))
        return _compile(kernel, (x, q, s, i32, i32) if grouped else (x, q, s), arch, keep_ptx)

    from .kernels.quantize_tile import TileQuantKernel

    if batched and grouped:
        raise ValueError("3-D (batched) inputs take no token groups")
    kernel = TileQuantKernel(elem, scale_mode, blocked, rowwise=direction != "colwise",
                             colwise=direction != "rowwise", grouped=grouped, scale_block=scale_block, phase=phase,
                             pad_groups=pad_groups, blocks_2d=blocks_2d, keep_run=keep_run, gate_up=gate_up,
                             packed_stores=packed_stores)
    # Every tensor gets its own symbols: the kernel takes its shapes from x, and an unused output slot may hold
    # another tensor (TVM-FFI checks that tensors sharing a symbol agree in that dimension).
    x = fake(x_dtype, (sym(), sym(), k))
    q = fake(kernel.elem_dtype, (sym(), sym(), sym(32)))
    qt = fake(kernel.elem_dtype, (sym(), sym(32), sym(1 if grouped and not pad_groups else 32)))
    inputs = (x,)
    if gate_up:  # w1 and w3 share one (E, I, K) with I % 128 == 0 (checked at the call), so no run holds both
        wshape = (sym(), sym(128), k)
        inputs = (fake(x_dtype, wshape), fake(x_dtype, wshape))
    return _compile(kernel.launch_gate_up if gate_up else kernel.launch,
                    (*inputs, q, _tile_scales(blocked), qt, _tile_scales(blocked), i32,
                     fake(cutlass.Int32, (sym(),)), *_amax_buffers()), arch, keep_ptx)


def _amax_buffers():
    """Fake (amax_rows, amax_cols) of the tile kernels: int32 (E, rows, cols) each."""
    cutlass, _ = _cutlass()
    return tuple(_fake(cutlass.Int32, (_sym(), _sym(), _sym())) for _ in range(2))


@memory_cached
@disk_cached(skip_if="keep_ptx")
def compile_swiglu_quant(direction: str, in_dtype: str, elem: str, scale_mode: str, blocked: bool, arch: str,
                         keep_ptx: bool = False, grouped: bool = False, emit_hp: bool = False,
                         scale_block: int = 32, phase: str = "cast", h13_dtype: str | None = None,
                         pad_groups: bool = False, persistent_ctas: int = 0, packed_stores: bool = True):
    """Compiled fused SwiGLU + dual MXFP8 cast (:class:`~cute_mxfp8.kernels.quantize_tile.SwiGLUQuantKernel`).

    ``direction="fwd"``: ``fn(h13, q, s, qt, st, hp, offs, tile_starts)`` with h13 (1, M, 2I) ``in_dtype``,
    q (1, M, I) fp8, qt (1, I, Mp) fp8 (grouped: (1, I, M)), hp (1, M, I) ``in_dtype`` (``emit_hp``; else a
    placeholder).
    ``direction="bwd"``: ``fn(dh, h13, q, s, qt, st, hp, offs, tile_starts)`` with dh (1, M, I), h13 (1, M, 2I),
    q (1, M, 2I), qt (1, 2I, Mp), hp (1, M, 2I).  Scales, groups and the trailing ``amax_rows``, ``amax_cols``
    (``scale_block=128``'s two-launch form) as :func:`compile_quant`'s tile kernels.  ``h13_dtype`` (backward; default
    ``in_dtype``, which is dh's and hp's): h13's dtype when it differs from dh's (an fp32 GEMM output dh beside the
    saved bf16 h13); such builds run one row block per CTA (the staged loop stages every operand in dh's dtype).
    ``pad_groups``: qt in the 128-aligned group layout, as :func:`compile_quant`'s.  ``scale_block=128`` with
    ``phase="cast"``: the one-launch *resident* form (512-thread CTAs holding a 128-row run in registers; the
    trailing amax arguments are placeholders); its backward needs I % 128 == 0 (not checked here: the ops run the
    two-launch form otherwise).  ``persistent_ctas`` (> 0, with the resident form and bf16 inputs): that many CTAs
    walk its runs, prefetching the next run's input into shared memory while the current one is cast (one per SM).
    ``packed_stores``: as :func:`compile_quant`'s.
    """
    h13_dtype = in_dtype if h13_dtype is None else h13_dtype
    for name, value in (("in_dtype", in_dtype), ("h13_dtype", h13_dtype)):
        if value not in _IN_DTYPES:
            raise ValueError(f"{name} must be one of {_IN_DTYPES}, got {value!r}")
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    if direction == "fwd" and h13_dtype != in_dtype:
        raise ValueError("h13_dtype is the backward's: the forward's input is h13 itself (in_dtype)")
    if persistent_ctas and (in_dtype != "bfloat16" or h13_dtype != in_dtype):
        raise ValueError(f"persistent_ctas prefetches bf16 inputs (two buffers of fp32 tiles would take more shared "
                         f"memory than an SM has): in_dtype and h13_dtype must be 'bfloat16', got {in_dtype!r}, "
                         f"{h13_dtype!r}")
    cutlass, cute = _cutlass()

    from .kernels.quantize_tile import SwiGLUQuantKernel

    mixed = h13_dtype != in_dtype
    kernel = SwiGLUQuantKernel("swiglu" if direction == "fwd" else "dswiglu", elem, scale_mode, blocked, grouped,
                               emit_hp, row_tiles=1 if mixed else None, scale_block=scale_block, phase=phase,
                               pad_groups=pad_groups, persistent_ctas=persistent_ctas, packed_stores=packed_stores)
    x_dtype, h_dtype = _hp_dtype(in_dtype), _hp_dtype(h13_dtype)

    fake, sym = _fake, _sym
    scales = functools.partial(_tile_scales, blocked)
    h13 = fake(h_dtype, (sym(), sym(), sym(64)))
    q = fake(kernel.elem_dtype, (sym(), sym(), sym(32)))
    qt = fake(kernel.elem_dtype, (sym(), sym(32), sym(1 if grouped and not pad_groups else 32)))
    hp = fake(x_dtype, (sym(), sym(), sym(32)))
    groups = (fake(cutlass.Int32, (sym(),)), fake(cutlass.Int32, (sym(),)))
    if direction == "fwd":
        return _compile(kernel.launch_fwd, (h13, q, scales(), qt, scales(), hp, *groups, *_amax_buffers()), arch,
                        keep_ptx)
    dh = fake(x_dtype, (sym(), sym(), sym(32)))
    return _compile(kernel.launch_bwd, (dh, h13, q, scales(), qt, scales(), hp, *groups, *_amax_buffers()), arch,
                    keep_ptx)


def _fused_outputs(cutlass, h13_dtype, q_dtype, grouped: bool) -> tuple:
    """Fake (h13, q, qs, qt, qts, hp) of a GEMM-fused SwiGLU / dSwiGLU epilogue build (either arch): h13 with
    whole 128-column tiles, q / hp rows of 32-blocks, qt (n, M rounded to 32) or (n, T) unpadded with token
    groups, scales flat bytes."""
    fake, sym = _fake, _sym
    return (fake(h13_dtype, (sym(), sym(128))), fake(q_dtype, (sym(), sym(32))), fake(cutlass.Uint8, (sym(),)),
            fake(q_dtype, (sym(32), sym() if grouped else sym(32))), fake(cutlass.Uint8, (sym(),)),
            fake(cutlass.Float32, (sym(), sym(32))))


# Blackwell datacenter targets of the tcgen05 kernels: sm_100f, the family build (compute capability 10.0 and
# 10.3: B200/GB200 and B300/GB300), which the sm100 backend loads; sm_100a and sm_103a, one capability each
SM100_TARGET = "sm_100f"
SM100_ARCHS = (SM100_TARGET, "sm_100a", "sm_103a")


@memory_cached
@disk_cached(skip_if="keep_ptx")
def compile_gemm_sm100(a_elem: str, b_elem: str, out_dtype: str = "bfloat16", n_tile: int = 128,
                       arch: str = SM100_TARGET, keep_ptx: bool = False, max_ctas: int = 148,
                       epilogue: str = "plain",
                       cast_elem: str = "e4m3", scale_mode: str = "rceil", emit_hp: bool = False,
                       cta_pair: bool = False, cluster_mn: tuple = (1, 1), grouping: str = "none"):
    """Compiled SM100 MXFP8 GEMM (:class:`~cute_mxfp8.kernels.gemm_sm100.MXGemmSm100`), a (M, K) and b (N, K)
    fp8 (``a_elem`` / ``b_elem``) K-major, sfa / sfb their 1-D blocked E8M0 scale buffers (uint8 view, 16-byte
    aligned).  ``max_ctas`` bounds the persistent grid (148: the SMs of a B200); ``cta_pair`` selects the 2-CTA
    (M = 256) MMA and ``cluster_mn`` the cluster (TMA multicast beyond the MMA's CTAs; ``gemm_sm100.CLUSTERS``).
    By ``epilogue``:

    * ``"plain"``: ``fn(a, b, sfa, sfb, d)``, d (M, N) ``out_dtype`` row-major.
    * ``"swiglu"`` (N = 2I, b in the interleaved gate/up layout): ``fn(a, b, sfa, sfb, h13, q, qs, qt, qts, hp)``
      with h13 (M, 2I) ``out_dtype``, h cast to ``cast_elem`` / ``scale_mode``: q (M, I), qt (I, Mp), qs / qts
      blocked uint8 (zero-filled), hp (M, I) fp32 (``emit_hp``; else any placeholder).
    * ``"dswiglu"`` (N = I): same arguments, h13 (M, 2I) ``out_dtype`` read, dh13 cast: q (M, 2I), qt (2I, Mp),
      hp (M, 2I).
    * ``grouping="m"``: the 2d-3d GEMM, the same arguments plus ``offs`` (E,) and ``sched`` (2, E) int32
      (``MXGemmSm100.call_grouped`` / ``call_swiglu_grouped`` / ``call_dswiglu_grouped``): a (T, K), b (E * N, K)
      the experts back to back, sfa grouped-M blocked, sfb (E x blocked) flat; the fused outputs in the grouped
      layouts (qt (I, T) unpadded).
    * ``grouping="k"`` (plain epilogue, 1-CTA MMA, n_tile 128, clusters (1, 1) / (1, 2)): the 2d-2d wgrad
      ``fn(a, b, sfa, sfb, d, offs, sched)``, ``MXGemmSm100.call_wgrad``: a (N, T') and b (K', T') token-major in
      the 32-aligned group layout, grouped-K blocked scales, d (E * N, K'), sched (2, E) (aligned first columns,
      scale tile starts).

    The compiled function trusts its arguments: shapes and scale buffer sizes (``blocked_scales_numel``) are not
    checked against a's, so a caller must check them (the ops layer does, :mod:`cute_mxfp8.ops.gemm_sm100`)."""
    if arch not in SM100_ARCHS:
        raise ValueError(f"the tcgen05 GEMM needs one of the arches {SM100_ARCHS}, got {arch!r}")
    cutlass, _ = _cutlass()
    from .kernels.gemm_sm100 import MXGemmSm100

    kernel = MXGemmSm100(a_elem, b_elem, out_dtype, n_tile, max_ctas, epilogue, cast_elem, scale_mode, emit_hp,
                         cta_pair, tuple(cluster_mn), grouping)
    fake, sym = _fake, _sym

    def scales():  # TMA reads them: the buffer must be 16-byte aligned (fresh blocked buffers are)
        return fake(cutlass.Uint8, (sym(),), align=16)

    d = kernel.d_dtype
    ab = (fake(kernel.a_dtype, (sym(), sym(32))), fake(kernel.b_dtype, (sym(), sym(32))), scales(), scales())
    groups = (fake(cutlass.Int32, (sym(),)), fake(cutlass.Int32, (sym(), sym()))) if grouping != "none" else ()
    if epilogue == "plain":
        entry = {"none": kernel, "m": kernel.call_grouped, "k": kernel.call_wgrad}[grouping]
        return _compile(entry, (*ab, fake(d, (sym(), sym(16 // (d.width // 8)))), *groups), arch, keep_ptx)
    q = kernel.cast.elem_dtype
    fused = _fused_outputs(cutlass, d, q, grouping == "m")
    if grouping == "m":
        entry = kernel.call_swiglu_grouped if epilogue == "swiglu" else kernel.call_dswiglu_grouped
    else:
        entry = kernel.call_swiglu if epilogue == "swiglu" else kernel.call_dswiglu
    return _compile(entry, (*ab, *fused, *groups), arch, keep_ptx)


@memory_cached(typed=True)  # (typed: tma_store=1 is not the validated True)
@disk_cached(skip_if="keep_ptx")
def compile_gemm_sm90(a_elem: str, b_elem: str, out_dtype: str = "bfloat16", mainloop: str = "dequant",
                      arch: str = "sm_90a", keep_ptx: bool = False, transform_warps: int = 8,
                      grouping: str = "none", epilogue: str = "plain", cast_elem: str = "e4m3",
                      scale_mode: str = "rceil", emit_hp: bool = False, max_ctas: int = 132, block_k: int = 32,
                      n_tile: int = 128, cluster_mn: tuple = (1, 1), pingpong: bool = True,
                      split_halves: bool = False, b_block_n: int = 1, consumer_split: str = "n",
                      tma_store: bool = False, split_tail: bool = False):
    """Compiled SM90 MXFP8 GEMM.  ``mainloop``: ``"dequant"``
    (:class:`~cute_mxfp8.kernels.gemm_sm90.MXGemmSm90Dequant`, bf16 WGMMA on scaled operands) or ``"promote"``
    (:class:`~cute_mxfp8.kernels.gemm_sm90.MXGemmSm90`, fp8 WGMMA per block, dense only).

    * ``"promote"``: ``fn(a, b, sfa, sfb, d)``, a (M, K) and b (N, K) fp8 K-major, sfa / sfb their 1-D blocked
      E8M0 scale buffers (uint8 view, 16-byte aligned), d (M, N) ``out_dtype`` row-major; with ``grouping="m"``
      (2d-3d) or ``"k"`` (2d-2d), both ``block_k=128``, ``fn(a, b, sfa, sfb, d, offs, sched)`` as
      ``MXGemmSm90.call_grouped`` takes them.  ``block_k=128``: the
      Hopper fast mode, one promotion per 128 of K (the operands' scales shared by each 128-block); ``n_tile``:
      the output tile's N, 128 or (fast mode) 192; ``cluster_mn``: CTAs per cluster along (M, N), the A tile
      multicast across the N extent and the B tile across the M extent (``MXGemmSm90.CLUSTERS``);
      ``b_block_n=128`` (fast mode, dense or ``"m"``): B's scales shared by 128 x 128 blocks (the weights of
      ``MXFP8Config(hopper_weight_blocks="128x128")``), one FFMA per element and stage; ``consumer_split``
      ``"n"`` (the two consumer warpgroups each all 128 rows x half the columns) or, with ``b_block_n=128``,
      ``"m"`` (each 64 rows x all columns: one m64 x n_tile WGMMA per K step); ``tma_store`` (split M, dense or
      ``"m"``; or split N with ``"k"``; bf16 d with N % 8 == 0): the output tile staged in shared memory and
      TMA-stored, overlapping the next tile's mainloop; ``split_tail`` (fast mode, dense, no cluster):
      ``fn(a, b, sfa, sfb, d, ws, flags, tail, parts)`` as ``MXGemmSm90.call_split`` takes them (the last
      ``tail`` tiles split in ``parts`` along K).
    * ``"dequant"``: ``fn(a, b, sfa, sfb, d, offs, sched)`` with the operands of ``grouping`` as
      ``MXGemmSm90Dequant.__call__`` lists them (``"none"`` dense, ``"m"`` 2d-3d, ``"k"`` 2d-2d); offs (G,) and
      sched (2, G) int32 (placeholders for dense).
    * ``epilogue="swiglu"`` / ``"dswiglu"`` (dequant, dense or ``grouping="m"``): ``fn(a, b, sfa, sfb, h13, q, qs,
      qt, qts, hp, offs, sched)`` with the arguments and outputs of :func:`compile_gemm_sm100`'s fused epilogues
      (h cast to ``cast_elem`` / ``scale_mode``), grouped as ``MXGemmSm90Dequant.call_swiglu`` says.

    ``split_halves`` (promote, ``grouping="k"``): d (G * N, K) holds the (2, G, N / 2, K) layout: each group's
    first N / 2 output rows in half 0, the others in half 1 (``kernels.gemm_sm90.split_half_rows``; N % 256 == 0).

    ``transform_warps`` (dequant only): warps converting B, 4 (384 threads) or 8 (512).  ``max_ctas`` (promote, and
    dequant with the plain epilogue): the persistent grid's CTAs, at most one per SM (132 on an H100 / H200 SXM).  Trusts its arguments (the
    ops layer checks them, :mod:`cute_mxfp8.ops.gemm_sm90`)."""
    if arch != "sm_90a":
        raise ValueError(f"the WGMMA GEMM needs arch sm_90a, got {arch!r}")
    if mainloop not in ("dequant", "promote"):
        raise ValueError(f"mainloop must be 'dequant' or 'promote', got {mainloop!r}")
    cluster_mn = tuple(cluster_mn)
    promote_only = {k: v for k, v, default in (("block_k", block_k, 32), ("n_tile", n_tile, 128),
                                               ("cluster_mn", cluster_mn, (1, 1)), ("b_block_n", b_block_n, 1),
                                               ("consumer_split", consumer_split, "n"), ("tma_store", tma_store, False),
                                               ("split_tail", split_tail, False))
                    if v != default}
    if promote_only and mainloop != "promote":
        raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in promote_only.items())}: options of "
                         f"mainloop='promote' (the dequantize mainloop has block_k 32, n_tile 128, no cluster, 1x32 B "
                         f"scales, split N and per-thread stores), got mainloop={mainloop!r}")
    cutlass, _ = _cutlass()
    from .kernels.gemm_sm90 import MXGemmSm90, MXGemmSm90Dequant

    if mainloop == "promote" and epilogue != "plain":
        raise ValueError(f"the promote mainloop has the plain epilogue only, got {epilogue!r}")
    if split_halves and mainloop != "promote":
        raise ValueError("split_halves is an output layout of the promote mainloop's 2d-2d build (the dequantize "
                         "mainloop's 256-row tiles would straddle the halves)")
    kernel = MXGemmSm90Dequant(a_elem, b_elem, out_dtype, transform_warps, grouping, epilogue, cast_elem,
                               scale_mode, emit_hp, max_ctas) if mainloop == "dequant" else \
        MXGemmSm90(a_elem, b_elem, out_dtype, n_tile, block_k=block_k, max_ctas=max_ctas, cluster_mn=cluster_mn,
                   pingpong=pingpong, grouping=grouping, split_halves=split_halves, b_block_n=b_block_n,
                   consumer_split=consumer_split, tma_store=tma_store, split_tail=split_tail)
    fake, sym = _fake, _sym
    scales = [fake(cutlass.Uint8, (sym(),), align=16) for _ in range(2)]
    kdiv = 16 if grouping == "k" else 32  # 2d-2d: K is the token count, a multiple of 16 (TMA's row pitch)
    args = (fake(kernel.a_dtype, (sym(), sym(kdiv))), fake(kernel.b_dtype, (sym(), sym(kdiv))), *scales,
            fake(kernel.d_dtype, (sym(), sym(8 if tma_store else 1))))  # TMA: 16-byte row pitch
    groups = (fake(cutlass.Int32, (sym(),)), fake(cutlass.Int32, (sym(), sym())))  # offs, sched
    if epilogue != "plain":  # the outputs of compile_gemm_sm100's fused epilogues (qt (n, T) unpadded if grouped)
        q = kernel.cast.elem_dtype
        fused = _fused_outputs(cutlass, kernel.d_dtype, q, grouping == "m")
        entry = kernel.call_swiglu if epilogue == "swiglu" else kernel.call_dswiglu
        return _compile(entry, (*args[:4], *fused, *groups), arch, keep_ptx)
    if mainloop == "dequant":
        args += groups
    elif grouping != "none":  # the fast mode's 2d-3d / 2d-2d builds
        return _compile(kernel.call_grouped, args + groups, arch, keep_ptx)
    elif split_tail:  # workspace (fp32), counters (int32), tail tiles, parts
        split = (fake(cutlass.Float32, (sym(),)), fake(cutlass.Int32, (sym(),)), cutlass.Int32(1), cutlass.Int32(2))
        return _compile(kernel.call_split, args + split, arch, keep_ptx)
    return _compile(kernel, args, arch, keep_ptx)


@memory_cached
@disk_cached(skip_if="keep_ptx")
def compile_token_align(arch: str, keep_ptx: bool = False):
    """Compiled :class:`~cute_mxfp8.kernels.token_align.TokenAlignKernel`: ``fn(src, dst, offs, ends16)``, src
    (R, T) uint8, dst (R, T') uint8 with T' % 16 == 0 (16-byte aligned rows), offs / ends16 (G,) int32.
    Arch-generic code; ``arch`` is the build target."""
    if arch not in ("sm_90a", *SM100_ARCHS):
        raise ValueError(f"arch must be 'sm_90a' or one of {SM100_ARCHS}, got {arch!r}")
    cutlass, _ = _cutlass()
    from .kernels.token_align import TokenAlignKernel

    fake, sym = _fake, _sym
    args = (fake(cutlass.Uint8, (sym(), sym()), align=1), fake(cutlass.Uint8, (sym(), sym(16)), align=16),
            fake(cutlass.Int32, (sym(),)), fake(cutlass.Int32, (sym(),)))
    return _compile(TokenAlignKernel(), args, arch, keep_ptx)


@memory_cached
@disk_cached(skip_if="keep_ptx")
def compile_fast_schedules(arch: str, keep_ptx: bool = False):
    """Compiled :class:`~cute_mxfp8.kernels.group_schedule.FastScheduleKernel`: ``fn(offs, tile_starts, sched_m,
    ends, sched_k)``, int32: offs, tile_starts and ends (G,), sched_m and sched_k (2, G), G >= 1 (any views).
    Arch-generic code; ``arch`` is the build target."""
    if arch not in ("sm_90a", *SM100_ARCHS):
        raise ValueError(f"arch must be 'sm_90a' or one of {SM100_ARCHS}, got {arch!r}")
    cutlass, _ = _cutlass()
    from .kernels.group_schedule import FastScheduleKernel

    one, two = (lambda: _fake(cutlass.Int32, (_sym(),))), (lambda: _fake(cutlass.Int32, (2, _sym())))
    args = (one(), one(), two(), one(), two())
    return _compile(FastScheduleKernel(), args, arch, keep_ptx)


@memory_cached
@disk_cached(skip_if="keep_ptx")
def compile_epilogue_check(mode: str, h13_dtype: str, elem: str, scale_mode: str, emit_hp: bool, arch: str,
                           keep_ptx: bool = False):
    """Compiled :class:`~cute_mxfp8.kernels.gemm_checks.EpilogueCheckKernel`: the SM100 GEMM's fused epilogue
    code fed from a global fp32 accumulator, for checking that code on any GPU.  ``fn(acc, h13, q, qs, qt, qts,
    hp)``: acc fp32 (M, 2I) (``"swiglu"``) or (M, I) (``"dswiglu"``); h13 (M, 2I) ``h13_dtype`` (read by
    dswiglu); q (M, n) fp8, qt (n, Mp) fp8 and hp (M, n) fp32 with n = I (swiglu) or 2I (dswiglu);
    qs / qts 1-D blocked uint8, zero-filled."""
    if h13_dtype not in _IN_DTYPES:
        raise ValueError(f"h13_dtype must be one of {_IN_DTYPES}, got {h13_dtype!r}")
    cutlass, _ = _cutlass()
    from .kernels.gemm_checks import EpilogueCheckKernel

    kernel = EpilogueCheckKernel(mode, elem, scale_mode, emit_hp)
    h13 = _hp_dtype(h13_dtype)
    fake, sym = _fake, _sym
    args = (fake(cutlass.Float32, (sym(), sym(32))), fake(h13, (sym(), sym(64))),
            fake(kernel.elem_dtype, (sym(), sym(32))), fake(cutlass.Uint8, (sym(),)),
            fake(kernel.elem_dtype, (sym(32), sym(32))), fake(cutlass.Uint8, (sym(),)),
            fake(cutlass.Float32, (sym(), sym(32))))
    return _compile(kernel, args, arch, keep_ptx)


@memory_cached
@disk_cached(skip_if="keep_ptx")
def compile_scale_layout_probe(arch: str, keep_ptx: bool = False):
    """Compiled :class:`~cute_mxfp8.kernels.gemm_checks.ScaleLayoutProbe`: ``fn(buf, plain)``, buf the 1-D
    blocked uint8 scales of a (rows, K) operand, plain (rows, K / 32) uint8 (written)."""
    cutlass, _ = _cutlass()
    from .kernels.gemm_checks import ScaleLayoutProbe

    fake, sym = _fake, _sym
    return _compile(ScaleLayoutProbe(), (fake(cutlass.Uint8, (sym(),)), fake(cutlass.Uint8, (sym(), sym()))), arch,
                    keep_ptx)


@memory_cached
@disk_cached(skip_if="keep_ptx")
def compile_tile_schedule_probe(n_tile: int, max_ctas: int, arch: str, keep_ptx: bool = False,
                                cluster_mn: tuple = (1, 1)):
    """Compiled :class:`~cute_mxfp8.kernels.gemm_checks.TileScheduleProbe`: ``fn(count, order, m, n)``, count
    and order (ceil(M / 128), ceil(N / n_tile)) int32, count zero-filled (incremented per visit), order the
    cluster-tile index of the (last) visit."""
    cutlass, _ = _cutlass()
    from .kernels.gemm_checks import TileScheduleProbe

    count, order = (_fake(cutlass.Int32, (_sym(), _sym()), align=4) for _ in range(2))
    return _compile(TileScheduleProbe(n_tile, max_ctas, tuple(cluster_mn)),
                    (count, order, cutlass.Int32(1), cutlass.Int32(1)), arch, keep_ptx)
