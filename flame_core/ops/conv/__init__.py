"""conv2d on arrays: an implicit GEMM on tensor cores (cuda, float16/bfloat16), else im2col + GEMM (cuBLAS through
flame_core.kernels.gemm on cuda, BLAS on cpu) in bounded-memory chunks.

Implicit GEMM (flame_core/kernels/conv.py, cuda_src/conv_igemm.cu), for groups=1 and every kernel size other than a
plain 1x1: x is copied to NHWC with channels padded to a multiple of 8 and the weights to (O, KH*KW*Cp); the kernel
gathers the column matrix tile by tile into shared memory, so nothing 9x the input exists. Batches are cut into image
chunks whose NHWC copies fit the workspace budget. A channels-last x (flame.channels_last: memory N, H, W, C, with C
a multiple of 8) is that copy already, and so is a channels-last dY: the kernels read them in place
(conv2d_memory_format tells a producer such as F.group_norm_silu which format to write). Per chunk:
    forward     y = conv(x_nhwc, Wp) (+ bias), written NCHW by the kernel's epilogue
    backward    dX = conv(dY_nhwc, W flipped and transposed) at stride 1; strided (dilation 1): one stride-1 conv of
                dY_nhwc per phase of dX (rows a::sh, columns b::sw; dx_phases), no col2im - on the wgmma kernel
                (strides up to 2) every phase in one launch that writes dX itself (one_launch_dx)
                (dilation > 1 with stride > 1 takes the im2col path)
                dW = dY^T @ X_cols, reduced over pixels in slices of fp32 partials (deterministic, no atomics)
`FLAME_CONV_ALGO=im2col` or `=igemm` forces a path (benchmarks and tests compare the two), for every pass or per
pass (`fwd=igemm,dx=igemm,dw=im2col`); `auto` (the default) picks im2col + cuBLAS for small column matrices
(IM2COL_MAX_BYTES, or FLAME_CONV_IM2COL_MAX_MB) and the implicit GEMM above, for each pass.
On a compute capability 9.0 device (H100/H200) the three passes run that implicit GEMM on warpgroup
MMAs (cuda_src/conv_wgmma.cu) instead of mma.sync wherever 'auto' takes the implicit GEMM (WGMMA_AUTO); `wgmma` (or
`fwd=wgmma` etc.) asks for it (RuntimeError on other devices), `igemm` keeps the mma.sync kernels, and arrays the
kernels do not take (cpu, float32, groups > 1, plain 1x1) keep their usual path.

im2col + GEMM: the batch is cut into chunks whose column matrix cols(C*KH*KW, P) fits a workspace budget
(`FLAME_CONV_WORKSPACE_MB`, default 512 on cuda, 128 on cpu): a few whole images, or one band of output rows of one
image when a single image is too big. Per chunk:
    forward     out(O, P) = W(O, C*KH*KW) @ cols                       (grouped: one batched GEMM over groups)
    backward    dW += dY(O, P) @ cols^T ;  dcols = W^T @ dY ;  dX (+)= col2im(dcols)
cols is recomputed in backward rather than saved, so a conv keeps only x and w alive for backward.
On cuda, im2col / col2im are raw kernels (cuda_src/im2col.cu); the xp reference (as_strided views) is the cpu path
and the test oracle.

Files, by concept: planning.py (checked geometry, chunking), routing.py (the algorithm of each pass), dispatch.py
(conv2d_forward / conv2d_backward on arrays), im2col_gemm.py with columns.py and matmul.py, pointwise.py (plain 1x1),
implicit_gemm.py with phases.py (strided dx), function.py (the autograd node; conv2d, conv2d_add, pad_conv2d). This
package re-exports their public names; monkeypatch a name in the file that reads it.
"""
from .columns import col2im, col2im_cuda, col2im_reference, im2col, im2col_cuda, im2col_reference
from .dispatch import bias_grad, conv2d_backward, conv2d_forward, image_bias_grad
from .function import Conv2d, checked_inputs, conv2d, conv2d_add, conv2d_memory_format, pad_conv2d
from .im2col_gemm import im2col_backward, im2col_forward
from .implicit_gemm import igemm_backward, igemm_forward, nhwc, reads_in_place
from .matmul import mm
from .phases import DxPhase, dx_phases, one_launch_dx, pack_phase_weight, phase_dx, strided_dx
from .planning import HALF, Geom, end_padding, geometry, image_chunks, is_pointwise, pair, plan, workspace_bytes
from .pointwise import POINTWISE_DW_ACC_MIN, pointwise_backward, pointwise_forward
from .routing import (
                      IM2COL_MAX_BYTES,
                      PASSES,
                      WGMMA_AUTO,
                      conv_algo,
                      im2col_max_bytes,
                      tuned,
                      tuned_plan,
                      use_igemm,
                      use_wgmma,
)
