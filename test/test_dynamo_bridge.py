"""Behaviour of the patched bridge: results equal eager on CPU, counters,
in-place updates, special outputs, CPU fallback, modes and bad input."""
import logging
import sys
import threading

import pytest
import torch
import torch._dynamo
import torch_xla
import torch_xla.debug.metrics as met

import torch_xla_patches
from torch_xla_patches import config, signature_cache, torch_internals
from bridge_testing import FrameCounter, counters, xla

DEVICE = torch_xla.device()

pytestmark = pytest.mark.usefixtures('patched_bridge')


def compile_dynamic(fn, **kwargs):
  return torch.compile(fn, backend='openxla', dynamic=True, **kwargs)


def test_one_trace_one_compile_per_signature():

  def fn(x, y):
    return torch.relu(x @ y).sum(dim=0) * x.shape[0]

  compiled = compile_dynamic(fn)
  sizes = [3, 5, 3, 7, 5, 3]
  for n in sizes:
    x, y = torch.randn(n, 6), torch.randn(6, 4)
    torch.testing.assert_close(compiled(xla(x), xla(y)).cpu(), fn(x, y))
  assert counters() == {
      'DynamoExtractCompiledGraph': 1,
      # The first signature is compiled before the first call, which hits.
      'DynamoSignatureHit': len(sizes) - 3 + 1,
      'DynamoSignatureMiss': 3,
      'DynamoEvictedRetrace': 0,
      'DynamoSignatureDropped': 0,
      'DynamoCpuFallbackPartition': 0,
      'DynamoSignaturePrecompiled': 0,
      'DynamoSignaturePrecompileSkipped': 0,
      'UncachedCompile': 3,
  }
  assert met.metric_data('CompileTime')[0] == 3


def test_repeated_signature_compiles_and_traces_nothing():

  def fn(x):
    return x.cos() + x.shape[0]

  compiled = compile_dynamic(fn)
  compiled(xla(torch.randn(4, 2)))
  compiled(xla(torch.randn(6, 2)))
  met.clear_all()
  for _ in range(3):
    x = torch.randn(6, 2)
    torch.testing.assert_close(compiled(xla(x)).cpu(), fn(x))
  assert 'CompileTime' not in met.metric_names()
  assert 'DynamoExtractCompiledGraph' not in met.counter_names()
  assert counters()['DynamoSignatureHit'] == 3


def test_symint_and_tensor_outputs():

  def fn(x):
    return x * 2, x.shape[0] * x.shape[1], x.sum()

  compiled = compile_dynamic(fn)
  for shape in [(2, 3), (4, 5), (2, 3)]:
    x = torch.randn(*shape)
    out = compiled(xla(x))
    ref = fn(x)
    torch.testing.assert_close(out[0].cpu(), ref[0])
    assert type(out[1]) is int and out[1] == ref[1]
    torch.testing.assert_close(out[2].cpu(), ref[2])
  # The int output is assembled from the signature, not computed: two
  # signatures, two compiles, and the third call hits.
  assert counters() == {
      'DynamoExtractCompiledGraph': 1,
      'DynamoSignatureHit': 2,
      'DynamoSignatureMiss': 2,
      'DynamoEvictedRetrace': 0,
      'DynamoSignatureDropped': 0,
      'DynamoCpuFallbackPartition': 0,
      'DynamoSignaturePrecompiled': 0,
      'DynamoSignaturePrecompileSkipped': 0,
      'UncachedCompile': 2,
  }


def test_inplace_update_of_input_is_applied_every_call():

  def fn(x, acc):
    acc.add_(x.sum(dim=0))
    return acc * 2

  compiled = compile_dynamic(fn)
  acc_cpu = torch.zeros(3)
  acc_xla = xla(acc_cpu)
  for n in [2, 5, 2, 5, 9]:
    x = torch.randn(n, 3)
    torch.testing.assert_close(compiled(xla(x), acc_xla).cpu(), fn(x, acc_cpu))
    torch.testing.assert_close(acc_xla.cpu(), acc_cpu)


