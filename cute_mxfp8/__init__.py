"""cute_mxfp8: MXFP8 training kernels (CuTe DSL, SM100 / SM90) and the thin PyTorch layer around them.

Layers (each depends only on the ones before it): :mod:`cute_mxfp8.formats` (MX numerics reference),
:mod:`cute_mxfp8.kernels` (CuTe DSL kernels, imported lazily), :mod:`cute_mxfp8.ops` (custom ops, backends,
autograd), :mod:`cute_mxfp8.nn` (drop-in modules, ``convert_to_mxfp8``), :mod:`cute_mxfp8.cli`.
"""

from . import formats  # noqa: F401
from .config import MXFP8Config  # noqa: F401
from .formats import dequantize_mxfp8, quantize_mxfp8  # noqa: F401
from .nn import (  # noqa: F401
    ConversionReport,
    MXFP8GroupedExperts,
    MXFP8Linear,
    MXFP8SwiGLUMLP,
    MXFP8TrainingWeight,
    convert_to_mxfp8,
    quantize_weights_,
)

__version__ = "0.1.0"

# what ``from cute_mxfp8 import *`` brings (not the ``nn`` subpackage, which would shadow ``torch.nn``)
__all__ = ["ConversionReport", "MXFP8Config", "MXFP8GroupedExperts", "MXFP8Linear", "MXFP8SwiGLUMLP",
           "MXFP8TrainingWeight", "convert_to_mxfp8", "dequantize_mxfp8", "formats", "quantize_mxfp8",
           "quantize_weights_"]
