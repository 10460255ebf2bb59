"""serve() for the models people serve: keyword and nested arguments,
decorated forwards, Hugging Face families, the ServeKey, and the guards an
artifact keeps."""
import os

import pytest
import torch
import torch_xla

import torch_xla_patches
import hf_models
import served_modules
from bridge_testing import cpu_and_xla, run_reports
from torch_xla_patches import CallSpec, TensorSpec, call_spec, config
from torch_xla_patches import serving

TEST_DIR = os.path.dirname(os.path.abspath(__file__))


def xla(tensor):
  return tensor.to(torch_xla.device())


def test_call_key_follows_the_whole_structure():
  a, b = torch.zeros(2, 3), torch.ones(2, 3)
  key, leaves = call_spec.call_key((a, [b, None]), {'scale': 0.5, 'n': 3})
  assert leaves == [a, b, None, 3, 0.5]
  # Keyword order is not part of the key; values and structure are.
  assert call_spec.call_key((a, [b, None]), {'n': 3, 'scale': 0.5})[0] == key
  for other in [((a, [b, None]), {
      'scale': 0.25,
      'n': 3
  }), ((a, (b, None)), {
      'scale': 0.5,
      'n': 3
  }), ((a, [b]), {
      'scale': 0.5,
      'n': 3
  }), ((a, [torch.ones(3, 3), None]), {
      'scale': 0.5,
      'n': 3
  }), ((a, [b.long(), None]), {
      'scale': 0.5,
      'n': 3
  })]:
    assert call_spec.call_key(*other)[0] != key, other
  # One tensor passed twice, or a container the walk does not know: no key.
  assert call_spec.call_key((a, a), {})[0] is None
  assert call_spec.call_key((a, {1, 2}), {})[0] is None


def test_call_spec_layout_materialize_and_errors():
  spec = CallSpec(TensorSpec((2, 8), torch.long), [TensorSpec((4, 16))] * 2,
                  scale=0.5,
                  position=3)
  assert call_spec.describe_layout(spec.layout()) == (
      '(int64[rank 2], [float32[rank 2], float32[rank 2]], position=int, '
      'scale=0.5)')
  # An int may vary between buckets; a float constant may not.
  assert CallSpec(TensorSpec((4, 8), torch.long), [TensorSpec((1, 16))] * 2,
                  scale=0.5,
                  position=9).layout() == spec.layout()
  assert CallSpec(TensorSpec((4, 8), torch.long), [TensorSpec((1, 16))] * 2,
                  scale=1.0,
                  position=3).layout() != spec.layout()
  args, kwargs = spec.materialize('cpu')
  assert [tuple(t.shape) for t in args[1]] == [(4, 16), (4, 16)]
  assert kwargs == {'scale': 0.5, 'position': 3}
  assert CallSpec.of((TensorSpec((2,)),)) == CallSpec(TensorSpec((2,)))
  with pytest.raises(call_spec.CallStructureError,
                     match=r"argument 'caches'\[1\] is Tensor"):
    CallSpec(caches=[TensorSpec((2,)), torch.zeros(2)])
  with pytest.raises(call_spec.CallStructureError, match='dict key 1'):
    CallSpec({1: TensorSpec((2,))})


def test_keyword_binding_makes_positional_and_keyword_calls_one():
  bind = call_spec.KeywordBinding(served_modules.Decorated().forward)
  x, m = torch.zeros(2), torch.ones(2)
  expected = ((), {'x': x, 'mask': m, 'scale': 2.0})
  assert bind((x, m), {'scale': 2.0}) == expected
  assert bind((), {'scale': 2.0, 'mask': m, 'x': x}) == expected
  # A call the signature does not bind is left for the model to refuse.
  assert bind((x, m, m), {}) == ((x, m, m), {})


