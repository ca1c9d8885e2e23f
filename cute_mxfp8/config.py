"""User-facing training configuration for the MXFP8 autograd functions and modules."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import ELEM_DTYPES, SCALE_MODES


@dataclass(frozen=True)
class MXFP8Config:
    """How the MXFP8 layers quantize (frozen: ``dataclasses.replace`` makes a changed copy).

    Raises ValueError at construction for any field outside the values below, a value of the wrong type included
    (``wgrad_with_hp=1``, ``backend=""``), naming the field.  A ``backend`` string is checked against the
    registered backends later, where a layer, :func:`~cute_mxfp8.convert_to_mxfp8` or
    :func:`~cute_mxfp8.quantize_weights_` takes the config (a backend may be registered after the config is made).

    Attributes:
        scale_mode: ``"rceil"`` (default; cuBLAS / TransformerEngine) or ``"floor"`` (OCP MX v1.0).
        elem_dtype: element dtype of activations and weights (``torch.float8_e4m3fn`` default, or e5m2).
        grad_elem_dtype: element dtype of output gradients in backward (e4m3 default, as torchao's MX recipe;
            ``torch.float8_e5m2`` trades precision for range).
        wgrad_with_hp: compute weight gradients in high precision from saved bf16/fp32 tensors instead of
            MXFP8 (costs memory for the saved activations; the two other GEMMs stay MXFP8).
        backend: force one backend (``"reference"``, ``"sm90"``, ``"sm100"``, or one added with
            ``ops.register_backend``); None chooses by device.  The MXFP8 layers, ``convert_to_mxfp8`` and
            ``quantize_weights_`` refuse an unregistered name when they are made (ValueError).
        fused_epilogues: how the SwiGLU MLP runs GEMM1 and the w2 dgrad GEMM: True, with their SwiGLU /
            dSwiGLU + dual-quant epilogues fused into the GEMM (``ops.mm_swiglu_quant`` / ``mm_dswiglu_quant``,
            W13 in the interleaved gate/up layout; needs I % 64 == 0, raises ValueError otherwise; with ``offs``
            the grouped fused ops); False, as a GEMM with an fp32 output and the standalone fused SwiGLU kernels;
            None (default), fused when I % 64 == 0 and the backend running the GEMMs fuses by default (``sm90``
            and ``sm100``, dense and grouped).  Both give the same math
            (up to the fp32 summation order of the GEMMs).
        fsdp_mxfp8_all_gather: for weights wrapped by :func:`~cute_mxfp8.quantize_weights_` and sharded by FSDP2
            (``fully_shard``): all-gather MXFP8 data + E8M0 scales instead of the high-precision shards
            (:mod:`cute_mxfp8.nn.fsdp`).  Each rank quantizes its shard in the mixed-precision ``param_dtype``
            (rowwise for the forward, colwise for the backward), so the results equal the high-precision all-gather
            bit for bit while each all-gather moves ~1.03 bytes per weight element instead of 2 (bf16) or 4 (fp32).
            Needs each rank's shard of dim 0 to be a whole number of 32-row blocks (2-D weights) or of experts
            (3-D) under FSDP's default ``Shard(0)`` placement; the first all-gather raises ValueError otherwise.
            Eager mode only (torch.compile raises NotImplementedError).  Default False (modules ignore it).
        hopper_block_k: 32 (default: MXFP8 everywhere) or 128, the Hopper fast mode: every GEMM operand is
            quantized along its K dim with one E8M0 scale per 128 elements (the largest of the four MX scales;
            stored as MXFP8, the 4 scales repeated; a token group's runs start at the group's start), and the
            ``sm90`` backend runs the GEMMs with fp8 WGMMA and one promotion per 128 of K.  The elements equal
            MXFP8's shifted by the scale ratio, except those that fall into the element type's subnormal range
            (rounded there; a data-dependent share: 8e-6 to 4e-4 of the elements measured on Gaussian, Student-t
            and 1 % outlier-channel data, 1.4e-3 with 1 % of channels 100x larger) and, in floor mode, elements
            MXFP8 saturated (~5e-3 on Gaussian data).
            The ``reference`` backend computes the same numerics; the ``sm100`` backend ignores the option (plain
            MXFP8: Blackwell's MMA applies every scale).  With it the SwiGLU MLP runs unfused (the GEMM-fused
            epilogues emit 32-blocks; ``fused_epilogues=True`` with it raises ValueError here) and needs I % 128 == 0
            (the modules raise ValueError; :func:`~cute_mxfp8.convert_to_mxfp8` leaves such FFNs unfused and
            converts their Linears); its GEMM1 and w2 dgrad write the activation dtype, so ``h = silu(g) · u`` and
            the dSwiGLU take g, u and dh rounded to it (bf16 for a bf16 model, as bf16 autograd has them; the
            exact mode takes them from the fp32 accumulators); the grouped GEMMs (2d-3d, 2d-2d) run the fast mode's
            kernels too.  Not combined with ``fsdp_mxfp8_all_gather`` (ValueError).
        hopper_weight_blocks: with ``hopper_block_k=128``, the weights' scale blocks: ``"1x128"`` (default; 128
            along K, as the activations) or ``"128x128"``: each 128 x 128 tile of a weight (of each expert) shares one
            E8M0 scale, the largest of its 1x128 scales (DeepSeek-V3's weight blocks, cuBLAS's blockwise
            1x128 x 128x128 fp8).  The forward and dgrad GEMMs then apply one scalar weight scale per block and
            stage (one FFMA per output element per 128 of K instead of two: dense GEMMs 1.2-1.25x faster than
            with 1x128 weights on the H200, docs/sm90_gemm.md), and the forward and dgrad operands hold the same
            elements.
            The weights lose more low bits than with 1x128 blocks: an element whose 128-row tile has a larger
            scale than its own row's is shifted further and rounds into e4m3's subnormal range sooner (the share
            is data-dependent; ``formats.quantize_mxfp8(..., blocks_2d=True)`` computes it).  Activations,
            gradients and the wgrad GEMMs are unchanged; the ``sm100`` backend ignores it like
            ``hopper_block_k``.  ValueError without ``hopper_block_k=128``.
    """

    scale_mode: str = "rceil"
    elem_dtype: torch.dtype = torch.float8_e4m3fn
    grad_elem_dtype: torch.dtype = torch.float8_e4m3fn
    wgrad_with_hp: bool = False
    backend: str | None = None
    fused_epilogues: bool | None = None
    fsdp_mxfp8_all_gather: bool = False
    hopper_block_k: int = 32
    hopper_weight_blocks: str = "1x128"

    def __post_init__(self):
        if type(self.hopper_block_k) is not int or self.hopper_block_k not in (32, 128):
            raise ValueError(f"hopper_block_k must be 32 (MXFP8) or 128 (the Hopper fast mode), got "
                             f"{self.hopper_block_k!r}")
        if self.hopper_weight_blocks not in ("1x128", "128x128") or (
                self.hopper_weight_blocks == "128x128" and self.hopper_block_k != 128):
            raise ValueError(f"hopper_weight_blocks must be '1x128' (default), or '128x128' with hopper_block_k=128 "
                             f"(the Hopper fast mode's 128 x 128 weight blocks), got {self.hopper_weight_blocks!r} "
                             f"with hopper_block_k={self.hopper_block_k!r}")
        if self.hopper_block_k == 128 and self.fsdp_mxfp8_all_gather:
            raise ValueError("hopper_block_k=128 does not combine with fsdp_mxfp8_all_gather=True yet (the gathered "
                             "shards are quantized in 32-blocks); use one of the two")
        if self.hopper_block_k == 128 and self.fused_epilogues:
            raise ValueError("hopper_block_k=128 does not combine with fused_epilogues=True yet (the GEMM-fused "
                             "epilogues emit 32-element blocks); pass fused_epilogues=None (fused where the fast mode "
                             "does not apply, i.e. on SM100) or False")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")
        if not isinstance(self.wgrad_with_hp, bool):
            raise ValueError(f"wgrad_with_hp must be a bool, got {self.wgrad_with_hp!r}")
        if not isinstance(self.fsdp_mxfp8_all_gather, bool):
            raise ValueError(f"fsdp_mxfp8_all_gather must be a bool, got {self.fsdp_mxfp8_all_gather!r}")
        if self.fused_epilogues is not None and not isinstance(self.fused_epilogues, bool):
            raise ValueError(f"fused_epilogues must be True, False or None, got {self.fused_epilogues!r}")
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise ValueError(f"backend must be a backend name (str) or None (chosen by device; an empty "
                             f"CUTE_MXFP8_BACKEND counts as unset), got {self.backend!r}")
        for name in ("elem_dtype", "grad_elem_dtype"):
            if getattr(self, name) not in ELEM_DTYPES:
                raise ValueError(f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, "
                                 f"got {getattr(self, name)}")


def resolve_config(config) -> MXFP8Config:
    """``config``, or the default :class:`MXFP8Config` for None; TypeError for anything else."""
    if config is not None and not isinstance(config, MXFP8Config):
        raise TypeError(f"config must be a cute_mxfp8.MXFP8Config, got {type(config).__name__}")
    return config or MXFP8Config()
