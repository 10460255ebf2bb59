"""Cases of the module survey: standard modules under dynamic=True on XLA.

One definition shared by test/test_module_survey.py (pytest) and
tools/module_survey.py (the upstream-vs-patched table).

[Note: What a survey case checks]
Every case builds its module once on CPU (seeded), deep-copies it to the XLA
device and compiles the copy with `torch.compile(backend='openxla',
dynamic=True)`. For each of its input shapes (at least three) it then runs the
compiled XLA module and the eager CPU module on the same inputs and compares:
  * the outputs (floats with the case's tolerances, integers exactly);
  * with `backward`, the gradients of every parameter and of every float
    input, for the loss sum(out_i * w_i) with fixed random cotangents w_i;
  * every buffer after the call (BatchNorm's running statistics).
Gradients are cleared between shapes so a stale gradient cannot hide behind
accumulation. Cases whose outputs are random (Dropout) supply their own check.
"""
import copy
import dataclasses
import os
import re
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault('PJRT_DEVICE', 'CPU')

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

# Inputs of one call, made on CPU from a seeded generator.
InputFn = Callable[[Tuple[int, ...], torch.Generator], Tuple[torch.Tensor, ...]]


@dataclasses.dataclass(frozen=True)
class KnownFailure:
  """A failure that is torch_xla's, present in eager XLA too.

  Args:
    match: regex the failure's short error must match; the survey test
      asserts it, so a different failure (or a fix) is noticed.
    why: one line for the table.
    repro: the minimal reproducer under docs/.
    aborts_on_fatal_xla_errors: the bug is an XLA error status, which
      torch_xla 2.8 turns into a process abort instead of an exception
      (see versions.xla_errors_are_exceptions): the case cannot run there.
  """
  match: str
  why: str
  repro: str
  aborts_on_fatal_xla_errors: bool = False


@dataclasses.dataclass
class Case:
  """One row of the survey.

  Args:
    name: row label.
    build: makes the CPU module (called under a fixed seed).
    shapes: one shape key per call; passed to `inputs`.
    inputs: makes the CPU inputs for a shape key.
    backward: also compare parameter and float-input gradients.
    atol, rtol: tolerances for floating point results.
    check: custom comparison `check(cpu_out, xla_out_on_cpu, inputs)` for
      cases whose results are random; replaces the value comparison.
    known_failure: why the case fails with the patch too, if it does.
    max_graphs: dynamo graphs allowed over all shapes; more means dynamo
      specialized on a size (a recompile per shape).
    note: a line for the survey table (what fixed it, why it needs more).
  """
  name: str
  build: Callable[[], nn.Module]
  shapes: Sequence[Tuple[int, ...]]
  inputs: InputFn
  backward: bool = False
  atol: float = 1e-4
  rtol: float = 1e-4
  check: Optional[Callable[[Any, Any, Tuple[torch.Tensor, ...]], None]] = None
  known_failure: Optional[KnownFailure] = None
  max_graphs: int = 1
  note: str = ''


@dataclasses.dataclass
class CaseResult:
  name: str
  ok: bool
  # Dynamo graphs compiled for all shapes of the case (1 = fully dynamic).
  graphs: int = 0
  seconds: float = 0.0
  # First line of the failure, for the table.
  error: str = ''
  # Full traceback, for logs.
  details: str = ''


class Fn(nn.Module):
  """Wraps a function of tensors so functional cases run like modules."""

  def __init__(self, fn: Callable[..., Any]):
    super().__init__()
    self.fn = fn

  def forward(self, *args):
    return self.fn(*args)


def _float_inputs(*shape_fn: Callable[[Tuple[int, ...]], Tuple[int, ...]]):
  """Inputs that are standard normal tensors of shapes derived from the key."""

  def make(key, g):
    return tuple(torch.randn(*fn(key), generator=g) for fn in shape_fn)

  return make


def _x(key):
  return key


