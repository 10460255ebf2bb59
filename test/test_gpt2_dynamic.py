"""A tiny GPT-2 under torch.compile(dynamic=True) on XLA, with the patch.

LayerNorm made this model untraceable with dynamic=True upstream (see
torch_xla_patches/decompositions.py). With torch_xla_patches.apply() it must
trace once and match eager CPU, forward and backward, over many (batch, seq)
shapes.
"""
import copy
import math
import os
import sys

os.environ.setdefault('PJRT_DEVICE', 'CPU')

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

VOCAB, D, HEADS, LAYERS, MAX_SEQ = 64, 32, 2, 2, 32

# (batch, seq): 14 shapes. The first has distinct sizes, none 0 or 1: dynamo
# specializes those and duck-sizes equal ones (see [Note: Survey shape keys]
# in module_cases.py), which would force a second trace.
SHAPES = [(2, 5), (3, 7), (4, 9), (2, 12), (5, 3), (3, 16), (4, 4), (6, 11),
          (2, 2), (3, 20), (5, 8), (4, 13), (2, 31), (7, 6)]


class Block(nn.Module):

  def __init__(self):
    super().__init__()
    self.ln_1 = nn.LayerNorm(D)
    self.c_attn = nn.Linear(D, 3 * D)
    self.c_proj = nn.Linear(D, D)
    self.ln_2 = nn.LayerNorm(D)
    self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(approximate='tanh'),
                             nn.Linear(4 * D, D))
    # GPT-2 keeps a max-size causal mask and slices it to the sequence.
    self.register_buffer('mask',
                         torch.tril(
                             torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool)),
                         persistent=False)

  def attention(self, x):
    b, t, _ = x.shape
    q, k, v = self.c_attn(x).split(D, dim=2)
    q, k, v = (
        z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(D // HEADS)
    att = att.masked_fill(~self.mask[:t, :t], float('-inf')).softmax(-1)
    y = (att @ v).transpose(1, 2).reshape(b, t, D)
    return self.c_proj(y)

  def forward(self, x):
    x = x + self.attention(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class TinyGPT2(nn.Module):

  def __init__(self):
    super().__init__()
    self.wte = nn.Embedding(VOCAB, D)
    self.wpe = nn.Embedding(MAX_SEQ, D)
    self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
    self.ln_f = nn.LayerNorm(D)
    self.lm_head = nn.Linear(D, VOCAB, bias=False)
    self.lm_head.weight = self.wte.weight  # tied

  def forward(self, idx, targets):
    t = idx.size(1)
    pos = torch.arange(t, device=idx.device)
    x = self.wte(idx) + self.wpe(pos)
    for block in self.blocks:
      x = block(x)
    logits = self.lm_head(self.ln_f(x))
    loss = F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
    return logits, loss


def test_tiny_gpt2_dynamic_traces_once_and_matches_eager(patched_bridge):
  device = torch_xla.device()
  torch.manual_seed(0)
  cpu_model = TinyGPT2()
  xla_model = copy.deepcopy(cpu_model).to(device)
  # Moving to XLA makes a new Parameter per module (no shallow copy across
  # device types), which unties the weights; tie them again, as on TPU.
  xla_model.lm_head.weight = xla_model.wte.weight
  assert cpu_model.lm_head.weight is cpu_model.wte.weight

  traced = []
  openxla = lookup_backend('openxla')

  def counting_backend(gm, example_inputs):
    traced.append(gm)
    return openxla(gm, example_inputs)

  counters.clear()
  compiled = torch.compile(xla_model, backend=counting_backend, dynamic=True)
  g = torch.Generator().manual_seed(1)
  for b, t in SHAPES:
    idx = torch.randint(0, VOCAB, (b, t), generator=g)
    targets = torch.randint(0, VOCAB, (b, t), generator=g)
    logits, loss = compiled(idx.to(device), targets.to(device))
    ref_logits, ref_loss = cpu_model(idx, targets)
    where = f'shape {(b, t)}'
    torch.testing.assert_close(logits.cpu(),
                               ref_logits,
                               atol=1e-4,
                               rtol=1e-4,
                               msg=where)
    torch.testing.assert_close(loss.cpu(), ref_loss, atol=1e-5, rtol=1e-5)
    loss.backward()
    ref_loss.backward()
    xla_params = dict(xla_model.named_parameters())
    for name, p in cpu_model.named_parameters():
      torch.testing.assert_close(xla_params[name].grad.cpu(),
                                 p.grad,
                                 atol=1e-4,
                                 rtol=1e-4,
                                 msg=lambda m: f'{where} grad {name}: {m}')
    cpu_model.zero_grad(set_to_none=True)
    xla_model.zero_grad(set_to_none=True)

  # One dynamo trace served all shapes.
  assert len(traced) == 1, f'{len(traced)} dynamo graphs'
  assert counters['stats']['unique_graphs'] == 1
  # ...and it is the whole model, not a fragment before a graph break.
  assert not counters['graph_break'], dict(counters['graph_break'])
  ops = {str(n.target) for n in traced[0].graph.nodes}
  assert any('layer_norm' in op for op in ops), ops


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))