def test_serve_key_tells_configurations_apart():
  small = served_modules.Decorated(width=48)
  large = served_modules.Decorated(width=64)
  buckets = [CallSpec(TensorSpec((2, 48)))]
  small_key = serving.serve_key(small, buckets)
  assert serving.serve_key(served_modules.Decorated(width=48),
                           buckets).digest() == small_key.digest()
  large_key = serving.serve_key(large, buckets)
  assert large_key.digest() != small_key.digest()
  differences = large_key.differences(small_key.parts())
  assert [d.split(':')[0] for d in differences] == ['state', 'configuration']
  assert 'proj.weight ["parameter","float32",[48,48]] -> ' \
         '["parameter","float32",[64,64]]' in differences[0], differences
  assert differences[1] == ('configuration: proj.in_features 48 -> 64; '
                            'proj.out_features 48 -> 64; width 48 -> 64')
  other_args = serving.serve_key(small,
                                 [CallSpec(TensorSpec((2, 48)), scale=2.0)])
  assert [d.split(':')[0] for d in other_args.differences(small_key.parts())
         ] == ['arguments']
  assert small_key.differences(None) == [
      'the artifact has no serve key (written by another format)'
  ]


def _decorated_models(width=16, module=served_modules.Decorated):
  return cpu_and_xla(lambda: module(width).eval())


# Any decorator: one that says what it wraps (functools.wraps, as Hugging
# Face's do) binds calls to the inner forward's names; one that does not is
# served as called.
@pytest.mark.parametrize(
    'module', [served_modules.Decorated, served_modules.BareDecorated])
def test_decorated_forward_served_positionally_and_with_keywords(
    patched_bridge, module):
  cpu, model = _decorated_models(module=module)
  buckets = [
      CallSpec(TensorSpec((b, 16)), mask=TensorSpec((b, 16)), scale=0.5)
      for b in (2, 4)
  ]
  served = torch_xla_patches.serve(model, buckets)
  for batch in (2, 4, 3, 2):
    x, m = torch.randn(batch, 16), (torch.rand(batch, 16) > 0.5).float()
    with torch.no_grad():
      expected = cpu(x, m, scale=0.5)
    for result in (served(xla(x), xla(m),
                          scale=0.5), served(x=xla(x), mask=xla(m), scale=0.5),
                   served(scale=0.5, mask=xla(m), x=xla(x))):
      assert sorted(result) == ['total', 'y']
      for name in result:
        torch.testing.assert_close(result[name].cpu(), expected[name])
  # Which of these calls the fast path serves: see
  # test_every_call_form_keeps_its_fast_path.


@pytest.mark.requires('torch_aot_compile')
@pytest.mark.xfail(
    strict=True,
    reason='package bug: served calls of another argument structure than the '
    'learned plan\'s (all keywords, where the buckets pass x by position) '
    'raise PlanError in ServedCalls._learn, which drops every learned run; '
    'so two call forms never both stay on the fast path, and each switch '
    'sends the other form\'s keys to the full path again (docs/fast-path.md: '
    '"full, once per key")')
def test_every_call_form_keeps_its_fast_path(patched_bridge):
  cpu, model = _decorated_models()
  served = torch_xla_patches.serve(model, [
      CallSpec(TensorSpec((b, 16)), mask=TensorSpec((b, 16)), scale=0.5)
      for b in (2, 4)
  ])
  forms = {
      'as the buckets': lambda x, m: served(x, mask=m, scale=0.5),
      'keywords': lambda x, m: served(x=x, mask=m, scale=0.5),
      'positional': lambda x, m: served(x, m, scale=0.5),
  }
  paths = []
  for form in ('as the buckets', 'keywords', 'as the buckets', 'keywords',
               'positional', 'as the buckets', 'keywords', 'positional'):
    x, m = torch.randn(4, 16), (torch.rand(4, 16) > 0.5).float()
    with torch.no_grad():
      expected = cpu(x, m, scale=0.5)
    fast = served.calls.fast_calls
    result = forms[form](xla(x), xla(m))
    for name in ('y', 'total'):
      torch.testing.assert_close(result[name].cpu(), expected[name])
    paths.append((form, 'fast' if served.calls.fast_calls > fast else 'full'))
  # Each form's first call of a batch size is full (serve() learned the
  # buckets' form), every later one fast.
  assert paths == [('as the buckets', 'fast'), ('keywords', 'full'),
                   ('as the buckets', 'fast'), ('keywords', 'fast'),
                   ('positional', 'full'), ('as the buckets', 'fast'),
                   ('keywords', 'fast'), ('positional', 'fast')]
  # Batches 2 and 4 as the buckets, 4 by keywords and by position.
  assert served.calls.learned_keys() == 4


