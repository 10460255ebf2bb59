"""torch_xla 2.9.0: max pooling under torch.compile.

1. nn.MaxPool2d on an input that requires grad, dynamic=True: torch_xla's
   AutogradXLA kernel calls the custom op xla::max_pool2d_forward, which has
   no fake-tensor kernel; dynamo graph-breaks ("unsupported operator:
   xla.max_pool2d_forward.default") and the pooling runs eagerly.
2. nn.MaxPool3d fails under torch.compile with dynamic=False and True, with or
   without grad: torch_xla's AutogradXLA kernel is handed a fake tensor
   ("Expected XLA tensor. Got: XLAFloatType").

  PJRT_DEVICE=CPU python docs/repro_max_pool_compile.py   # exit 1 = bug
"""
import os
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')
import torch
import torch._dynamo
import torch_xla
from torch._dynamo.utils import counters

device = torch_xla.device()
bugs = []

pool2d = torch.nn.MaxPool2d(2)
compiled = torch.compile(pool2d, backend='openxla', dynamic=True)
x = torch.randn(2, 3, 6, 8, device=device, requires_grad=True)
compiled(x)
if counters['graph_break']:
  bugs.append('MaxPool2d (requires_grad, dynamic=True): graph break: ' +
              next(iter(counters['graph_break'])).split('\n')[0])

for dynamic in (False, True):
  torch._dynamo.reset()
  pool3d = torch.compile(torch.nn.MaxPool3d(2),
                         backend='openxla',
                         dynamic=dynamic)
  try:
    pool3d(torch.randn(2, 3, 4, 6, 8, device=device))
  except Exception as e:
    inner = str(e).split("got RuntimeError('")[-1].split("'")[0]
    bugs.append(f'MaxPool3d (dynamic={dynamic}): {inner}')

for bug in bugs:
  print('BUG REPRODUCED:', bug)
sys.exit(1 if bugs else 0)
