"""The names of the bridge's counters, one place for all of them.

Read them with torch_xla.debug.metrics.counter_value(name); the package bumps
them with `increment_counter` and no other way (the bridge's
`DynamoExtractCompiledGraph` line keeps upstream's spelling of it). In these
names "CPU fallback" is an op XLA does not compile, run on the CPU; serve()'s
counters of calls that took the full path are its own (fast_dispatch.py).
"""
from typing import Callable

import torch_xla

from torch_xla_patches import native

# Counters, readable with torch_xla.debug.metrics.counter_value(name), next to
# DynamoExtractCompiledGraph (one per graph handed to the bridge),
# DynamoSyncInputExecuteTime (inputs with pending IR synced before a run) and
# the runtime's CompileTime / UncachedCompile.
# A graph's first signature is compiled when dynamo hands the graph over, so
# its first call is a hit: misses count compiles, hits count calls served.
COUNTER_HIT = 'DynamoSignatureHit'  # a call found its signature's program
COUNTER_MISS = 'DynamoSignatureMiss'  # a new signature was traced + compiled
# XLA evicted a signature's program; the signature was traced again.
COUNTER_EVICTED_RETRACE = 'DynamoEvictedRetrace'
COUNTER_DROPPED = 'DynamoSignatureDropped'  # over the cap, LRU entry dropped
# A graph partitioned around CPU fallback ops.
COUNTER_CPU_FALLBACK_PARTITION = 'DynamoCpuFallbackPartition'
# A graph with CPU fallback ops that updates its inputs before its end, run
# eagerly instead (see [Note: Graphs that cannot be split] in dynamo_bridge.py).
COUNTER_CPU_FALLBACK_EAGER = 'DynamoCpuFallbackEager'
# See [Note: Donating in-place updates] in donation.py: an argument updated in
# place whose buffer the program takes over (counted once per traced signature),
# ...
COUNTER_DONATED = 'DynamoDonatedInput'
# ... one copied instead because it is a view of another tensor, or shares
# its data with another argument of the trace, ...
COUNTER_DONATION_VIEW = 'DynamoDonationSkippedView'
COUNTER_DONATION_ALIAS = 'DynamoDonationSkippedAlias'
# ... one smaller than config.donate_min_bytes, ...
COUNTER_DONATION_SMALL = 'DynamoDonationSkippedSmall'
# ... one written eagerly after the parts of a graph partitioned around CPU
# fallback ops (see [Note: Input updates in a partitioned graph] in
# graph_updates.py), ...
COUNTER_DONATION_FALLBACK = 'DynamoDonationSkippedFallback'
# ... one AOTAutograd's epilogue writes after the run (a graph that needs
# autograd), counted per traced signature, ...
COUNTER_DONATION_EPILOGUE = 'DynamoDonationSkippedEpilogue'
# ... and a call whose donated argument shares its data with another
# argument, or whose buffer something else may hold (it was read since its
# data was set, or it holds data the caller set): that argument is copied
# for the run (counted per call).
COUNTER_DONATION_COPIED = 'DynamoDonationCopiedAlias'
COUNTER_DONATION_COPIED_READ = 'DynamoDonationCopiedRead'
# A donating run that synced the device's pending IR first: under SPMD, a
# donated argument held the data a run gave it, which reads leave no trace
# on (counted per run).
COUNTER_DONATION_READERS_SYNCED = 'DynamoDonationReadersSynced'
# COUNTER_PRECOMPILED and COUNTER_PRECOMPILE_SKIPPED: see backlog.py.

# Inputs with pending IR synced before a run (upstream's name).
COUNTER_SYNCED_INPUTS = 'DynamoSyncInputExecuteTime'

# A GenerationEngine step after ready that compiled an XLA program (counted per
# compile; see [Note: Programs of the engine] in generation.py).
COUNTER_GENERATION_COMPILED_AFTER_READY = 'GenerationCompiledAfterReady'


def _counter_increment() -> Callable[[str, int], None]:
  """The native module's increment_counter where it loads, else torch_xla's
  `_xla_increment_counter`, which keeps 64 bytes of every bump for good
  (see [Note: Counters made once] in csrc/fast_path.cpp): both grow the
  counter torch_xla.debug.metrics reads."""
  helpers = native.helpers()
  if helpers is not None:
    return helpers.increment_counter
  return torch_xla._XLAC._xla_increment_counter


# increment_counter(name, value): counter `name` grows by `value`. The bridge
# bumps one on every call it serves.
increment_counter = _counter_increment()
