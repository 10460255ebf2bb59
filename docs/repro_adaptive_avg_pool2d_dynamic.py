"""torch_xla 2.9.0 dynamo bridge: a CPU-fallback op breaks dynamic=True.

nn.AdaptiveAvgPool2d((2, 3)) on a 6x7 input: 3 does not divide 7, so torch_xla
runs aten::_adaptive_avg_pool2d on CPU (counter aten::_adaptive_avg_pool2d).
Eager and dynamic=False are correct (the bridge partitions the fallback op
out). With dynamic=True the graph has int (size) arguments, the upstream
bridge skips its fallback partitioner, and the first call fails with "Failed
to get computation by hash ... Maybe the entry get kicked out of the LRU
cache". torch_xla_patches' bridge partitions in this case too.

  PJRT_DEVICE=CPU python docs/repro_adaptive_avg_pool2d_dynamic.py  # exit 1
"""
import os
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')
import torch
import torch_xla

device = torch_xla.device()
pool = torch.nn.AdaptiveAvgPool2d((2, 3))
compiled = torch.compile(pool, backend='openxla', dynamic=True)
try:
  for shape in ((2, 4, 6, 7), (3, 4, 8, 10)):
    x = torch.randn(*shape)
    torch.testing.assert_close(compiled(x.to(device)).cpu(), pool(x))
except RuntimeError as e:
  print('BUG REPRODUCED:', str(e).split('\n')[0][:200])
  sys.exit(1)
print('fixed')
