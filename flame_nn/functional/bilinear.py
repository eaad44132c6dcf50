"""bilinear: y_k = x1^T W_k x2 + b_k, weight (out, in1, in2)."""
from flame_core.errors import ShapeError, fmt_shape


def bilinear(input1, input2, weight, bias=None):
    O, I1, I2 = weight.shape
    if input1.shape[-1] != I1 or input2.shape[-1] != I2 or tuple(input1.shape[:-1]) != tuple(input2.shape[:-1]):
        raise ShapeError(f"bilinear: input1 {fmt_shape(input1.shape)} and input2 {fmt_shape(input2.shape)} do not "
                         f"fit weight {fmt_shape(weight.shape)} (same leading dims, last dims {I1} and {I2})")
    lead = tuple(input1.shape[:-1])
    w = weight.permute(1, 0, 2).reshape(I1, O * I2)                      # (in1, out * in2)
    t = (input1.reshape(-1, I1) @ w).reshape(-1, O, I2)                  # (M, out, in2)
    y = (t * input2.reshape(-1, 1, I2)).sum(-1)                          # (M, out)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, O)
