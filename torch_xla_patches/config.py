"""Flags of the patch set.

Each flag reads its environment variable once, at import; tests and users may
also assign the attributes directly (apply() sets the ones it is given through
its patch registry, so revert() restores them).

[Note: Flags that change programs]
Every flag is declared with `_flag(...)`, which records whether it can change
a compiled XLA program. The graph fingerprint of the signature index (see
fingerprint.py) hashes the environment variables of the flags that can, and
none of the others: turning on a diagnostic or changing a cache bound must not
hide the index a restart would find. torch_xla's own `XLA_*` variables that
never change a program are declared in `XLA_ENV_NOT_IN_PROGRAM`; every other
`XLA_*` variable is hashed. test_fingerprint.py fails when the package reads
an `XLA_PATCHES_*` variable that is not declared here.
"""
import dataclasses
import math
import os
from typing import Any, Callable, Dict, Tuple


class FlagError(ValueError):
  """A flag's value is not one it accepts; the message names the flag, the
  value and what it accepts."""


@dataclasses.dataclass(frozen=True)
class FlagKind:
  """The values a flag accepts.

  Args:
    accepted: the accepted values, for messages.
    parse: environment text -> value; raises ValueError.
    is_valid: whether a value (from the environment or apply()) is accepted.
  """
  accepted: str
  parse: Callable[[str], Any]
  is_valid: Callable[[Any], bool]


_TRUE = ('1', 'true', 'yes', 'on')
_FALSE = ('0', 'false', 'no', 'off')


def _parse_bool(text: str) -> bool:
  value = text.strip().lower()
  if value not in _TRUE + _FALSE:
    raise ValueError(text)
  return value in _TRUE


