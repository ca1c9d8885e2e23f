"""torchtitan (0.3.0) on the MXFP8 SwiGLU MLP, through torchtitan's own override mechanism.

torchtitan builds models from config trees; ``@override`` factories replace a ``Config`` class before the model is
built.  This module registers two, importable by name::

    --override.imports cute_mxfp8.integrations.torchtitan.mxfp8_feed_forward,cute_mxfp8.integrations.torchtitan.mxfp8_grouped_experts

* :func:`mxfp8_feed_forward`: every ``FeedForward`` becomes :class:`MXFP8FeedForward` (dense SwiGLU MLP as one
  MXFP8 autograd function, :func:`cute_mxfp8.ops.mxfp8_swiglu_mlp`);
* :func:`mxfp8_grouped_experts`: every stock ``GroupedExperts`` becomes :class:`MXFP8GroupedExperts` (2d-3d
  grouped GEMMs forward and dgrad, 2d-2d wgrad).

Or, in a Python trainer config, torchtitan's model-converter form (the one its own float8 / MX converters use)::

    from cute_mxfp8.integrations.torchtitan import MXFP8Converter
    config.model_spec = model_registry("debugmodel", converters=[MXFP8Converter.Config()])

:class:`MXFP8Converter` rewrites the same two ``Config`` types in the model config tree (``fqns`` narrows it to
module names containing one of the strings, ``mxfp8`` carries the settings); it is a torchtitan
``QuantizationConverter``, so torchtitan checks it is listed before a LoRA converter.

The replacements are subclasses of torchtitan's modules with only ``forward`` changed: same parameters
(``w1``/``w2``/``w3`` torchtitan Linears; ``w1_EFD``/``w2_EDF``/``w3_EFD``), so they satisfy torchtitan's Module
protocol, keep ``param_init`` / ``init_states`` (meta-device build, then init), ``sharding_config`` and the
checkpoint layout.  Their MXFP8 settings are ``Config.mxfp8`` (an :class:`~cute_mxfp8.MXFP8Config`, default
``MXFP8Config()``).  Dims must be multiples of 32 (the ops raise ValueError naming the dim otherwise).

Importing this module without torchtitan works; the names below then raise ImportError when used.  (Converting an
already-built model with :func:`cute_mxfp8.convert_to_mxfp8` also works, after ``init_states``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import logging

from ..config import MXFP8Config, resolve_config
from ..nn.modules import device_offsets_from_counts
from ..ops.autograd import mxfp8_swiglu_mlp

__all__ = ["MXFP8Converter", "MXFP8FeedForward", "MXFP8GroupedExperts", "mxfp8_feed_forward",
           "mxfp8_grouped_experts"]

try:
    import torch
    from torch.distributed.tensor import DTensor
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.config import derive, override
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.moe import GroupedExperts
except ImportError as _exc:  # torchtitan (or its triton dependency) not installed
    _MISSING: ImportError | None = _exc
else:
    _MISSING = None


_log = logging.getLogger(__name__)


def _local(t):
    """The plain weight: FSDP2's unsharded parameters are plain or replicated; a weight still sharded at forward
    time is tensor parallelism, which these forwards do not implement (they never call the Linears' own
    forward, where torchtitan's TP redistributes)."""
    if isinstance(t, DTensor):
        if any(not p.is_replicate() for p in t.placements):
            raise NotImplementedError(
                f"cute_mxfp8's torchtitan FFN / experts got a weight sharded as {t.placements} at forward time "
                f"(tensor or expert parallelism), which they do not support yet: run without TP/EP, or leave "
                f"these modules unconverted")
        return t.to_local()
    return t


if _MISSING is None:

    class MXFP8FeedForward(FeedForward):
        """torchtitan's ``FeedForward`` with ``forward(x) = w2(silu(w1(x)) * w3(x))`` in MXFP8 (one autograd
        function: fused W13 GEMM + SwiGLU + dual quantization).  x (..., D) bf16/fp32 -> same shape and dtype."""

        @dataclass(kw_only=True, slots=True)
        class Config(FeedForward.Config):
            mxfp8: MXFP8Config | None = None

        def __init__(self, config: Config):
            super().__init__(config)
            self.mxfp8_config = resolve_config(config.mxfp8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return mxfp8_swiglu_mlp(x, _local(self.w1.weight), _local(self.w2.weight), _local(self.w3.weight), None,
                                    self.mxfp8_config)

    class MXFP8GroupedExperts(GroupedExperts):
        """torchtitan's ``GroupedExperts`` with ``forward(x_RD, num_tokens_per_expert_E)`` in MXFP8: rows of x
        sorted by expert, counts (E,) of an integer dtype (moved to x's device first if elsewhere), made into
        offsets on that device and never read on the host by the GPU backends (no device sync: negative counts
        count as 0 and the groups end at R, :func:`cute_mxfp8.nn.modules.device_offsets_from_counts`; the
        ``reference`` backend reads them); rows past the counts' sum give zeros.
        Returns (R, D) in x's dtype."""

        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            mxfp8: MXFP8Config | None = None

        def __init__(self, config: Config):
            super().__init__(config)
            self.mxfp8_config = resolve_config(config.mxfp8)

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            w1, w2, w3 = _local(self.w1_EFD), _local(self.w2_EDF), _local(self.w3_EFD)
            # made on the device and safe by construction: the grouped ops take them without a host read
            offs = device_offsets_from_counts(num_tokens_per_expert_E.to(x_RD.device), w1.shape[0], x_RD.shape[0])
            return mxfp8_swiglu_mlp(x_RD, w1, w2, w3, offs, self.mxfp8_config)

    @override(target=FeedForward.Config, description="cute_mxfp8: the SwiGLU FFN in MXFP8 (fused MLP function)")
    def mxfp8_feed_forward(cfg: FeedForward.Config) -> FeedForward.Config:
        """``FeedForward.Config`` -> :class:`MXFP8FeedForward.Config` (every field kept); other FFN configs
        (subclasses with their own forward, e.g. ``SigmoidGatedFeedForward``) are returned unchanged."""
        if type(cfg) is not FeedForward.Config:
            return cfg
        return derive(cfg, MXFP8FeedForward.Config)

    @override(target=GroupedExperts.Config, description="cute_mxfp8: routed experts in MXFP8 (grouped GEMMs)")
    def mxfp8_grouped_experts(cfg: GroupedExperts.Config) -> GroupedExperts.Config:
        """Stock ``GroupedExperts.Config`` -> :class:`MXFP8GroupedExperts.Config` (every field kept); subclasses
        (other experts math) are returned unchanged."""
        if type(cfg) is not GroupedExperts.Config:
            return cfg
        return derive(cfg, MXFP8GroupedExperts.Config)

    class MXFP8Converter(QuantizationConverter):
        """torchtitan model converter (0.3.0 ``ModelConfigConverter`` API): before the model is built, every stock
        ``FeedForward.Config`` becomes :class:`MXFP8FeedForward.Config` and every stock ``GroupedExperts.Config``
        :class:`MXFP8GroupedExperts.Config`, all other fields kept (``param_init`` included).

        Config fields: ``fqns`` (module names; a config is converted when its name contains one of them, all when
        empty), ``feed_forward`` / ``experts`` (which kinds to convert, both by default), ``mxfp8`` (the
        :class:`~cute_mxfp8.MXFP8Config` the converted modules use; ``None`` = defaults).  ``convert`` changes the
        tree in place and returns it (a new config object only when the root config itself is a stock FFN /
        experts config, which has no parent to change); ``converted`` lists the names it changed, accumulated over
        the converter's calls (empty means nothing matched, which is logged, not raised: torchtitan applies
        converters to every model flavor alike)."""

        @dataclass(kw_only=True, slots=True)
        class Config(QuantizationConverter.Config):
            fqns: list[str] = field(default_factory=list)
            feed_forward: bool = True
            experts: bool = True
            mxfp8: MXFP8Config | None = None

        def __init__(self, config: Config):
            fqns = config.fqns
            if not isinstance(fqns, (list, tuple)) or not all(isinstance(f, str) for f in fqns):
                raise TypeError(f"MXFP8Converter.Config.fqns must be a list of str (module-name parts), got "
                                f"{fqns!r}" + (f": write [{fqns!r}]" if isinstance(fqns, str) else ""))
            for name in ("feed_forward", "experts"):
                if not isinstance(getattr(config, name), bool):
                    raise TypeError(f"MXFP8Converter.Config.{name} must be a bool, got {getattr(config, name)!r}")
            if config.mxfp8 is not None and not isinstance(config.mxfp8, MXFP8Config):
                raise TypeError(f"MXFP8Converter.Config.mxfp8 must be a cute_mxfp8.MXFP8Config or None, got "
                                f"{config.mxfp8!r}")
            self.config = config
            self.converted: list[str] = []

        def convert(self, model_config):
            c = self.config
            kinds = [(FeedForward.Config, MXFP8FeedForward.Config)] if c.feed_forward else []
            kinds += [(GroupedExperts.Config, MXFP8GroupedExperts.Config)] if c.experts else []
            for stock_cls, mx_cls in kinds:
                for fqn, cfg, parent, attr in list(model_config.traverse(stock_cls)):
                    if type(cfg) is not stock_cls or (c.fqns and not any(f in fqn for f in c.fqns)):
                        continue
                    new = derive(cfg, mx_cls, mxfp8=c.mxfp8)
                    if parent is None:
                        model_config = new
                    elif isinstance(parent, list):
                        parent[attr] = new
                    else:
                        setattr(parent, attr, new)
                    self.converted.append(fqn)
            _log.info("cute_mxfp8: %d FFN / experts configs converted to MXFP8", len(self.converted))
            return model_config

else:

    def __getattr__(name: str):
        if name in __all__:
            raise ImportError(f"cute_mxfp8.integrations.torchtitan.{name} needs torchtitan 0.3 (and triton, which "
                              f"its MoE module imports): pip install torchtitan==0.3.0 triton") from _MISSING
        raise AttributeError(name)
