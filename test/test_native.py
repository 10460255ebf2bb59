"""The native fast path (torch_xla_patches/native.py, csrc/fast_path.cpp):
it builds and loads, each function gives its Python twin's answers, and no
build or library state can fail a call.

The comparisons with the twins need the module built (`make setup` builds
it; else `torch-xla-patches-native`): without it they skip, saying why,
rather than compare the twins with themselves, and where a compiler and
ninja are at hand a module that is not loaded is a failure.
"""
import contextlib
import ctypes
import logging
import os
import shutil
import sys
import time
import warnings

import pytest
import torch
import torch_xla
from hypothesis import given, strategies as st

from torch_xla_patches import call_plan, call_spec, config, donation, fast_dispatch
from torch_xla_patches import native

pytestmark = pytest.mark.skipif(
    not config.native_fast_path,
    reason='XLA_PATCHES_NATIVE=0: the suite runs the Python twins only')


def nested_tensor():
  """A tensor without sizes or strides."""
  with warnings.catch_warnings():
    # The nested tensor API's prototype warning.
    warnings.simplefilter('ignore', UserWarning)
    return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])


@contextlib.contextmanager
def python_twin():
  """The Python twins for the block (a fixture would not reset between
  hypothesis examples)."""
  config.native_fast_path = False
  try:
    yield
  finally:
    config.native_fast_path = True


def can_build() -> bool:
  """Whether native.build() has what it needs here."""
  path = os.pathsep.join(
      [os.path.dirname(sys.executable),
       os.environ.get('PATH', os.defpath)])
  return (shutil.which(os.environ.get('CXX', 'c++')) is not None and
          shutil.which('ninja', path=path) is not None)


@pytest.fixture(scope='module')
def native_module():
  """The loaded native module; the test skips where it is not built."""
  module = native.helpers()
  if module is None:
    pytest.skip('the native module is not built, so there is nothing to hold '
                f'its Python twins to ({native.unavailable_reason})')
  return module


def test_the_module_is_built_for_this_torch_and_loaded():
  module = native.helpers()
  if module is None:
    if not can_build():
      pytest.skip('no C++ compiler or ninja here to build the native module '
                  f'({native.unavailable_reason})')
    pytest.fail('a C++ compiler and ninja are here, but the native module is '
                f'not loaded: {native.unavailable_reason}')
  assert native.loaded() is module
  path = native.library_path()
  assert os.path.exists(path)
  assert f'torch-{torch.__version__}-' in path
  with python_twin():
    assert native.loaded() is None


# -- the call key

# A tensor leaf: (shape, dtype, device, requires_grad, parameter).
tensor_specs = st.tuples(
    st.sampled_from([(2, 3), (3,), (3, 2), (), (1, 3)]),
    st.sampled_from([torch.float32, torch.int64, torch.bfloat16]),
    st.sampled_from(['cpu', 'xla']), st.booleans(), st.booleans())


class Unkeyable:
  """A leaf the key does not know (no __dict__: no object argument)."""
  __slots__ = ()


class Holder:
  """An object argument: attributes holding tensors and constants (see
  [Note: Objects in a call] in call_spec.py)."""


class OtherHolder:
  """An object argument of another class."""


constants = st.one_of(st.integers(-3, 3), st.booleans(),
                      st.sampled_from([0.5, 1.0, -2.0]),
                      st.sampled_from(['a', 'b', '']), st.none())
leaf_specs = st.one_of(
    tensor_specs.map(lambda spec: ('tensor', spec)),
    constants.map(lambda value: ('constant', value)),
    st.just(
        ('unkeyable', None)) | constants.map(lambda value: ('constant', value)))
structures = st.recursive(
    leaf_specs,
    lambda children: st.one_of(
        st.lists(children, max_size=3).map(lambda items: ('list', items)),
        st.lists(children, max_size=3).map(lambda items: ('tuple', items)),
        st.dictionaries(st.sampled_from(['k', 'v', 'w']), children, max_size=3).
        map(lambda items: ('dict', items)),
        st.tuples(
            st.sampled_from([Holder, OtherHolder]),
            st.dictionaries(st.sampled_from(['keys', 'values', 'length']),
                            children,
                            max_size=3)).map(lambda item: ('object', item))),
    max_leaves=6)
calls = st.tuples(
    st.lists(structures, max_size=3),
    st.dictionaries(st.sampled_from(['caches', 'positions', 'scale']),
                    structures,
                    max_size=3))