def test_nested_list_and_static_scalars_are_served(patched_bridge):
  cpu, model = cpu_and_xla(lambda: served_modules.LayeredStep().eval())
  buckets = [
      CallSpec(TensorSpec((b, 16)), [TensorSpec((8, 16))] * 2, scale=0.5)
      for b in (2, 4)
  ]
  served = torch_xla_patches.serve(model, buckets)
  for batch, scale in [(2, 0.5), (4, 0.5), (3, 0.5), (2, 0.25), (2, 0.5)]:
    x = torch.randn(batch, 16)
    caches = [torch.randn(8, 16) for _ in range(2)]
    with torch.no_grad():
      expected = cpu(x, caches, scale=scale)
    result = served(xla(x), [xla(c) for c in caches], scale=scale)
    torch.testing.assert_close(result[0].cpu(), expected[0])
    assert len(result[1]) == 2
    for ours, theirs in zip(result[1], expected[1]):
      torch.testing.assert_close(ours.cpu(), theirs)


@pytest.mark.requires('torch_aot_compile')
def test_a_global_flag_is_guarded_after_capture_and_restart(
    patched_bridge, monkeypatch, tmp_path):
  cpu, model = _decorated_models()
  buckets = [CallSpec(TensorSpec((2, 16)))]
  served = torch_xla_patches.serve(model, buckets, cache_dir=str(tmp_path))
  x = torch.randn(2, 16)
  loaded = torch_xla_patches.serve(model, buckets, cache_dir=str(tmp_path))
  assert (served.loaded, loaded.loaded) == (False, True)
  # Captured with the call bound to the forward's parameter names.
  for compiled in (served.compiled, loaded.compiled):
    assert compiled.guard_check(x=xla(x))
  monkeypatch.setattr(served_modules, 'DOUBLE', True)
  for compiled in (served.compiled, loaded.compiled):
    assert not compiled.guard_check(x=xla(x))
    assert 'DOUBLE' in compiled.guard_failure(x=xla(x))
  # The fast path does not read the flag; XLA_PATCHES_SERVE_VERIFY finds it.
  monkeypatch.setattr(config, 'serve_verify', True)
  with torch.no_grad():
    expected = cpu(x)
  torch.testing.assert_close(loaded(xla(x))['y'].cpu(), expected['y'])


@pytest.mark.parametrize('family', sorted(hf_models.FAMILIES))
def test_hugging_face_family_served_with_keywords(patched_bridge, family):
  cpu, model = hf_models.build(family)
  constant = hf_models.extra_kwargs(family)
  buckets = [
      CallSpec(input_ids=TensorSpec((b, s), torch.long),
               attention_mask=TensorSpec((b, s), torch.long),
               **constant) for b in (2, 4) for s in (8, 16)
  ]
  served = torch_xla_patches.serve(model, buckets)
  if served.calls is not None:
    # Captured, not served through torch.compile's fallback.
    assert served.compiled.module_call
  torch.manual_seed(1)
  for batch, seq in [(2, 8), (4, 16), (3, 5)]:
    ids = torch.randint(0, 64, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :2] = 0
    with torch.no_grad():
      expected = cpu(input_ids=ids, attention_mask=mask, **constant)
    # input_ids by position (a decoder's second parameter is its cache).
    for result in (served(input_ids=xla(ids),
                          attention_mask=xla(mask),
                          **constant),
                   served(xla(ids), attention_mask=xla(mask), **constant)):
      assert type(result) is type(expected)
      torch.testing.assert_close(result[0].cpu(),
                                 expected[0],
                                 rtol=1e-4,
                                 atol=1e-4)