def test_only_runs_that_update_nothing_skip_the_write_back():
  """A program that computes results and updates no argument runs without
  run_entry's write-back; one that updates an argument in the graph (as
  apply()'s openxla backend keeps inference updates) does not. Either way
  every call equals eager."""

  def pure(x, acc):
    return x * 2 + acc

  def updating(x, acc):
    acc.add_(x)
    return acc * 2

  entries = {}
  for fn in [pure, updating]:
    before = set(map(id, signature_cache.live_signature_caches()))
    compiled = compile_dynamic(fn)
    acc_cpu = torch.ones(3)
    acc_xla = xla(acc_cpu)
    for _ in range(2):
      x = torch.randn(3)
      torch.testing.assert_close(
          compiled(xla(x), acc_xla).cpu(), fn(x, acc_cpu))
      torch.testing.assert_close(acc_xla.cpu(), acc_cpu)
    (cache,) = [
        c for c in signature_cache.live_signature_caches()
        if id(c) not in before
    ]
    entries[fn.__name__] = list(cache.entries.values())
  assert [e.writes_nothing_back for e in entries['pure']] == [True]
  # Where AOTAutograd writes the update back itself (upstream's backend, as
  # the rendered bridge runs), the program updates nothing either.
  updates = [bool(e.output_plan.inplace_updates) for e in entries['updating']]
  assert [e.writes_nothing_back for e in entries['updating']
         ] == [not u for u in updates]
  if isinstance(torch._dynamo.backends.registry.lookup_backend('openxla'),
                torch_internals.InferenceUpdatesInGraph):
    assert updates == [True]


def test_output_that_is_an_unchanged_input_and_duplicate_outputs():

  def fn(x, y):
    z = x + y
    return y, z, z

  compiled = compile_dynamic(fn)
  for n in [2, 3]:
    x, y = torch.randn(n), torch.randn(n)
    y_xla = xla(y)
    out = compiled(xla(x), y_xla)
    torch.testing.assert_close(out[0].cpu(), y)
    torch.testing.assert_close(out[1].cpu(), x + y)
    torch.testing.assert_close(out[2].cpu(), x + y)
    # The unchanged input comes back as the caller's tensor, and the
    # duplicate output as one tensor, as in eager.
    assert out[0] is y_xla
    assert out[1] is out[2]


def test_input_with_pending_ir_is_synced_and_counted():

  def fn(x):
    return x * 3

  compiled = compile_dynamic(fn)
  compiled(xla(torch.randn(4)))
  base = torch.randn(5)
  pending = xla(base) + 1  # lazy: not materialized
  torch.testing.assert_close(compiled(pending).cpu(), (base + 1) * 3)
  pending = xla(base) - 1
  torch.testing.assert_close(compiled(pending).cpu(), (base - 1) * 3)
  # The first pending input (size 5) came with a new signature: synced
  # before the bridge's lock; the second hits and is synced before the run.
  assert met.counter_value('DynamoSyncInputExecuteTime') == 2


def test_upstream_skip_input_data_check_still_raises(monkeypatch):
  from torch_xla._dynamo import config as upstream_config
  monkeypatch.setattr(upstream_config, 'skip_input_data_check', True)
  compiled = compile_dynamic(lambda x: x.cos())
  compiled(xla(torch.randn(3, 4)))
  with pytest.raises(RuntimeError, match='can not be a pending ir'):
    compiled(xla(torch.randn(3, 4)) + 5)


@pytest.mark.parametrize('op', ['logcumsumexp', 'median'])
def test_cpu_fallback_op_is_never_a_stale_constant(op):

  def fn(x):
    if op == 'logcumsumexp':
      y = torch.logcumsumexp(x, dim=0)
    else:
      y = x.median(dim=1).values
    return y * 2 + x.shape[0]

  compiled = compile_dynamic(fn)
  for n in [3, 4, 3, 4, 3]:
    x = torch.randn(n, 5)
    torch.testing.assert_close(compiled(xla(x)).cpu(), fn(x))
  assert counters()['DynamoCpuFallbackPartition'] == 1


def _with_fallback_of_another_thread(monkeypatch):
  """Makes the look-ahead run of the first node of each graph wait, in the
  node, for another thread's CPU fallback op (an `.item()`)."""
  from torch_xla_patches import dynamo_bridge
  run_node = dynamo_bridge.UnsupportedNodesCollector.run_node
  done = []

  def run_node_beside_a_fallback(self, n):
    if n.op == 'call_function' and not done:
      done.append(n)
      other = threading.Thread(target=lambda: int(xla(torch.ones(2)).sum()))
      other.start()
      other.join()
    return run_node(self, n)

  monkeypatch.setattr(dynamo_bridge.UnsupportedNodesCollector, 'run_node',
                      run_node_beside_a_fallback)
  return done


def test_another_threads_fallback_leaves_the_graph_whole(monkeypatch):
  # See [Note: Fallback ops of this thread]: the fallback counters are the
  # process's; another thread's `.item()` is no fallback of this graph.
  done = _with_fallback_of_another_thread(monkeypatch)

  def fn(x):
    return (x * 2).cos() + x.shape[0]

  compiled = compile_dynamic(fn)
  x = torch.randn(3, 5)
  torch.testing.assert_close(compiled(xla(x)).cpu(), fn(x))
  assert done
  assert counters()['DynamoCpuFallbackPartition'] == 0