def make(structure):
  """The value a structure spec describes, with new tensors."""
  kind, content = structure
  if kind == 'tensor':
    shape, dtype, device, requires_grad, parameter = content
    device = torch_xla.device() if device == 'xla' else 'cpu'
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    if parameter and dtype != torch.int64:
      return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad and dtype != torch.int64)
  if kind == 'constant':
    return content
  if kind == 'unkeyable':
    return Unkeyable()
  if kind == 'dict':
    return {name: make(item) for name, item in content.items()}
  if kind == 'object':
    holder_class, attributes = content
    holder = holder_class()
    for name, item in attributes.items():
      setattr(holder, name, make(item))
    return holder
  items = [make(item) for item in content]
  return tuple(items) if kind == 'tuple' else items


def make_call(spec):
  args, kwargs = spec
  return tuple(make(item) for item in args), {
      name: make(item) for name, item in kwargs.items()
  }


def both_keys(args, kwargs):
  assert native.loaded() is not None
  native_key, native_leaves = call_spec.call_key(args, kwargs)
  with python_twin():
    python_key, python_leaves = call_spec.call_key(args, kwargs)
  assert (native_key is None) == (python_key is None)
  if native_key is not None:
    assert len(native_leaves) == len(python_leaves)
    for ours, theirs in zip(native_leaves, python_leaves):
      assert ours is theirs or (type(ours) is type(theirs) and ours == theirs)
    hash(native_key)
  return native_key, python_key


@given(calls, calls)
def test_native_keys_are_equal_exactly_where_python_keys_are(
    native_module, first, second):
  one_key, one_python = both_keys(*make_call(first))
  # The same call with new tensors: the same key.
  again_key, again_python = both_keys(*make_call(first))
  assert (one_key == again_key) == (one_python == again_python)
  if one_key is not None:
    assert one_key == again_key
  other_key, other_python = both_keys(*make_call(second))
  assert (one_key == other_key) == (one_python == other_python)


def test_native_keys_tell_apart_what_python_keys_do(native_module):
  a = torch.zeros(2, 3)
  cases = [
      ((a,), {}),
      ((a.long(),), {}),
      ((torch.zeros(3, 2),), {}),
      ((torch.zeros(2, 3, device=torch_xla.device()),), {}),
      ((torch.zeros(2, 3).requires_grad_(),), {}),
      ((torch.nn.Parameter(torch.zeros(2, 3)),), {}),
      ((a, 1), {}),
      ((a, True), {}),
      ((a, 1.0), {}),
      ((a, [1]), {}),
      ((a, (1,)), {}),
      ((a,), {
          'n': 1
      }),
      ((a,), {
          'm': 1
      }),
      ((a, {
          'x': 1,
          'y': 2
      }), {}),
      ((a, {
          'y': 2,
          'x': 1
      }), {}),
  ]
  keys = [both_keys(*case) for case in cases]
  for i, (native_i, python_i) in enumerate(keys):
    for j, (native_j, python_j) in enumerate(keys):
      assert (native_i == native_j) == (python_i == python_j) == (i == j), (
          cases[i], cases[j])
  # Keyword order is not part of either key; a repeated tensor has none.
  b = torch.ones(2)
  assert (call_spec.call_key((), {
      'x': a,
      'y': b
  })[0] == call_spec.call_key((), {
      'y': b,
      'x': a
  })[0])
  assert both_keys((a, [a]), {}) == (None, None)
  # A structure too deep to key, or a cycle, has no key either.
  deep, cyclic = [a], [a]
  for _ in range(64):
    deep = [deep]
  cyclic.append(cyclic)
  assert both_keys((deep,), {}) == (None, None)
  assert both_keys((deep[0][0],), {})[0] is not None
  assert both_keys((cyclic,), {}) == (None, None)

  # An object argument is keyed by its class, its attributes' names and
  # values; another object of the same layout has the same key, and its
  # tensors are the leaves.

  def holder(kind=Holder, **attributes):
    made = kind()
    made.__dict__.update(attributes)
    return made

  one = holder(keys=a, length=1, device=a.device, dtype=a.dtype)
  same = holder(keys=torch.ones(2, 3), length=1, device=a.device, dtype=a.dtype)
  assert both_keys((one,), {})[0] == both_keys((same,), {})[0]
  assert call_spec.call_key((same,), {})[1][:2] == [same, same.keys]
  with python_twin():
    assert call_spec.call_key((same,), {})[1][:2] == [same, same.keys]
  others = [
      holder(keys=torch.ones(3, 2), length=1, device=a.device, dtype=a.dtype),
      holder(keys=a, length=2, device=a.device, dtype=a.dtype),
      holder(keys=a, length=1, device=torch.device('cpu', 1), dtype=a.dtype),
      holder(keys=a, length=1, device=a.device, dtype=torch.int64),
      holder(OtherHolder, keys=a, length=1, device=a.device, dtype=a.dtype),
      holder(length=1, keys=a, device=a.device, dtype=a.dtype),
  ]
  for other in others:
    native_other, python_other = both_keys((other,), {})
    assert native_other != both_keys((one,), {})[0]
    assert python_other != both_keys((one,), {})[1]
  # A module, or an object holding a tensor twice, has no key.
  assert both_keys((torch.nn.Linear(2, 2),), {}) == (None, None)
  assert both_keys((holder(keys=a, values=a),), {}) == (None, None)
  # Nor has a call with a tensor that has no sizes.
  assert both_keys((a, nested_tensor()), {}) == (None, None)
  assert both_keys((a, {1, 2}), {}) == (None, None)