def _is_real(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


BOOL = FlagKind(', '.join(_TRUE + _FALSE), _parse_bool,
                lambda value: isinstance(value, bool))
# An int >= 0, where 0 turns the bound off.
BOUND = FlagKind('an integer >= 0 (0: no bound)', int,
                 lambda value: _is_real(value) and int(value) == value >= 0)
# A number of seconds >= 0, where 0 turns the bound off.
SECONDS_BOUND = FlagKind(
    'a number of seconds >= 0 (0: no bound)', float,
    lambda value: _is_real(value) and math.isfinite(value) and value >= 0)
SECONDS = FlagKind(
    'a number of seconds >= 0', float,
    lambda value: _is_real(value) and math.isfinite(value) and value >= 0)
# A count >= 1.
COUNT = FlagKind('an integer >= 1', int,
                 lambda value: _is_real(value) and int(value) == value >= 1)
PATH = FlagKind('a directory path', str,
                lambda value: value is None or isinstance(value, str))


def choice(*values: str) -> FlagKind:
  return FlagKind(' or '.join(repr(v) for v in values), str,
                  lambda value: value in values)


@dataclasses.dataclass(frozen=True)
class Flag:
  """A declared flag.

  Args:
    attribute: name of the attribute in this module.
    env_var: environment variable read at import.
    kind: the values it accepts.
    changes_program: whether its value can change a compiled XLA program.
  """
  attribute: str
  env_var: str
  kind: FlagKind
  changes_program: bool

  def error(self, value: Any) -> FlagError:
    return FlagError(f'{self.env_var} (config.{self.attribute}) is {value!r}; '
                     f'it accepts {self.kind.accepted}')


FLAGS: Dict[str, Flag] = {}


def _flag(attribute: str, env_var: str, default: Any, kind: FlagKind, *,
          changes_program: bool) -> Any:
  flag = Flag(attribute, env_var, kind, changes_program)
  FLAGS[env_var] = flag
  text = os.environ.get(env_var)
  if text is None or text == '':
    return default
  try:
    value = kind.parse(text)
  except ValueError:
    raise flag.error(text) from None
  if not kind.is_valid(value):
    raise flag.error(text)
  return value


def check(attribute: str, value: Any) -> None:
  """Raises FlagError unless `value` is one config.<attribute> accepts (for
  values given to apply())."""
  (flag,) = [f for f in FLAGS.values() if f.attribute == attribute]
  if not flag.kind.is_valid(value):
    raise flag.error(value)


def flag_values() -> Dict[str, Any]:
  """{attribute: current value} of every declared flag."""
  return {flag.attribute: globals()[flag.attribute] for flag in FLAGS.values()}


# Most shape signatures kept in memory per graph. Past it, the least recently
# used signature is dropped (its XLA program may stay in XLA's own cache) and
# a warning is logged once per graph. 0 means no cap.
max_signatures_per_graph = _flag('max_signatures_per_graph',
                                 'XLA_PATCHES_MAX_SIGNATURES',
                                 1024,
                                 BOUND,
                                 changes_program=False)

# Log, for every signature miss after the first trace of a graph, which part
# of the signature differed from the closest known signature.
explain_misses = _flag('explain_misses',
                       'XLA_PATCHES_EXPLAIN_MISSES',
                       False,
                       BOOL,
                       changes_program=False)

# torch_xla turns off dynamo's automatic dynamic shapes at import
# (pytorch/xla#5285). With the patched bridge a dynamic graph is cheap per
# shape, so apply() turns it back on: the default mode of torch.compile then
# traces at most twice (static, then dynamic). revert() restores torch_xla's
# setting. It decides which graphs dynamo makes, so it is part of the program.
automatic_dynamic_shapes = _flag('automatic_dynamic_shapes',
                                 'XLA_PATCHES_AUTOMATIC_DYNAMIC',
                                 True,
                                 BOOL,
                                 changes_program=True)

# Install SymInt-safe tracing rules for XLA kernels that break dynamic tracing
# (see decompositions.py). They change the lowering of symbolic-size graphs.
install_decompositions = _flag('install_decompositions',
                               'XLA_PATCHES_DECOMPOSITIONS',
                               True,
                               BOOL,
                               changes_program=True)

# Alias each argument or buffer a graph updates in place to its output
# (buffer donation), so the update happens in the argument's own buffer
# instead of a copy of it (see [Note: Donating in-place updates] in
# donation.py). A donating program is another program.
donate_inplace_updates = _flag('donate_inplace_updates',
                               'XLA_PATCHES_DONATE',
                               True,
                               BOOL,
                               changes_program=True)

# Arguments updated in place of fewer bytes than this are copied by their
# program, not donated (see [Note: Donating in-place updates] in
# donation.py): a counter the host reads between calls (a StaticCache's
# 8-byte cumulative_length, read by generate() at every step) would make
# every donating run take a private copy of it first, with a blocking sync,
# to save a copy of a few bytes. 0: donate whatever the size. It decides
# which programs donate, so it is part of the program.
donate_min_bytes = _flag('donate_min_bytes',
                         'XLA_PATCHES_DONATE_MIN_BYTES',
                         16,
                         BOUND,
                         changes_program=True)

# Directory of the signature index (see signature_index.py); None: off.
cache_dir = _flag('cache_dir',
                  'XLA_PATCHES_CACHE_DIR',
                  None,
                  PATH,
                  changes_program=False)

PRECOMPILE_MODES = ('sync', 'interleaved', 'off')

# What a new process does with the signatures the index recorded for a graph:
#   sync         compile the most served ones when dynamo first hands the
#                graph over, within replay_sync_max_signatures and
#                replay_sync_seconds; the rest one after each served call;
#   interleaved  compile one after each served call until none are left;
#   off          record only.
precompile_mode = _flag('precompile_mode',
                        'XLA_PATCHES_PRECOMPILE',
                        'sync',
                        choice(*PRECOMPILE_MODES),
                        changes_program=False)

# Bounds of the synchronous replay of a restart (precompile_mode 'sync'): at
# most this many recorded signatures, and no new one started after this many
# seconds. 0 means no bound.
replay_sync_max_signatures = _flag('replay_sync_max_signatures',
                                   'XLA_PATCHES_REPLAY_SYNC_MAX',
                                   64,
                                   BOUND,
                                   changes_program=False)
replay_sync_seconds = _flag('replay_sync_seconds',
                            'XLA_PATCHES_REPLAY_SYNC_SECONDS',
                            30.0,
                            SECONDS_BOUND,
                            changes_program=False)

# Largest total size, in bytes, of the tensors a recorded signature may make
# to be replayed. 0: automatic, the larger of 256 MiB and 8 times the bytes of
# the live call's tensor arguments (parameters included). A record over it is
# skipped: a damaged size must not allocate terabytes.
replay_max_bytes = _flag('replay_max_bytes',
                         'XLA_PATCHES_REPLAY_MAX_BYTES',
                         0,
                         BOUND,
                         changes_program=False)

# Most signatures the index keeps per graph on disk; the least served (then
# least recently served) are dropped when the index is compacted. 0: no cap.
index_max_signatures = _flag('index_max_signatures',
                             'XLA_PATCHES_INDEX_MAX_SIGNATURES',
                             1024,
                             BOUND,
                             changes_program=False)

# Seconds between two writes of a process's usage counts (how often and when
# each signature was served). They are also written at exit.
usage_flush_seconds = _flag('usage_flush_seconds',
                            'XLA_PATCHES_USAGE_FLUSH_SECONDS',
                            60.0,
                            SECONDS,
                            changes_program=False)

# Log why a graph's fingerprint found no index (which parts differ from the
# closest recorded graph).
explain_cache = _flag('explain_cache',
                      'XLA_PATCHES_EXPLAIN_CACHE',
                      False,
                      BOOL,
                      changes_program=False)

# Also ask torch_xla to persist compiled executables (xr.initialize_cache) in
# <cache_dir>/xla. torch_xla 2.9 cannot load them back (pytorch/xla#9094); the
# bridge detects that and says so once.
persistent_executables = _flag('persistent_executables',
                               'XLA_PATCHES_PERSISTENT_EXECUTABLES',
                               False,
                               BOOL,
                               changes_program=False)

# Raise, instead of counting a skip, when replaying a recorded signature
# fails in a way no check of the record explains (see [Note: Replaying
# recorded signatures]): such a failure is a bug of the replay, which a skip
# would hide. The test suite turns it on; damaged records are still skipped.
strict_replay = _flag('strict_replay',
                      'XLA_PATCHES_STRICT_REPLAY',
                      False,
                      BOOL,
                      changes_program=False)

# Log a progress line per signature compiled from the index.
precompile_progress = _flag('precompile_progress',
                            'XLA_PATCHES_PRECOMPILE_PROGRESS',
                            True,
                            BOOL,
                            changes_program=False)


def default_compile_workers() -> int:
  """Half the cores this process may run on, at most 8.

  One XLA compile on the CPU client already keeps about 1.7 cores busy, so a
  worker per two cores fills the host without oversubscribing it: on 2 cores
  that is 1 (2 workers measured 0.83x to 1.03x of the serial wall time there,
  within run-to-run noise, for 2 cores at 1.97 busy instead of 1.7). Past 8,
  the one thread that traces every signature (under the GIL) becomes the
  bottleneck, and each compile in flight holds its HLO module in memory.
  """
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    cores = os.cpu_count() or 1
  return max(1, min(8, cores // 2))


# XLA compiles that may run at once: the compile pool's workers, which
# compile the signatures of warm-ups (precompile(), serve()'s buckets, a
# restart's first call; see [Note: The compile pool] in compile_window.py),
# and the workers of a backlog drain (see [Note: Parallel compiles]); the
# calling thread traces each signature. At least one. The default is
# default_compile_workers() (1 on 2 cores).
compile_workers = _flag('compile_workers',
                        'XLA_PATCHES_COMPILE_WORKERS',
                        default_compile_workers(),
                        COUNT,
                        changes_program=False)

# Whether serve() returns only once every bucket is compiled. Off (the default),
# it returns at once (the first call captures the model) or once its artifact is
# loaded, and the buckets compile in the background (see [Note: Ready at once]
# in serving.py): a server answers health probes and compiled buckets at once.
serve_wait = _flag('serve_wait',
                   'XLA_PATCHES_SERVE_WAIT',
                   False,
                   BOOL,
                   changes_program=False)

# On a first start, serve()'s warm-up captures a bucket the captures made so
# far refuse (a decode step beside a prompt) only once the first request is
# answered, or, with no request in flight, this many seconds after its other
# buckets are compiled; on a restart, it compiles any bucket only then, the
# seconds counted from serve()'s return (see [Note: Captures after the first
# request] in warmup.py): a first request never waits behind another
# bucket's capture or compile.
serve_capture_delay = _flag('serve_capture_delay',
                            'XLA_PATCHES_SERVE_CAPTURE_DELAY',
                            2.0,
                            SECONDS,
                            changes_program=False)

# The fast path of a served call (fast_dispatch.py) checks what can change
# cheaply and skips dynamo's guards. With this set, each fast call also runs
# dynamo's guards, and a call they refuse is counted (ServeVerifyMismatch),
# reported and served by the full path: a mode for finding a change the fast
# path cannot see (docs/fast-path.md, "What the fast path checks").
serve_verify = _flag('serve_verify',
                     'XLA_PATCHES_SERVE_VERIFY',
                     False,
                     BOOL,
                     changes_program=False)

# Each fast call checks that every parameter and buffer its program binds
# keeps its dtype, device, shape and strides (a `.data` assignment changes
# them behind the same object, where no hook and no guard of dynamo sees
# it): one C++ check, about 0.12 us per bound tensor. Off, such a change
# goes unseen, as it does for torch.compile (docs/fast-path.md, "What the
# fast path checks").
serve_check_bound_tensors = _flag('serve_check_bound_tensors',
                                  'XLA_PATCHES_SERVE_CHECK_TENSORS',
                                  True,
                                  BOOL,
                                  changes_program=False)

# The served call's per-call work in C++ (native.py, csrc/fast_path.cpp),
# compiled once per torch release with the machine's C++ compiler. Off, or
# where it cannot be built, the Python twins run: the same answers, with more
# host time per served call (docs/fast-path.md, "The native fast path"), and
# counters bumped through torch_xla's binding, which keeps 64 bytes of host
# memory per bump (docs/observability.md). Read for the counters when
# counters.py is first imported (by apply() or the bridge), at apply() and
# serve() for the rest.
native_fast_path = _flag('native_fast_path',
                         'XLA_PATCHES_NATIVE',
                         True,
                         BOOL,
                         changes_program=False)

# Where the native module is built (see native.py); None:
# ~/.cache/torch_xla_patches/native (or under $XDG_CACHE_HOME).
native_dir = _flag('native_dir',
                   'XLA_PATCHES_NATIVE_DIR',
                   None,
                   PATH,
                   changes_program=False)

# dynamo compiles symbolic-shape guards to C++ by default, which runs a C++
# compiler on the first call of every dynamic graph, with no per-call gain the
# benchmarks could measure (docs/torch-compile.md). apply() turns it off
# unless this is set; revert() restores torch's value. Guards do not change
# the XLA program.
cpp_symbolic_shape_guards = _flag('cpp_symbolic_shape_guards',
                                  'XLA_PATCHES_CPP_SYMBOLIC_GUARDS',
                                  False,
                                  BOOL,
                                  changes_program=False)

# Traces that run nothing are made on placeholders (device data with a shape
# and no buffer, see [Note: Placeholder tensors] in io_utils.py): a warm-up's
# bucket tensors, which then cost no device memory, and a new signature's
# arguments, so that it is traced and compiled without execution_lock while
# other calls run, a decode step that donates its cache included (see [Note:
# Traces on placeholders] in placeholder_trace.py). Off: warm-ups trace on zeros
# and a new signature on its arguments, under the lock. The programs are the
# same either way.
trace_on_placeholders = _flag('trace_on_placeholders',
                              'XLA_PATCHES_TRACE_ON_PLACEHOLDERS',
                              True,
                              BOOL,
                              changes_program=False)

# A trace on placeholders stands for an argument that holds a buffer of its
# own with an alias of that buffer (another tensor on the same device data)
# instead of a placeholder, so that its compile takes no device lock and
# calls of other threads run meanwhile (see [Note: Stand-ins that hold
# buffers] in placeholder_trace.py). Off: placeholders for every argument.
# The programs are the same either way.
trace_on_buffer_aliases = _flag('trace_on_buffer_aliases',
                                'XLA_PATCHES_TRACE_ON_BUFFER_ALIASES',
                                True,
                                BOOL,
                                changes_program=False)

# How long a sync of the device waits for traces on placeholders in flight,
# and a trace for a sync, before it raises PlaceholderWaitTimeout instead
# (see [Note: Syncs wait for placeholder graphs] in io_utils.py); 0: a sync
# with a trace in flight raises at once.
# The interpreter's thread switch interval apply() sets (sys.setswitchinterval,
# seconds; revert() puts Python's back), or 0 to leave it. A thread that
# lets the GIL go for each torch_xla call (a decode step makes many) waits
# for it up to this long each time another thread runs Python (a capture,
# a trace): Python's 5 ms make a step of 1 ms take tens while another
# thread makes a new shape (docs/threads.md has the measurements).
switch_interval = _flag('switch_interval',
                        'XLA_PATCHES_SWITCH_INTERVAL',
                        0.0,
                        SECONDS,
                        changes_program=False)

placeholder_wait_timeout = _flag('placeholder_wait_timeout',
                                 'XLA_PATCHES_PLACEHOLDER_WAIT_TIMEOUT',
                                 300.0,
                                 SECONDS,
                                 changes_program=False)

# torch_xla's (and libtpu's) variables that never change a compiled program:
# debugging output, metrics, cache locations and sizes.
XLA_ENV_NOT_IN_PROGRAM: Tuple[str, ...] = (
    'XLA_COMPILATION_CACHE_SIZE',
    'XLA_DYNAMO_DEBUG',
    'XLA_HLO_DEBUG',
    'XLA_IR_DEBUG',
    'XLA_METRICS_FILE',
    'XLA_PERSISTENT_CACHE_PATH',
    'XLA_PERSISTENT_CACHE_READ_ONLY',
    'XLA_SAVE_TENSORS_FILE',
    'XLA_SAVE_TENSORS_FMT',
)

# A GenerationEngine step after ready that compiles an XLA program raises
# CompiledAfterReady instead of logging a warning (see [Note: Programs of the
# engine] in generation.py), as vLLM's VLLM_XLA_CHECK_RECOMPILATION does: for
# tests, where a compile after warm-up is a bug.
generation_strict = _flag('generation_strict',
                          'XLA_PATCHES_GENERATION_STRICT',
                          False,
                          BOOL,
                          changes_program=False)