# Shape keys. Three distinct values per dynamic dimension, so the
# second and third call exercise the dynamic graph, not the first trace.
# [Note: Survey shape keys] The first call's sizes are all distinct and none
# is 0 or 1: dynamo specializes sizes 0 and 1, and gives equal sizes of the
# first call one symbol (duck sizing), so either would force a recompile that
# is not the fault of the module under test.
BT = [(3, 5), (2, 7), (4, 9)]
BCL = [(2, 8, 5), (3, 8, 7), (5, 8, 6)]
BCHW = [(2, 4, 6, 7), (3, 4, 8, 10), (5, 4, 10, 9)]


def _with_random_stats(bn: nn.Module) -> nn.Module:
  # Non-trivial running statistics so eval mode is not a near no-op.
  with torch.no_grad():
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    if bn.weight is not None:
      bn.weight.uniform_(0.5, 1.5)
      bn.bias.uniform_(-0.5, 0.5)
  return bn


def _train(module: nn.Module) -> nn.Module:
  return module.train()


def _eval(module: nn.Module) -> nn.Module:
  return module.eval()


def _dropout_check(cpu_out, xla_out, inputs):
  # [Note: Dropout check] Dropout's mask comes from the device RNG, so values
  # cannot match eager. Check what does not depend on the mask: the shape,
  # that kept elements are x / (1 - p), and that about p of them are dropped.
  (x,) = inputs
  assert xla_out.shape == cpu_out.shape, (xla_out.shape, cpu_out.shape)
  kept = xla_out != 0
  torch.testing.assert_close(xla_out[kept], (x * 2)[kept])
  frac = 1 - kept.float().mean().item()
  assert 0.4 < frac < 0.6, f'dropped fraction {frac:.3f}, expected ~0.5'


def _causal_masked_softmax(x):
  t = x.size(-1)
  mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
  return x.masked_fill(mask, float('-inf')).softmax(-1)


def _gather_scatter(x, idx):
  idx = idx.to(x.device)
  g = x.gather(1, idx)
  s = torch.zeros_like(x).scatter_add(1, idx, g * 2)
  return g, s


def _index_inputs(key, g):
  n, m = key
  x = torch.randn(n, 6, generator=g)
  idx = torch.randint(0, n, (m,), generator=g)
  return x, idx


def _gather_inputs(key, g):
  b, l = key
  x = torch.randn(b, l, generator=g)
  idx = torch.randint(0, l, (b, l), generator=g)
  return x, idx


def _ce_inputs(key, g):
  (n,) = key
  logits = torch.randn(n, 10, generator=g)
  target = torch.randint(0, 10, (n,), generator=g)
  target[::3] = 0  # hits ignore_index on a third of the rows
  return logits, target


def _embedding_inputs(key, g):
  return (torch.randint(0, 64, key, generator=g),)


def _sdpa_inputs(key, g):
  b, t = key
  return tuple(torch.randn(b, 2, t, 8, generator=g) for _ in range(3))


def _decoder_inputs(key, g):
  b, t, s = key
  return torch.randn(b, t, 16, generator=g), torch.randn(b, s, 16, generator=g)


def _einsum_inputs(key, g):
  b, i, k = key
  return torch.randn(b, i, 5, generator=g), torch.randn(b, 5, k, generator=g)


class SelfAttention(nn.Module):

  def __init__(self):
    super().__init__()
    self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

  def forward(self, x):
    return self.mha(x, x, x)


class DecoderLayer(nn.Module):

  def __init__(self):
    super().__init__()
    self.layer = nn.TransformerDecoderLayer(16,
                                            2,
                                            dim_feedforward=32,
                                            dropout=0.0,
                                            batch_first=True)

  def forward(self, tgt, memory):
    return self.layer(tgt, memory)


# torch_xla bugs that also break eager XLA; see docs/repro_*.py.
BN_RUNNING_VAR = KnownFailure(
    match=r'buffer running_var',
    why=('torch_xla updates running_var with the biased batch variance '
         '(eager XLA too)'),
    repro='docs/repro_batch_norm_running_var.py')
