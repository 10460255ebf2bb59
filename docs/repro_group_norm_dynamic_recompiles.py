"""torch_xla 2.9.0: nn.GroupNorm with dynamic=True recompiles per batch size.

Expected: one dynamo graph serves every batch size (dynamic=True).
Observed: one graph per batch size. torch_xla's AutogradXLA kernel for
aten::native_group_norm turns its SymInt size arguments into concrete ints, so
dynamo specializes the input sizes ("size mismatch at index 0" recompiles with
TORCH_LOGS=recompiles).

  PJRT_DEVICE=CPU python docs/repro_group_norm_dynamic_recompiles.py  # exit 1
"""
import os
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')
import torch
import torch_xla
from torch._dynamo.utils import counters

device = torch_xla.device()
gn = torch.nn.GroupNorm(4, 8).to(device)
compiled = torch.compile(gn, backend='openxla', dynamic=True)
for batch in (2, 3, 5):
  x = torch.randn(batch, 8, 6, device=device)
  torch.testing.assert_close(compiled(x).cpu(), gn(x).cpu())
graphs = counters['stats']['unique_graphs']
if graphs > 1:
  print(f'BUG REPRODUCED: {graphs} dynamo graphs for 3 batch sizes')
  sys.exit(1)
print('fixed: one graph')
