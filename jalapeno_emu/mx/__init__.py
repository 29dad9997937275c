"""OCP Microscaling (MX v1.0) numerics, bit-exact: formats, quantise, pack, matmul, error stats.

Stage: numerics, the bottom of the pipeline; the matrix unit, the kernels and the numerics
reports all call into this package. Public names are re-exported here, one per line.
"""

from jalapeno_emu.mx.array import MXArray as MXArray
from jalapeno_emu.mx.formats import FORMATS as FORMATS
from jalapeno_emu.mx.formats import ElementFormat as ElementFormat
from jalapeno_emu.mx.formats import element_format as element_format
from jalapeno_emu.mx.matmul import block_sum_is_exact_in_f32 as block_sum_is_exact_in_f32
from jalapeno_emu.mx.matmul import matmul as matmul
from jalapeno_emu.mx.matmul import matmul_accumulate as matmul_accumulate
from jalapeno_emu.mx.pack import from_gpt_oss as from_gpt_oss
from jalapeno_emu.mx.pack import pack_fp4 as pack_fp4
from jalapeno_emu.mx.pack import unpack_fp4 as unpack_fp4
from jalapeno_emu.mx.quantize import ROUNDINGS as ROUNDINGS
from jalapeno_emu.mx.quantize import dequantize as dequantize
from jalapeno_emu.mx.quantize import quantize as quantize
from jalapeno_emu.mx.scale import SCALE_MODES as SCALE_MODES
from jalapeno_emu.mx.stats import ErrorStats as ErrorStats
from jalapeno_emu.mx.stats import error_stats as error_stats

__all__ = [
    "FORMATS",
    "ROUNDINGS",
    "SCALE_MODES",
    "ElementFormat",
    "ErrorStats",
    "MXArray",
    "block_sum_is_exact_in_f32",
    "dequantize",
    "element_format",
    "error_stats",
    "from_gpt_oss",
    "matmul",
    "matmul_accumulate",
    "pack_fp4",
    "quantize",
    "unpack_fp4",
]