BN_EVAL_BACKWARD = KnownFailure(
    match=r'size of mean should be compatible with feature count',
    why=('torch_xla\'s native_batch_norm_backward reads the empty '
         'save_mean in eval mode (eager XLA too; pytorch/xla#3361)'),
    repro='docs/repro_batch_norm_eval_backward.py',
    aborts_on_fatal_xla_errors=True)

# Pooling's output size is computed with a rounding division whose meta
# implementation guards on the input size's parity: one graph for even and
# one for odd sizes, by design of torch's meta kernels.
POOL_GRAPHS = 2

_LAYER_NORM = ('decompositions: native_layer_norm (torch_xla\'s AutogradXLA '
               'kernel calls numel() on symbolic sizes)')

# Table notes: what made a case work, or why it needs more than one graph.
NOTES = {
    'LayerNorm':
        _LAYER_NORM,
    'TransformerEncoderLayer':
        _LAYER_NORM,
    'TransformerDecoderLayer':
        _LAYER_NORM,
    'GroupNorm': ('decompositions: native_group_norm (torch_xla\'s AutogradXLA '
                  'kernel specializes the sizes: a graph per batch size)'),
    'MaxPool2d': ('decompositions: max_pool2d (torch_xla\'s AutogradXLA kernel '
                  'calls xla::max_pool2d_forward, which has no fake kernel: '
                  'graph break, pooling ran eagerly); 2 graphs: even/odd '
                  'width, guard of torch\'s pooling meta kernel'),
    'AvgPool2d': ('2 graphs: even/odd width, guard of torch\'s pooling meta '
                  'kernel'),
    'AdaptiveAvgPool2d':
        ('output (2, 3) does not divide every input size, so torch_xla runs '
         '_adaptive_avg_pool2d on CPU (fallback); upstream\'s bridge skips its '
         'fallback partitioner when the graph has int args and fails; the '
         'patched bridge partitions it; repro: '
         '`docs/repro_adaptive_avg_pool2d_dynamic.py`'),
}


def aborts_here(case: Case) -> bool:
  """Whether running `case` would end this process (torch_xla 2.8)."""
  from torch_xla_patches import versions
  return (case.known_failure is not None and
          case.known_failure.aborts_on_fatal_xla_errors and
          not versions.xla_errors_are_exceptions())


def cases() -> List[Case]:
  """All survey cases, in table order."""
  return [dataclasses.replace(c, note=NOTES.get(c.name, '')) for c in _cases()]


def _batch_norm_cases() -> List[Case]:
  """Train and eval BatchNorm1d/2d, with and without the torch_xla bugs."""
  cases = []
  for cls, features, keys in ((nn.BatchNorm1d, 8, BCL), (nn.BatchNorm2d, 4,
                                                         BCHW)):
    name = cls.__name__
    cases += [
        Case(f'{name} (train)',
             lambda cls=cls, f=features: _train(cls(f)),
             keys,
             _float_inputs(_x),
             backward=True,
             known_failure=BN_RUNNING_VAR),
        Case(f'{name} (train, no running stats)',
             lambda cls=cls, f=features: _train(
                 cls(f, track_running_stats=False)),
             keys,
             _float_inputs(_x),
             backward=True),
        Case(f'{name} (eval)',
             lambda cls=cls, f=features: _eval(_with_random_stats(cls(f))),
             keys,
             _float_inputs(_x),
             backward=True,
             known_failure=BN_EVAL_BACKWARD),
        Case(f'{name} (eval, forward only)',
             lambda cls=cls, f=features: _eval(_with_random_stats(cls(f))),
             keys,
             _float_inputs(_x)),
    ]
  return cases


