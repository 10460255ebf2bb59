"""Flags of the patch set. Each reads an environment variable once at import;
tests and users may also assign the attributes directly."""
import os


def _env_int(name: str, default: int) -> int:
  value = os.environ.get(name)
  if value is None or value == '':
    return default
  try:
    return int(value)
  except ValueError:
    raise ValueError(f'{name} must be an integer, got {value!r}') from None


def _env_bool(name: str, default: bool) -> bool:
  value = os.environ.get(name)
  if value is None or value == '':
    return default
  return value.strip().lower() in ('1', 'true', 'yes', 'on')


# Most shape signatures kept per graph. Past it, the least recently used
# signature is dropped (its XLA program may stay in XLA's own cache) and a
# warning is printed once per graph. 0 means no cap.
max_signatures_per_graph = _env_int('XLA_PATCHES_MAX_SIGNATURES', 1024)

# Print, for every signature miss after the first trace of a graph, which part
# of the signature differed from the closest known signature.
explain_misses = _env_bool('XLA_PATCHES_EXPLAIN_MISSES', False)

# torch_xla turns off dynamo's automatic dynamic shapes at import
# (pytorch/xla#5285). With the patched bridge a dynamic graph is cheap per
# shape, so apply() turns it back on: the default mode of torch.compile then
# traces at most twice (static, then dynamic). revert() restores torch_xla's
# setting.
automatic_dynamic_shapes = _env_bool('XLA_PATCHES_AUTOMATIC_DYNAMIC', True)

# Install SymInt-safe tracing rules for XLA kernels that break dynamic tracing
# (see decompositions.py).
install_decompositions = _env_bool('XLA_PATCHES_DECOMPOSITIONS', True)

# Directory of the persistent signature index (see persistent.py); None: off.
cache_dir = os.environ.get('XLA_PATCHES_CACHE_DIR') or None

# What a new process does with the signatures the index recorded for a graph:
#   sync         compile them all when dynamo first hands the graph over, so
#                no later request waits for a compile it could have skipped;
#   interleaved  compile one after each served call until none are left;
#   off          record only.
precompile_mode = os.environ.get('XLA_PATCHES_PRECOMPILE', 'sync')

# Print why a graph's fingerprint found no index file (which parts differ
# from the closest recorded graph).
explain_cache = _env_bool('XLA_PATCHES_EXPLAIN_CACHE', False)

# Also ask torch_xla to persist compiled executables (xr.initialize_cache) in
# <cache_dir>/xla. torch_xla 2.9 cannot load them back on CPU (and, per
# pytorch/xla#9094, on TPU); the bridge detects that and says so once.
persistent_executables = _env_bool('XLA_PATCHES_PERSISTENT_EXECUTABLES', False)

PRECOMPILE_MODES = ('sync', 'interleaved', 'off')

# Print a progress line per signature compiled from the index.
precompile_progress = _env_bool('XLA_PATCHES_PRECOMPILE_PROGRESS', True)

# dynamo compiles symbolic-shape guards to C++ by default, which runs a C++
# compiler on the first call of every dynamic graph: on the 2-core CPU machine
# it took a 4-layer LM's first call from 4.6 s to 12.3 s, with no per-call
# gain we could measure (tools/bench_warmup.py, tools/bench_dispatch.py).
# apply() turns it off unless this is set; revert() restores torch's value.
cpp_symbolic_shape_guards = _env_bool('XLA_PATCHES_CPP_SYMBOLIC_GUARDS', False)
