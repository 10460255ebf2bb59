"""Modules for test_serve_signatures.py, at a module's top level: torch's
aot_compile cannot save a guard on a class defined in a function."""
import functools

import torch

# A module-level flag the forward reads: a global guard (see [Note: Guards
# kept by aot_compile]).
DOUBLE = False


def passes_everything_on(forward):
  """A decorator of Hugging Face's form: wrapper(self, *args, **kwargs)."""

  @functools.wraps(forward)
  def wrapper(self, *args, **kwargs):
    return forward(self, *args, **kwargs)

  return wrapper


def hides_what_it_wraps(forward):
  """A decorator with no functools.wraps: its signature is
  (self, *args, **kwargs) and nothing says what it wraps."""

  def wrapper(self, *args, **kwargs):
    return forward(self, *args, **kwargs)

  return wrapper


def _decorated_forward(self, x, mask=None, *, scale: float = 1.0):
  y = self.proj(x) * scale
  if mask is not None:
    y = y * mask
  if DOUBLE:
    y = y * 2
  return {'y': y, 'total': y.sum(dim=-1)}


class Decorated(torch.nn.Module):
  """A decorated forward with a keyword-only parameter and defaults."""

  def __init__(self, width=16):
    super().__init__()
    self.proj = torch.nn.Linear(width, width)
    self.width = width

  forward = passes_everything_on(_decorated_forward)


class BareDecorated(Decorated):
  """Decorated's forward under a decorator that hides what it wraps."""

  forward = hides_what_it_wraps(_decorated_forward)


class LayeredStep(torch.nn.Module):
  """A step over a list of per-layer tensors, with a static scalar."""

  def __init__(self, width=16, layers=2):
    super().__init__()
    self.layers = torch.nn.ModuleList(
        torch.nn.Linear(width, width) for _ in range(layers))

  def forward(self, x, caches, scale=1.0, note=None):
    outputs = []
    for layer, cache in zip(self.layers, caches):
      x = torch.tanh(layer(x) + cache.mean(dim=0))
      outputs.append(x * scale)
    return x, outputs


class TwoLinear(torch.nn.Module):
  """Two Linear layers, for a mesh: weights sharded over 'model'."""

  def __init__(self):
    super().__init__()
    self.up = torch.nn.Linear(16, 32)
    self.down = torch.nn.Linear(32, 16)

  def forward(self, x):
    return self.down(torch.relu(self.up(x)))


class PromptOrStep(torch.nn.Module):
  """Other code for one token than for several, as transformers' causal
  mask takes: a capture on a prompt guards `2 <= x.size()[1]`."""

  def __init__(self, width=8):
    super().__init__()
    self.proj = torch.nn.Linear(width, width)

  def forward(self, x):
    y = self.proj(x)
    if x.size(1) > 1:
      return y.cumsum(dim=1)
    return y * 2


class ForwardState:
  """Module-level state a forward sets for its duration and puts back, as
  transformers' output capturing and kernels' active functions do."""

  def __init__(self):
    self.active = None
    self.compiling = False
    self.calls = 0


FORWARD_STATE = ForwardState()


class SetsStateBack(torch.nn.Module):

  def __init__(self, width=8, count_calls=False):
    super().__init__()
    self.proj = torch.nn.Linear(width, width)
    self.count_calls = count_calls

  def forward(self, x):
    previous = FORWARD_STATE.active
    FORWARD_STATE.active = 'forward'
    FORWARD_STATE.compiling = True
    y = self.proj(x) * 2
    FORWARD_STATE.active = previous
    FORWARD_STATE.compiling = False
    if self.count_calls:
      FORWARD_STATE.calls += 1
    return y
