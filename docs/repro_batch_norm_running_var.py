"""torch_xla 2.9.0: BatchNorm's running_var uses the biased batch variance.

Expected (PyTorch semantics, CPU/CUDA): in training mode running_var is
updated with the unbiased batch variance (divide by n - 1).
Observed: on XLA, eagerly and compiled, the biased variance (divide by n).
Forward outputs and gradients are correct; only the buffer differs.

  PJRT_DEVICE=CPU python docs/repro_batch_norm_running_var.py   # exit 1 = bug
"""
import os
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')
import torch
import torch_xla

torch.manual_seed(0)
x = torch.randn(2, 8, 5)
cpu = torch.nn.BatchNorm1d(8)
xla = torch.nn.BatchNorm1d(8).to(torch_xla.device())
cpu(x)
xla(x.to(torch_xla.device()))
per_channel = x.transpose(0, 1).reshape(8, -1)
unbiased = 0.9 + 0.1 * per_channel.var(1, unbiased=True)
biased = 0.9 + 0.1 * per_channel.var(1, unbiased=False)
print('CPU running_var     ', cpu.running_var[:4])
print('XLA running_var     ', xla.running_var.cpu()[:4])
print('with unbiased var   ', unbiased[:4])
print('with biased var     ', biased[:4])
if not torch.allclose(xla.running_var.cpu(), cpu.running_var):
  print('BUG REPRODUCED: XLA running_var == biased update:',
        torch.allclose(xla.running_var.cpu(), biased))
  sys.exit(1)
print('fixed')
