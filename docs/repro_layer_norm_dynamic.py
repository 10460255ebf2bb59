"""torch_xla 2.9.0: nn.LayerNorm cannot be compiled with dynamic=True.

Expected: the compiled LayerNorm matches eager for every batch size.
Observed: dynamo's fake-tensor pass runs torch_xla's AutogradXLA kernel for
aten::native_layer_norm, which calls ATen's math_native_layer_norm, which calls
numel(): "Cannot call numel() on tensor with symbolic sizes/strides".

  PJRT_DEVICE=CPU python docs/repro_layer_norm_dynamic.py   # exit 1 = bug
"""
import os
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')
import torch
import torch_xla

device = torch_xla.device()
ln = torch.nn.LayerNorm(16).to(device)
compiled = torch.compile(ln, backend='openxla', dynamic=True)
try:
  for batch in (2, 3, 5):
    x = torch.randn(batch, 16, device=device)
    torch.testing.assert_close(compiled(x).cpu(), ln(x).cpu())
except Exception as e:  # the bug
  message = str(e)
  if "got RuntimeError('" in message:  # dynamo's wrapper; show the cause
    message = message.split("got RuntimeError('")[1]
  print('BUG REPRODUCED:', message.split('\\n')[0][:300])
  sys.exit(1)
print('fixed: LayerNorm compiles with dynamic=True')