def test_sharding_is_part_of_the_key():
  a = torch.zeros(2, 3)
  specs = iter(['{devices=[2,1]0,1}', '{replicated}'])
  sharded = call_spec.call_key((a,), {}, lambda tensor: next(specs))[0]
  replicated = call_spec.call_key((a,), {}, lambda tensor: next(specs))[0]
  assert sharded != replicated

  def refuses(tensor):
    raise ValueError('no sharding here')

  with pytest.raises(ValueError, match='no sharding here'):
    call_spec.call_key((a,), {}, refuses)


# -- the bound-tensor check


def test_the_bound_tensor_check_sees_what_its_twin_sees(native_module):
  """Native and twin, the check and its `matches` (the one call a served
  call makes) give the same answers."""
  layer = torch.nn.Linear(4, 3).to(torch_xla.device())
  tensors = [layer.weight, layer.bias]
  checks = [call_plan.BoundTensorCheck(tensors)]
  with python_twin():
    checks.append(call_plan.BoundTensorCheck(tensors))

  def answers():
    return [check() for check in checks] + [check.matches() for check in checks]

  assert answers() == [True] * 4
  weight = layer.weight.data
  for data, unchanged in [(torch.ones(3, 4), True), (torch.ones(4, 3), False),
                          (torch.ones(3, 4, dtype=torch.float64), False),
                          (torch.ones(3, 5), False)]:
    layer.weight.data = data.to(torch_xla.device())
    assert answers() == [unchanged] * 4, data
  layer.weight.data = weight
  assert answers() == [True] * 4


# -- what a build or a library left behind


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
  """native.helpers() as in a new process, with its builds under tmp_path;
  the process's own module is back afterwards."""
  monkeypatch.setattr(config, 'native_dir', str(tmp_path))
  monkeypatch.setattr(native, '_tried', False)
  monkeypatch.setattr(native, '_module', None)
  monkeypatch.setattr(native, 'unavailable_reason', None)
  return tmp_path


def files_under(directory):
  return sorted(
      os.path.relpath(os.path.join(root, name), directory)
      for root, _, names in os.walk(directory)
      for name in names)


def test_a_failed_build_leaves_the_python_twins(fresh_native, monkeypatch,
                                                caplog):
  monkeypatch.setenv('CXX', 'false')
  # Not built: helpers() says so once, and builds nothing.
  with caplog.at_level(logging.WARNING, logger='torch_xla_patches.native'):
    assert native.helpers() is None
  assert native.unavailable_reason.startswith('it is not built')
  assert native.BUILD_COMMAND in caplog.text
  caplog.clear()
  assert native.helpers() is None
  assert caplog.text == ''
  assert files_under(fresh_native) == []
  # A lock that a stopped build left would hold load() for ever; it goes.
  lock = os.path.join(native.build_dir(), 'build', 'lock')
  os.makedirs(os.path.dirname(lock))
  open(lock, 'w').close()
  stale = time.time() - native.BUILD_TIMEOUT_SECONDS - 60
  os.utime(lock, (stale, stale))
  with pytest.raises(native.BuildError, match='load\\(\\) failed'):
    native.build(timeout=300)
  assert not os.path.exists(lock)
  # No library where helpers() looks, so the Python twins serve: the key
  # has their form.
  assert not os.path.exists(native.library_path())
  a = torch.zeros(2, 3)
  assert call_spec.call_key((a,), {})[0] == (a.shape, a.dtype, a.device, False)


