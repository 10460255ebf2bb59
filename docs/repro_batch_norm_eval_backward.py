"""torch_xla 2.9.0: backward through BatchNorm in eval mode fails.

Expected: gradients (as on CPU), e.g. for fine-tuning with frozen statistics.
Observed, eagerly and compiled: native_batch_norm_backward raises "The size
of mean should be compatible with feature count, but the size of offset factor
is 0 and the feature count is 8." In eval mode native_batch_norm returns
empty save_mean / save_invstd (as on CPU), and torch_xla's
native_batch_norm_backward reads them even when training=False (given the
running statistics in their place it succeeds). Reported upstream as
pytorch/xla#3361 (open).

  PJRT_DEVICE=CPU python docs/repro_batch_norm_eval_backward.py   # exit 1 = bug
"""
import os
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')
import torch
import torch_xla

bn = torch.nn.BatchNorm1d(8).eval().to(torch_xla.device())
x = torch.randn(2, 8, 5, device=torch_xla.device(), requires_grad=True)
try:
  bn(x).sum().backward()
  torch_xla.sync()
  print('fixed: grad', x.grad.shape)
except RuntimeError as e:
  print('BUG REPRODUCED:', str(e).split('\n')[0])
  sys.exit(1)
