"""A fake `nki.language`: the dtype names the kernels take (`nl.bfloat16`, ...).

The fake kernels compute with torch, so each name is the torch dtype of the same name.
"""

import torch

float32 = torch.float32
bfloat16 = torch.bfloat16
float16 = torch.float16