def test_a_look_ahead_beside_another_threads_trace_leaves_dynamo_on(
    monkeypatch):
  # See [Note: Fallback ops of this thread]: another thread's dynamo trace
  # enters its FakeTensorMode during a look-ahead and leaves it after;
  # dynamo must still trace new frames afterwards.
  from torch._subclasses.fake_tensor import FakeTensorMode
  from torch.utils._python_dispatch import is_in_torch_dispatch_mode
  from torch_xla_patches import dynamo_bridge
  run_node = dynamo_bridge.UnsupportedNodesCollector.run_node
  tracing, looked = threading.Event(), threading.Event()

  def trace():
    with FakeTensorMode():
      tracing.set()
      looked.wait(60)

  other = threading.Thread(target=trace)

  def run_node_beside_a_trace(self, n):
    if n.op == 'call_function' and not other.is_alive() and not looked.is_set():
      other.start()
      assert tracing.wait(60)
    return run_node(self, n)

  monkeypatch.setattr(dynamo_bridge.UnsupportedNodesCollector, 'run_node',
                      run_node_beside_a_trace)

  def fn(x):
    return (x * 2).cos() + x.shape[0]

  x = torch.randn(3, 5)
  torch.testing.assert_close(compile_dynamic(fn)(xla(x)).cpu(), fn(x))
  looked.set()
  other.join(60)
  assert tracing.is_set()
  assert not is_in_torch_dispatch_mode(include_infra_modes=False)

  # A new frame is traced and compiled, not run eagerly.
  def another_fn(x):
    return (x * 3).sin() + x.shape[0]

  torch.testing.assert_close(
      compile_dynamic(another_fn)(xla(x)).cpu(), another_fn(x))
  assert counters()['DynamoExtractCompiledGraph'] == 2


def test_a_fallback_inside_a_kernel_is_found_by_a_second_run(monkeypatch):
  # An op one of torch_xla's kernels runs inside another reaches no
  # dispatch mode: the node's second run changes the counter again. Without
  # the dispatch mode's check, a look-ahead on placeholders would run such
  # a kernel on them: this look-ahead is on the arguments alone.
  from torch_xla_patches import dynamo_bridge, fallback_probe
  monkeypatch.setattr(dynamo_bridge, '_look_ahead_on_placeholders',
                      lambda *args: None)
  monkeypatch.setattr(fallback_probe.OpsOfThisThread,
                      '__torch_dispatch__',
                      lambda self, func, types, args=(), kwargs=None: func(
                          *args, **(kwargs or {})))

  def fn(x):
    return torch.logcumsumexp(x, dim=0) * 2 + x.shape[0]

  compiled = compile_dynamic(fn)
  for n in [3, 4, 3]:
    x = torch.randn(n, 5)
    torch.testing.assert_close(compiled(xla(x)).cpu(), fn(x))
  assert counters()['DynamoCpuFallbackPartition'] == 1


def test_inference_tensors_compile():
  # Inference tensors keep no version counter, which the look-ahead must
  # not read (see [Note: Graphs that cannot be split]).

  def fn(x):
    return torch.logcumsumexp(x * 2, dim=0) + x.shape[0]

  compiled = compile_dynamic(fn)
  with torch.inference_mode():
    for n in [3, 4]:
      x = torch.randn(n, 5)
      torch.testing.assert_close(compiled(xla(x)).cpu(), fn(x))
  assert counters()['DynamoCpuFallbackPartition'] == 1


def test_default_mode_goes_dynamic_on_second_shape():
  frames = FrameCounter()

  def fn(x):
    return (x * x).sum(dim=-1)

  compiled = torch.compile(fn, backend=frames)
  for n in [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]:
    x = torch.randn(n, 4)
    torch.testing.assert_close(compiled(xla(x)).cpu(), fn(x))
  assert frames.frames == 2
  assert counters()['DynamoExtractCompiledGraph'] == 2


def test_default_mode_without_automatic_dynamic_keeps_upstream_behaviour():
  torch_xla_patches.revert()
  torch_xla_patches.apply(automatic_dynamic_shapes=False)
  frames = FrameCounter()
  compiled = torch.compile(lambda x: x + 1, backend=frames)
  for n in [2, 3, 4]:
    compiled(xla(torch.randn(n)))
  assert frames.frames == 3


def test_mark_dynamic_with_dynamic_false():
  frames = FrameCounter()

  def fn(x):
    return x.softmax(dim=0)

  compiled = torch.compile(fn, backend=frames, dynamic=False)
  for n in [3, 6, 9]:
    x = torch.randn(n, 2)
    x_xla = xla(x)
    torch._dynamo.mark_dynamic(x_xla, 0)
    torch.testing.assert_close(compiled(x_xla).cpu(), fn(x))
  assert frames.frames == 1
  assert counters()['DynamoSignatureMiss'] == 3