def test_a_damaged_library_is_left_and_built_again(fresh_native):
  # A file cut short where the library goes (a process loads a library once
  # by its path, so this one must not have loaded it before).
  path = native.library_path()
  assert path.startswith(str(fresh_native))
  assert f'torch-{torch.__version__}-' in path
  os.makedirs(os.path.dirname(path))
  with open(path, 'wb') as f:
    f.write(b'\x7fELF cut short')
  assert native.helpers() is None
  assert 'does not load' in native.unavailable_reason
  assert native.BUILD_COMMAND in native.unavailable_reason
  # The build step replaces it with one that loads.
  assert native.ensure_built() == path
  with open(path, 'rb') as f:
    assert f.read(16) != b'\x7fELF cut short'
  native.reset()
  module = native.helpers()
  assert module is not None, native.unavailable_reason
  a = torch.zeros(2, 3)
  assert module.call_key((a,), {}, None, call_spec._OBJECT_KEYING)[1] == [a]


# What the data ledger says of a tensor about to be donated, and whether its
# data id names an IR node -> the decision (see [Note: Donating in-place
# updates]): 'read' is a private copy for the run, 'unknown' a sync of the
# device's pending IR first.
DONATION_DECISIONS = {
    # Data the caller set, which the ledger does not vouch for: copied.
    ('nothing', False):
        'read',
    ('nothing', True):
        'read',
    ('given', False):
        'given',
    # Given data that came with an IR node of its own (SPMD's results).
    ('given', True):
        'unknown',
    ('read', False):
        'read',
    ('read', True):
        'read',
    ('other data given', False):
        'read',
    ('other data given', True):
        'read',
}


@pytest.mark.parametrize('ledger_entry, has_ir', DONATION_DECISIONS)
@pytest.mark.parametrize('implementation', ['native', 'python twin'])
def test_read_donations_decides_as_the_note_says(request, monkeypatch,
                                                 ledger_entry, has_ir,
                                                 implementation):
  tensor = torch.zeros(2, device=torch_xla.device())
  data_id = '1234, 0' if has_ir else '1234'
  key = torch_xla._XLAC._xla_get_tensor_id(tensor)
  entries = {
      'given': (data_id, True),
      'read': (data_id, False),
      'other data given': ('5678', True),
  }
  ledger = {key: entries[ledger_entry]} if ledger_entry in entries else {}
  if implementation == 'native':
    module = request.getfixturevalue('native_module')
    read, sync_readers = module.read_donations([tensor], [data_id], [True],
                                               ledger)
  else:
    monkeypatch.setattr(donation, '_known_data', ledger)
    given = donation.given_data(tensor, data_id)
    read = [0] if given is False else []
    sync_readers = given is None
  decision = ('read' if read else 'unknown' if sync_readers else 'given')
  assert decision == DONATION_DECISIONS[(ledger_entry, has_ir)]
  # The run about to take the buffer over gives the tensor new data.
  assert ledger == {}


def test_take_results_and_read_donations_take_lists_of_tensors(native_module):
  module = native_module
  with pytest.raises(TypeError, match='take_results'):
    module.take_results([torch.zeros(1)], [], True, {}, 8)
  with pytest.raises(TypeError, match='take_results'):
    module.take_results([1], [torch.zeros(1)], True, {}, 8)
  with pytest.raises(TypeError, match='read_donations'):
    module.read_donations((torch.zeros(1),), None, [True], {})
  with pytest.raises(TypeError, match='one item per tensor'):
    module.read_donations([torch.zeros(1)], None, [], {})
  with pytest.raises(TypeError, match='one item per tensor'):
    module.read_donations([torch.zeros(1)], ['1', '2'], [True], {})
  with pytest.raises(TypeError, match='a data id is a str'):
    module.read_donations([torch.zeros(1)], [1], [True], {})
  # A tensor without sizes or strides never matches a concrete one.
  assert module.metadata([nested_tensor()]) != module.metadata([torch.zeros(2)])


@given(shapes=st.lists(st.lists(st.integers(1, 4), max_size=3), max_size=4),
       changed=st.integers(0, 3),
       dtype=st.sampled_from([torch.float32, torch.int64]))
