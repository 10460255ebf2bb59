"""The torch / torch_xla releases torch_xla_patches runs on, and what differs.

[Note: Supported releases]
torch_xla 2.9.0 is the last release of torch_xla; the users left run 2.9.0 or
2.8.x, each with the torch release it was built against. Everything that
depends on which of them is installed lives here:
  * runtime_versions(), the torch, torch_xla and Python versions of this
    process (read in runtime.py, see [Note: Runtime versions]);
  * SUPPORTED_PAIRS, the (torch, torch_xla) pairs apply() accepts, and
    check_supported(), which refuses any other pair;
  * feature tests (has_torch_aot_compile()) and require_*() helpers that
    raise a RuntimeError naming the release a feature needs.
Code elsewhere asks for a feature, never compares version strings itself.

What differs between the supported releases, as far as the patch goes:
  * torch 2.8 has no `torch._dynamo.aot_compile`, so save/load and
    `serialization.aot_compile` (built on it) need torch 2.9; apply() works
    on both and registers the `openxla_serializable` backend only where it
    can be used.
  * upstream's 2.8 bridge also moved CUDA tensor arguments to the XLA device
    and results back (`_args_on_cuda`, `_maybe_move_tensors_to_device`,
    removed in 2.9). The patched bridge is written against 2.9 and does not:
    on 2.8 it expects XLA tensors, as 2.9 does.
  * torch 2.8 has dynamo's C++ symbolic-shape guards off by default
    (`enable_cpp_symbolic_shape_guards`); apply() turning them off is then a
    no-op, and upstream's first dynamic call is not slow to begin with.
  * torch 2.8's dynamo asks FX whether it is tracing through is_fx_tracing,
    torch 2.9's through is_fx_symbolic_tracing (2.8 has none);
    torch_internals.fx_tracing_flag_users() names the one installed (see
    [Note: FX tracing seen per thread]).
  * torch_xla 2.8 ends the process on some XLA error statuses (a fatal
    `Non-OK-status` check) where 2.9 raises a RuntimeError: the BatchNorm
    eval-mode backward bug (pytorch/xla#3361, eager XLA too) aborts on 2.8.
    xla_errors_are_exceptions() tells which behaviour is installed.
  * everything else the patched bridge and decompositions.py use from
    torch_xla (`XLAConstructorMoverPass`, `alias_with_buffer_donor_config`,
    the `_XLAC` entry points, the AutogradXLA kernels) is the same in 2.8.0,
    2.8.1 and 2.9.0.
"""
import dataclasses
import importlib.util
from typing import Optional

# The one reading of the versions (see [Note: Runtime versions]); re-exported
# here for the modules that check releases.
from torch_xla_patches.runtime import RuntimeVersions, runtime_versions


@dataclasses.dataclass(frozen=True)
class ReleasePair:
  """A torch release and the torch_xla release built against it."""
  torch: str
  torch_xla: str

  def describe(self) -> str:
    return f'torch {self.torch} + torch_xla {self.torch_xla}'


# The pairs `make setup TORCH_XLA=...` installs (the Makefile's TORCH_FOR_*
# table holds the same pairs).
SUPPORTED_PAIRS = (
    ReleasePair(torch='2.8.0', torch_xla='2.8.0'),
    ReleasePair(torch='2.8.0', torch_xla='2.8.1'),
    ReleasePair(torch='2.9.0', torch_xla='2.9.0'),
)
# The torchvision built for each torch: not a dependency, but upstream's
# test/dynamo needs it (tools/run_upstream_tests.py names it when missing).
TORCHVISION_FOR_TORCH = {'2.8.0': '0.23.0', '2.9.0': '0.24.0'}
SUPPORTED_TORCH_VERSIONS = tuple(sorted({p.torch for p in SUPPORTED_PAIRS}))
SUPPORTED_TORCH_XLA_VERSIONS = tuple(p.torch_xla for p in SUPPORTED_PAIRS)

# The first release seen to raise a RuntimeError for an XLA error status that
# torch_xla 2.8.1 turns into a fatal check (the BatchNorm eval backward bug).
XLA_ERRORS_ARE_EXCEPTIONS_SINCE = '2.9.0'

# torch's aot_compile (dynamo bytecode and guards saved to a file) appeared in
# torch 2.9.0; save/load are built on it.
TORCH_AOT_COMPILE_SINCE = '2.9.0'


def base_version(version: str) -> str:
  """'2.8.0+cu128' -> '2.8.0': local build tags do not change the release."""
  return version.split('+')[0]


def release_of(found: RuntimeVersions) -> ReleasePair:
  """The torch and torch_xla releases of `found`, local build tags dropped
  ('+cu128' and '+cpu' builds are the same release)."""
  return ReleasePair(torch=base_version(found.torch),
                     torch_xla=base_version(found.torch_xla))


def installed() -> ReleasePair:
  """The torch and torch_xla releases of this process, local tags dropped."""
  return release_of(runtime_versions())


def supported_pairs_text() -> str:
  return ', '.join(pair.describe() for pair in SUPPORTED_PAIRS)


def check_supported(found: Optional[RuntimeVersions] = None) -> None:
  """Raises RuntimeError unless the release pair is one of SUPPORTED_PAIRS.

  Args:
    found: the versions to check; None reads this process's
      (runtime_versions()).
  """
  found = found or runtime_versions()
  release = release_of(found)
  if release in SUPPORTED_PAIRS:
    return
  # Name the release that is wrong: torch_xla if no pair has it, else torch.
  torch_for_xla = [
      p.torch for p in SUPPORTED_PAIRS if p.torch_xla == release.torch_xla
  ]
  if not torch_for_xla:
    problem = f'torch_xla {found.torch_xla} (with torch {found.torch})'
  else:
    problem = (f'torch {found.torch} with torch_xla {found.torch_xla}, '
               f'which needs torch {torch_for_xla[0]}')
  raise RuntimeError(
      f'torch_xla_patches supports {supported_pairs_text()}; found {problem}.')


def has_torch_aot_compile() -> bool:
  """Whether torch has `torch._dynamo.aot_compile` (torch 2.9 and later)."""
  return importlib.util.find_spec('torch._dynamo.aot_compile') is not None


def require_torch_aot_compile(what: str) -> None:
  """Raises RuntimeError naming `what` and the torch release it needs."""
  if has_torch_aot_compile():
    return
  found = runtime_versions().torch
  raise RuntimeError(
      f'torch_xla_patches: {what} needs torch {TORCH_AOT_COMPILE_SINCE} or '
      f'later (torch._dynamo.aot_compile); found torch {found}. '
      f'The rest of the patch works on torch {found}.')


def _release_tuple(version: str) -> tuple:
  return tuple(int(part) for part in base_version(version).split('.')[:3])


def xla_errors_are_exceptions() -> bool:
  """Whether an XLA error status reaches Python as a RuntimeError.

  No probe: on torch_xla 2.8 the probe itself would end the process.
  """
  return (_release_tuple(installed().torch_xla)
          >= _release_tuple(XLA_ERRORS_ARE_EXCEPTIONS_SINCE))