def test_random_ops_differ_between_calls():
  compiled = compile_dynamic(lambda x: x + torch.rand_like(x))
  x = xla(torch.zeros(64))
  first, second = compiled(x).cpu(), compiled(x).cpu()
  assert not torch.equal(first, second)
  assert 0 <= first.min() and first.max() < 1


def test_cpu_tensor_input_warns_naming_the_argument_and_stays_correct():
  # Upstream's test/dynamo/test_bridge.py runs ops on CPU inputs eagerly;
  # the patched bridge keeps that, and names the argument in its warning.

  def fn(x, index):
    return x[index] * 2

  x, index = torch.randn(5), torch.tensor([4, 0, 2])
  with pytest.warns(UserWarning) as caught:
    got = compile_dynamic(fn)(xla(x), index)
  torch.testing.assert_close(got.cpu(), fn(x, index))
  messages = [str(w.message) for w in caught]
  assert any(
      # Graph inputs are (s0, x, s1, index) under dynamic=True.
      'graph input 3 (tensor of shape (3,), torch.int64, on '
      'cpu) is not on the XLA device' in m for m in messages), messages


def test_unsupported_argument_type_error_names_the_argument():
  from torch_xla_patches.signature import ArgLayout, UnsupportedGraphInput
  with pytest.raises(UnsupportedGraphInput) as info:
    ArgLayout.from_graph(None, [xla(torch.randn(2)), 'cats'])
  assert str(info.value) == (
      "graph input 1 (str 'cats') has a type the XLA dynamo bridge cannot "
      'handle; graph inputs must be XLA tensors, ints, floats or bools.')


def test_signature_cap_drops_least_recently_used(monkeypatch, caplog):
  monkeypatch.setattr(config, 'max_signatures_per_graph', 2)

  def fn(x):
    return x + 1

  compiled = compile_dynamic(fn)
  with caplog.at_level(logging.WARNING, logger='torch_xla_patches'):
    for n in [2, 3, 4, 5]:
      x = torch.randn(n)
      torch.testing.assert_close(compiled(xla(x)).cpu(), x + 1)
  cap_warnings = [
      r for r in caplog.records if r.name == 'torch_xla_patches.bridge' and
      'more than 2 shape signatures' in r.getMessage()
  ]
  assert len(cap_warnings) == 1
  assert counters()['DynamoSignatureDropped'] == 2
  (cache,) = [c for c in signature_cache.live_signature_caches() if c.entries
             ][-1:]
  assert [dict(s.shape_values) for s in cache.signatures()] == [{0: 4}, {0: 5}]
  # A dropped signature is traced again, not an error.
  compiled(xla(torch.randn(2)))
  assert counters()['DynamoSignatureMiss'] == 5


def test_explain_misses_names_the_part_that_differed(monkeypatch, caplog):
  monkeypatch.setattr(config, 'explain_misses', True)
  compiled = compile_dynamic(lambda x: x * 2)
  with caplog.at_level(logging.INFO, logger='torch_xla_patches'):
    compiled(xla(torch.randn(3, 2)))
    compiled(xla(torch.randn(5, 2)))
  lines = [
      r.getMessage()
      for r in caplog.records
      if r.name == 'torch_xla_patches.bridge'
  ]
  assert len(lines) == 2
  assert lines[0].endswith('new shape signature (first of this graph)')
  assert 'closest known differs in: shape_values[input 0]: 3 -> 5' in lines[1]
  # Inputs are (s0, s1, x): both sizes are symbolic under dynamic=True.
  assert 'tensor_shapes[input 2]: (3, 2) -> (5, 2)' in lines[1]
  assert 'input 1' not in lines[1]


if __name__ == '__main__':
  sys.exit(pytest.main([__file__, '-q']))


class Double(torch.nn.Module):

  def forward(self, x):
    return x * 2


@pytest.mark.parametrize('front_end', ['torch.compile', 'serve'])
def test_a_call_leaves_the_readers_of_an_input_updated_in_place(front_end):
  # See [Note: Syncs that alias nothing] in execution.py: the call syncs its
  # input's pending update; the reader made before the update keeps the
  # input's old buffer. With torch_xla's aliasing sync the reader's read
  # failed ("buffer with shape f32[4] ... is deleted").
  if front_end == 'serve':
    from torch_xla_patches import TensorSpec
    call = torch_xla_patches.serve(Double().to(torch_xla.device()),
                                   [(TensorSpec((4,)),)])
  else:
    call = compile_dynamic(Double())
  for step in range(3):
    x = torch.full((4,), float(step), device=torch_xla.device())
    torch_xla.sync()
    reader = x + 1
    x.add_(10)
    out = call(x)
    assert reader.cpu().tolist() == [step + 1.0] * 4
    assert out.cpu().tolist() == [2 * (step + 10.0)] * 4
    assert x.cpu().tolist() == [step + 10.0] * 4
