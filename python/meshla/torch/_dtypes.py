"""The torch dtypes meshla's kernels take, by the names its extension knows them by."""

import torch

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
