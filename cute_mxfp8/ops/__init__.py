"""Custom ops, backends and autograd functions (the only layer that knows about backends).

Importing this package registers the ``cute_mxfp8`` torch.library ops and the ``reference``, ``sm90`` and ``sm100``
backends (the CuTe DSL itself is imported only when a kernel is first compiled).
"""

from . import cute_kernels as _cute_kernels  # noqa: F401  (registers the sm90 / sm100 backends)
from . import reference as _reference  # noqa: F401  (registers the reference backend)
from .api import (  # noqa: F401
    dswiglu_quant,
    grouped_mm,
    grouped_mm_wgrad,
    mm,
    mm_dswiglu_quant,
    mm_swiglu_quant,
    padded_offsets,
    quantize_colwise,
    quantize_dual,
    quantize_gate_up,
    quantize_rowwise,
    swiglu_quant,
)
from .autograd import mxfp8_grouped_mm, mxfp8_linear, mxfp8_swiglu_mlp, mxfp8_swiglu_mlp_packed  # noqa: F401
from .backends import (  # noqa: F401
    ENV_VAR,
    BackendUnavailableError,
    register_backend,
    registered_backends,
    resolve_backend,
)