RESTART_SCRIPT = '''
import json, sys
sys.path.insert(0, {test_dir!r})
import torch, torch_xla
from torch._dynamo.utils import counters
import torch_xla_patches, hf_models, served_modules
from torch_xla_patches import CallSpec, TensorSpec
device = torch_xla.device()
cache_dir = {cache_dir!r}
report = {{}}

def check(name, cpu, served, calls):
  worst = 0.0
  for args, kwargs in calls:
    with torch.no_grad():
      expected = cpu(*args, **kwargs)
    moved = torch.utils._pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
        (args, kwargs))
    result = served(*moved[0], **moved[1])
    ours = torch.utils._pytree.tree_leaves(result)
    theirs = torch.utils._pytree.tree_leaves(expected)
    assert len(ours) == len(theirs), name
    for a, b in zip(ours, theirs):
      worst = max(worst, (a.cpu() - b).abs().max().item())
  report[name] = dict(loaded=served.loaded, error=worst,
                      fast=served.calls.fast_calls)

frames = counters['stats']['unique_graphs']
cpu, model = hf_models.build('llama')
served = torch_xla_patches.serve(model, [
    CallSpec(input_ids=TensorSpec((b, 8), torch.long),
             attention_mask=TensorSpec((b, 8), torch.long), use_cache=False)
    for b in (2, 4)], cache_dir=cache_dir)
ids = torch.randint(0, 64, (4, 8))
mask = torch.ones(4, 8, dtype=torch.long)
check('llama', cpu, served, [((ids,), dict(attention_mask=mask,
                                          use_cache=False))] * 2 +
      [((ids[:3, :5], mask[:3, :5]), dict(use_cache=False))])
cpu, model = hf_models.build('bert')
served = torch_xla_patches.serve(model, [
    (TensorSpec((b, 8), torch.long), TensorSpec((b, 8), torch.long))
    for b in (2, 4)], cache_dir=cache_dir)
check('bert', cpu, served, [((ids, mask), {{}})] * 2)
torch.manual_seed(0)
cpu = served_modules.LayeredStep().eval()
model = served_modules.LayeredStep().eval()
model.load_state_dict(cpu.state_dict())
served = torch_xla_patches.serve(model.to(device), [
    CallSpec(TensorSpec((b, 16)), [TensorSpec((8, 16))] * 2, scale=0.5)
    for b in (2, 4)], cache_dir=cache_dir)
caches = [torch.randn(8, 16) for _ in range(2)]
check('nested', cpu, served,
      [((torch.randn(4, 16), caches), dict(scale=0.5))] * 3)
for width in (48, 64):
  torch.manual_seed(0)
  cpu = served_modules.Decorated(width).eval()
  model = served_modules.Decorated(width).eval()
  model.load_state_dict(cpu.state_dict())
  served = torch_xla_patches.serve(model.to(device), [
      CallSpec(TensorSpec((b, width)), mask=TensorSpec((b, width)))
      for b in (2, 4)], cache_dir=cache_dir)
  x = torch.randn(4, width)
  check(f'width {{width}}', cpu, served, [((x, torch.ones(4, width)), {{}})] * 3)
report['frames'] = counters['stats']['unique_graphs'] - frames
print(json.dumps(report), flush=True)
'''


@pytest.mark.requires('torch_aot_compile')
def test_restarts_load_each_models_own_artifact(tmp_path):
  cache_dir = str(tmp_path / 'cache')
  script = RESTART_SCRIPT.format(test_dir=TEST_DIR, cache_dir=cache_dir)
  reports = run_reports(script)
  first, restart = reports
  models = ['llama', 'bert', 'nested', 'width 48', 'width 64']
  assert [first[m]['loaded'] for m in models] == [False] * 5
  assert [restart[m]['loaded'] for m in models] == [True] * 5
  # One capture per model in the first process, none after the restart.
  assert (first['frames'], restart['frames']) == (5, 0)
  for report in (first, restart):
    for name in models:
      assert report[name]['error'] < 1e-4, (name, report)
  # Two configurations of one class keep one artifact each, on the fast
  # path after the restart; so does the nested step. Every first call of a
  # key takes the full path and learns it (the warm-up compiles without
  # running), the later ones are fast.
  assert [[report[name]['fast']
           for name in ('width 48', 'width 64', 'nested')]
          for report in reports] == [[2, 2, 2]] * 2, reports
  names = sorted(os.listdir(os.path.join(cache_dir, 'serve')))
  assert len([n for n in names if n.startswith('Decorated-')]) == 2, names
