"""Linear weights kept at their quantized size and multiplied as they are stored.

quantized_weight.py     the interface (``QuantizedWeight``) and ``concat_rows``
int4_planes.py          4-8 bit codes in groups of 32: torch's int4 CPU layout, our kernel
int4_tiles_kernel.py    the CPU kernel of the planes (exact, and integer dot with VNNI)
int8_channels.py        int8 per output row (``--quantization int8``, GGUF's Q6_K)
int8_rows_kernel.py     the CPU kernel of int8 rows (integer dot with VNNI)
gguf_blocks.py          a GGUF tensor's blocks read into one of those
checkpoint_format.py    an HF folder's quantization_config: AWQ, GPTQ, fp8 linears read
int4_checkpoints.py     AWQ and GPTQ int32-packed codes into int4 planes (CPU)
fp8_checkpoints.py      fp8 weights and their tensor / channel / block scales, dequantized
grouped_int4_weight.py  AWQ and GPTQ on a GPU, as the checkpoint packs them
fp8_weight.py           fp8 on a GPU, a byte a weight
packed_matmul_triton.py the GPU kernels of those two
"""

from pdserve.model.quantization.gguf_blocks import PACKED_TYPES, gguf_weight
from pdserve.model.quantization.int4_planes import Int4PlanesWeight
from pdserve.model.quantization.int8_channels import Int8ChannelWeight, int8_weight
from pdserve.model.quantization.quantized_weight import QuantizedWeight, concat_rows

__all__ = [
    "PACKED_TYPES",
    "Int4PlanesWeight",
    "Int8ChannelWeight",
    "QuantizedWeight",
    "concat_rows",
    "gguf_weight",
    "int8_weight",
]