def test_metadata_matches_is_metadata_equal(native_module, shapes, changed,
                                            dtype):
  """metadata_matches(tensors, packed) answers metadata(tensors) == packed:
  for the tensors packed, after a `.data` assignment changing one tensor's
  dtype or shape, and for lists one tensor shorter or longer."""
  module = native_module
  tensors = [torch.zeros(shape, dtype=dtype) for shape in shapes]
  packed = module.metadata(tensors)
  assert module.metadata_matches(tensors, packed)
  assert module.metadata_matches(tensors[:-1], packed) == (not tensors)
  assert not module.metadata_matches(tensors + [torch.zeros(1)], packed)
  if tensors:
    target = tensors[changed % len(tensors)]
    target.data = torch.zeros(target.shape + (2,), dtype=dtype)
    assert not module.metadata_matches(tensors, packed)
    assert module.metadata(tensors) != packed
    target.data = torch.zeros(target.shape[:-1], dtype=torch.float16)
    assert module.metadata_matches(
        tensors, packed) == (module.metadata(tensors) == packed)
  transposed = torch.zeros(2, 3).t()
  assert not module.metadata_matches([transposed],
                                     module.metadata([torch.zeros(3, 2)]))
  assert module.metadata_matches([nested_tensor()],
                                 module.metadata([nested_tensor()]))
  assert not module.metadata_matches([nested_tensor()],
                                     module.metadata([torch.zeros(2)]))
  with pytest.raises(TypeError, match='metadata_matches'):
    module.metadata_matches([1], packed)
  with pytest.raises(TypeError, match='metadata_matches'):
    module.metadata_matches(tensors, 'not bytes')


class _MallInfo2(ctypes.Structure):
  _fields_ = [
      (name, ctypes.c_size_t)
      for name in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks',
                   'fsmblks', 'uordblks', 'fordblks', 'keepcost')
  ]


def _bytes_in_use_reader():
  """A function giving the bytes malloc has handed out and not had back
  (glibc's mallinfo2), or None where the C library has no mallinfo2. Unlike
  resident memory, that count does not hide allocations that fill memory
  freed earlier."""
  libc = ctypes.CDLL(None)
  if not hasattr(libc, 'mallinfo2'):
    return None
  libc.mallinfo2.restype = _MallInfo2
  return lambda: libc.mallinfo2().uordblks


def test_counters_bumped_natively_are_torch_xla_counters(native_module):
  """The package's increment_counter is the native one, and its bumps are
  the counts torch_xla.debug.metrics reads and clears, whichever str object
  names the counter and whichever binding bumped it."""
  import torch_xla.debug.metrics as met
  from torch_xla_patches import counters
  assert counters.increment_counter is native_module.increment_counter
  name = 'TorchXlaPatchesTestNativeCounter'
  met.clear_counters()
  assert met.counter_value(name) is None
  counters.increment_counter(name, 3)
  assert met.counter_value(name) == 3
  counters.increment_counter(''.join(['TorchXlaPatchesTest', 'NativeCounter']),
                             2)
  torch_xla._XLAC._xla_increment_counter(name, 4)
  assert met.counter_value(name) == 9
  assert name in met.counter_names()
  met.clear_counters()
  assert met.counter_value(name) is None
  counters.increment_counter(name, 1)
  assert met.counter_value(name) == 1
  with pytest.raises(TypeError, match=r'increment_counter\(name: str'):
    native_module.increment_counter(7, 1)
  with pytest.raises(TypeError):
    native_module.increment_counter(name, 'one')
  assert met.counter_value(name) == 1


def test_a_native_bump_keeps_no_memory(native_module):
  """torch_xla's `_xla_increment_counter` keeps 64 bytes of every bump (see
  [Note: Counters made once] in csrc/fast_path.cpp); the bridge bumps a
  counter on every call, so a server would grow by that much per call."""
  in_use = _bytes_in_use_reader()
  if in_use is None:
    pytest.skip('the C library has no mallinfo2 to count allocations with')
  bumps = 100_000
  name = 'TorchXlaPatchesTestCounterMemory'
  native_module.increment_counter(name, 1)
  torch_xla._XLAC._xla_increment_counter(name, 1)
  before = in_use()
  for _ in range(bumps):
    native_module.increment_counter(name, 1)
  native_kept = in_use() - before
  before = in_use()
  for _ in range(bumps):
    torch_xla._XLAC._xla_increment_counter(name, 1)
  torch_xla_kept = in_use() - before
  import torch_xla.debug.metrics as met
  assert met.counter_value(name) == 2 * bumps + 2
  # torch_xla's keeps 64 bytes a bump; the native bumps nothing (a few
  # allocations of the interpreter's own may land in the window).
  assert torch_xla_kept >= 60 * bumps, torch_xla_kept
  assert native_kept < bumps, native_kept