def _cases() -> List[Case]:
  return [
      Case('LayerNorm',
           lambda: nn.LayerNorm(16),
           BT,
           _float_inputs(lambda k: (*k, 16)),
           backward=True),
      Case('GroupNorm',
           lambda: nn.GroupNorm(4, 8),
           BCL,
           _float_inputs(_x),
           backward=True),
      Case('InstanceNorm1d',
           lambda: nn.InstanceNorm1d(8, affine=True),
           BCL,
           _float_inputs(_x),
           backward=True),
      Case('InstanceNorm2d',
           lambda: nn.InstanceNorm2d(4, affine=True),
           BCHW,
           _float_inputs(_x),
           backward=True),
      *_batch_norm_cases(),
      Case('RMSNorm',
           lambda: nn.RMSNorm(16),
           BT,
           _float_inputs(lambda k: (*k, 16)),
           backward=True),
      Case('Conv1d',
           lambda: nn.Conv1d(8, 6, 3, padding=1),
           BCL,
           _float_inputs(_x),
           backward=True),
      Case('Conv2d',
           lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1),
           BCHW,
           _float_inputs(_x),
           backward=True),
      Case('ConvTranspose2d',
           lambda: nn.ConvTranspose2d(
               4, 3, 3, stride=2, padding=1, output_padding=1),
           BCHW,
           _float_inputs(_x),
           backward=True),
      Case('MaxPool2d',
           lambda: nn.MaxPool2d(2),
           BCHW,
           _float_inputs(_x),
           backward=True,
           max_graphs=POOL_GRAPHS),
      Case('AvgPool2d',
           lambda: nn.AvgPool2d(2),
           BCHW,
           _float_inputs(_x),
           backward=True,
           max_graphs=POOL_GRAPHS),
      Case('AdaptiveAvgPool2d',
           lambda: nn.AdaptiveAvgPool2d((2, 3)),
           BCHW,
           _float_inputs(_x),
           backward=True),
      Case('Embedding',
           lambda: nn.Embedding(64, 16),
           BT,
           _embedding_inputs,
           backward=True),
      Case('Linear + GELU',
           lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(
               32, 16)),
           BT,
           _float_inputs(lambda k: (*k, 16)),
           backward=True),
      Case('Linear + SiLU',
           lambda: nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(
               32, 16)),
           BT,
           _float_inputs(lambda k: (*k, 16)),
           backward=True),
      Case('Dropout (train)',
           lambda: _train(nn.Dropout(0.5)), [(4, 512), (6, 512), (8, 384)],
           lambda k, g: (torch.ones(*k),),
           check=_dropout_check),
      Case('MultiheadAttention',
           SelfAttention,
           BT,
           _float_inputs(lambda k: (*k, 16)),
           backward=True),
      Case('TransformerEncoderLayer',
           lambda: nn.TransformerEncoderLayer(
               16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
           BT,
           _float_inputs(lambda k: (*k, 16)),
           backward=True),
      Case('TransformerDecoderLayer',
           DecoderLayer, [(2, 5, 3), (3, 7, 6), (4, 9, 4)],
           _decoder_inputs,
           backward=True),
      Case('SDPA (is_causal)',
           lambda: Fn(lambda q, k, v: F.scaled_dot_product_attention(
               q, k, v, is_causal=True)),
           BT,
           _sdpa_inputs,
           backward=True),
      Case(
          'F.interpolate (bilinear x2)', lambda: Fn(lambda x: F.interpolate(
              x, scale_factor=2, mode='bilinear', align_corners=False)), BCHW,
          _float_inputs(_x)),
      Case('F.interpolate (nearest, size)',
           lambda: Fn(lambda x: F.interpolate(x, size=(5, 7))), BCHW,
           _float_inputs(_x)),
      Case('F.pad (constant)',
           lambda: Fn(lambda x: F.pad(x, (1, 2, 0, 1), value=0.5)), BCHW,
           _float_inputs(_x)),
      Case('F.pad (reflect)',
           lambda: Fn(lambda x: F.pad(x, (1, 2, 2, 1), mode='reflect')), BCHW,
           _float_inputs(_x)),
      Case('cross_entropy (ignore_index)',
           lambda: Fn(lambda x, t: F.cross_entropy(x, t, ignore_index=0)),
           [(6,), (9,), (13,)],
           _ce_inputs,
           backward=True),
      Case('softmax / log_softmax',
           lambda: Fn(lambda x: (x.softmax(-1), x.log_softmax(1))), BCL,
           _float_inputs(_x)),
      Case('topk', lambda: Fn(lambda x: torch.topk(x, 3, dim=-1)), BCL,
           _float_inputs(_x)),
      Case('sort', lambda: Fn(lambda x: torch.sort(x, dim=-1)), BCL,
           _float_inputs(_x)),
      Case('cumsum', lambda: Fn(lambda x: x.cumsum(1)), BCL, _float_inputs(_x)),
      Case('gather / scatter_add', lambda: Fn(_gather_scatter), [(2, 5), (3, 8),
                                                                 (4, 6)],
           _gather_inputs),
      Case('index_select', lambda: Fn(lambda x, i: x.index_select(0, i)),
           [(5, 3), (7, 9), (6, 4)], _index_inputs),
      Case('masked_fill (causal mask)', lambda: Fn(_causal_masked_softmax),
           [(2, 5, 5), (3, 7, 7), (2, 9, 9)], _float_inputs(_x)),
      Case('einsum',
           lambda: Fn(lambda a, b: torch.einsum('bij,bjk->bik', a, b)),
           [(2, 3, 4), (3, 5, 2), (4, 2, 6)],
           _einsum_inputs,
           backward=True),
  ]


