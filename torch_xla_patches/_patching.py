"""A registry of (object, attribute) -> original value, for apply()/revert().

[Note: Patch registry]
Each patched attribute is recorded once, with `setdefault`, the first time it
is replaced. Patching twice therefore never loses the true original, and
revert() restores originals in the reverse order of first patching.
"""
import dataclasses
import inspect
from typing import Any, Callable, Dict, Optional, Tuple

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class PatchTarget:
  """Where a patch goes.

  Args:
    owner: module or object holding the attribute.
    name: attribute name.
  """
  owner: Any
  name: str

  def describe(self) -> str:
    owner_name = getattr(self.owner, '__name__', type(self.owner).__name__)
    return f'{owner_name}.{self.name}'


class PatchRegistry:

  def __init__(self):
    # Insertion ordered: revert() walks it backwards.
    # (None, undo function) for on_revert entries.
    self._originals: Dict[Tuple[int, str], Tuple[Optional[PatchTarget],
                                                 Any]] = {}

  def set(self, owner: Any, name: str, value: Any) -> None:
    key = (id(owner), name)
    if key not in self._originals:
      original = getattr(owner, name, _MISSING)
      self._originals[key] = (PatchTarget(owner, name), original)
    setattr(owner, name, value)

  def on_revert(self, undo: Callable[[], None]) -> None:
    """Calls `undo` in revert_all(), in turn with the attributes set (for a
    change that is not an attribute: a hook registered with torch)."""
    self._originals[(id(undo), '')] = (None, undo)

  def original(self, owner: Any, name: str) -> Any:
    """The value before patching, or the current value if never patched."""
    entry = self._originals.get((id(owner), name))
    if entry is None:
      return getattr(owner, name)
    return entry[1]

  def revert_all(self) -> None:
    for target, original in reversed(list(self._originals.values())):
      if target is None:
        original()
      elif original is _MISSING:
        if hasattr(target.owner, target.name):
          delattr(target.owner, target.name)
      else:
        setattr(target.owner, target.name, original)
    self._originals.clear()

  def __len__(self) -> int:
    return len(self._originals)


def check_signature(target: PatchTarget, fn: Callable,
                    expected_params: Tuple[str, ...]) -> None:
  """Raises RuntimeError if `fn` does not take exactly `expected_params`."""
  found = tuple(inspect.signature(fn).parameters)
  if found != expected_params:
    raise RuntimeError(
        f'torch_xla_patches cannot patch {target.describe()}: expected '
        f'parameters {expected_params}, found {found}. The patch set supports '
        'only the torch_xla version it was written for.')
