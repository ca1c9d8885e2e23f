"""Drop-in MXFP8 modules and the model converter."""

from ..config import MXFP8Config  # noqa: F401
from .convert import ConversionReport, convert_to_mxfp8  # noqa: F401
from .modules import MXFP8GroupedExperts, MXFP8Linear, MXFP8SwiGLUMLP  # noqa: F401
from .weight import MXFP8TrainingWeight, quantize_weights_  # noqa: F401