def _to(tree, device, requires_grad: bool):
  """Copies CPU inputs to `device`; float tensors get requires_grad."""

  def one(t):
    t = t.detach().to(device)
    if requires_grad and t.is_floating_point():
      t.requires_grad_(True)
    return t

  return tuple(one(t) for t in tree)


def _compare(name: str, expected, actual, case: Case) -> None:
  exp_leaves = pytree.tree_leaves(expected)
  act_leaves = pytree.tree_leaves(actual)
  assert len(exp_leaves) == len(act_leaves), (
      f'{name}: {len(act_leaves)} results, expected {len(exp_leaves)}')
  for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
    if not isinstance(e, torch.Tensor):
      assert e == a, f'{name}[{i}]: {a!r} != {e!r}'
      continue
    torch.testing.assert_close(a.detach().cpu(),
                               e.detach(),
                               atol=case.atol,
                               rtol=case.rtol,
                               msg=lambda m: f'{name}[{i}]: {m}')


def _loss(out, cotangents: List[torch.Tensor]):
  floats = [t for t in pytree.tree_leaves(out) if t.is_floating_point()]
  return sum((t * w).sum() for t, w in zip(floats, cotangents))


def run_case(case: Case,
             device,
             *,
             compile: bool = True,
             seed: int = 0) -> CaseResult:
  """Runs one case; returns a result instead of raising (see Note above).

  Args:
    compile: False runs the XLA module eagerly (no dynamo): tells torch_xla's
      own bugs from dynamic-tracing ones.
  """
  import torch._dynamo
  from torch._dynamo.utils import counters

  torch._dynamo.reset()
  counters.clear()
  start = time.perf_counter()
  try:
    torch.manual_seed(seed)
    cpu_mod = case.build()
    xla_mod = copy.deepcopy(cpu_mod).to(device)
    compiled = xla_mod
    if compile:
      compiled = torch.compile(xla_mod, backend='openxla', dynamic=True)
    g = torch.Generator().manual_seed(seed + 1)
    for key in case.shapes:
      inputs = case.inputs(key, g)
      cpu_in = _to(inputs, 'cpu', case.backward)
      xla_in = _to(inputs, device, case.backward)
      expected = cpu_mod(*cpu_in)
      actual = compiled(*xla_in)
      where = f'{case.name} shape={key}'
      if case.check is not None:
        case.check(expected, pytree.tree_map(lambda t: t.cpu(), actual), inputs)
      else:
        _compare(f'{where} output', expected, actual, case)
      if case.backward:
        floats = [
            t for t in pytree.tree_leaves(expected) if t.is_floating_point()
        ]
        cot = [torch.randn(t.shape, generator=g) for t in floats]
        _loss(expected, cot).backward()
        _loss(actual, [c.to(device) for c in cot]).backward()
        grads_cpu = {n: p.grad for n, p in cpu_mod.named_parameters()}
        grads_xla = {n: p.grad for n, p in xla_mod.named_parameters()}
        grads_cpu.update({f'input{i}': t.grad for i, t in enumerate(cpu_in)})
        grads_xla.update({f'input{i}': t.grad for i, t in enumerate(xla_in)})
        for n, gc in grads_cpu.items():
          gx = grads_xla[n]
          assert (gc is None) == (gx is None), f'{where} grad {n}: {gx} {gc}'
          if gc is not None:
            _compare(f'{where} grad {n}', gc, gx, case)
        for mod in (cpu_mod, xla_mod):
          mod.zero_grad(set_to_none=True)
      cpu_bufs = dict(cpu_mod.named_buffers())
      for n, b in xla_mod.named_buffers():
        _compare(f'{where} buffer {n}', cpu_bufs[n], b, case)
    graphs = int(counters['stats']['unique_graphs'])
    # A case that never reached the compiler would pass vacuously.
    assert graphs > 0 or not compile, (
        f'dynamo compiled no graph{_graph_break_reason(counters)}')
    return CaseResult(case.name, True, graphs, time.perf_counter() - start)
  except Exception as e:  # pylint: disable=broad-except
    # Kept per case so one failure does not hide the rest of the table.
    return CaseResult(case.name,
                      False,
                      int(counters['stats']['unique_graphs']),
                      time.perf_counter() - start,
                      error=short_error(e),
                      details=traceback.format_exc())
  finally:
    torch._dynamo.reset()


def _graph_break_reason(counters) -> str:
  for reason in counters['graph_break']:
    lines = [l.strip() for l in reason.splitlines() if l.strip()]
    detail = [l for l in lines if l.startswith('Developer debug context:')]
    text = detail[0].split(':', 1)[1].strip() if detail else lines[0]
    return f' (graph break: {text})'
  return ''


def short_error(e: BaseException) -> str:
  """The most specific one-line description of a failure."""
  text = f'{type(e).__name__}: {e}'
  # Dynamo wraps errors of its fake-tensor pass as "... got Error('msg\\n...')";
  # the inner error is the informative part.
  inner = re.search(r"got (\w+)\(['\"](.*?)(?:\\n|['\"]\))", text)
  if inner:
    text = f'{inner.group(1)}: {inner.group(2)}'
  lines = [l for l in text.strip().splitlines() if l.strip()]
  return (lines[0] if lines else type(e).__name__)[:160]


# Patch modes the survey runs under.
UPSTREAM = 'upstream'
PATCHED = 'patched'
DECOMPOSITIONS = 'decompositions'


def enable(mode: str) -> str:
  """Switches the process into `mode`; returns a description of what ran.

  PATCHED is torch_xla_patches.apply(). While the patched bridge module does
  not exist yet, it falls back to decompositions.install() with the upstream
  bridge and says so (any other failure of apply() propagates).
  """
  if mode == UPSTREAM:
    return 'upstream torch_xla bridge, no decompositions'
  from torch_xla_patches import decompositions
  if mode == DECOMPOSITIONS:
    decompositions.install()
    return 'decompositions.install() with the upstream bridge'
  if mode != PATCHED:
    raise ValueError(f'unknown mode {mode!r}')
  import torch_xla_patches
  try:
    torch_xla_patches.apply()
  except ModuleNotFoundError as e:
    if e.name != 'torch_xla_patches.dynamo_bridge':
      raise
    decompositions.install()
    return ('decompositions.install() with the upstream bridge '
            '(torch_xla_patches.dynamo_bridge is not there yet)')
  return 'torch_xla_patches.apply()'


def disable(mode: str) -> None:
  if mode == UPSTREAM:
    return
  import torch_xla_patches
  from torch_xla_patches import decompositions
  torch_xla_patches.revert()
  decompositions.uninstall()
