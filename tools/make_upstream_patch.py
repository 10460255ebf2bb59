"""Renders the patched dynamo bridge as a pull request onto pytorch/xla.

  python tools/make_upstream_patch.py [--out build/upstream] [--xla-src DIR]

Reads the installed torch_xla's `_dynamo/dynamo_bridge.py` and
`_dynamo/config.py` (located with importlib.util.find_spec; torch_xla is not
imported) and this repo's torch_xla_patches/dynamo_bridge.py as it is on disk
now, and writes to --out:
  dynamo_bridge.py       upstream's bridge with ours merged in
  config.py              upstream's torch_xla/_dynamo/config.py plus our flags
  dynamo_bridge.patch    unified diffs, paths a/torch_xla/_dynamo/... b/...
  config.patch
  upstream.patch         both diffs, for `git apply` in a pytorch/xla checkout

How the bridge is merged (from both files' `ast`s; each top-level statement
keeps its own source text and the comments above it):
  * An upstream top-level name our bridge defines again is replaced where
    upstream had it. Our new definitions go in front of the next replaced one,
    in our file's order.
  * Upstream names our bridge does not define are kept or removed as
    UPSTREAM_ONLY says. A removed name that the remaining code uses is kept.
  * Names our bridge imports from torch_xla_patches.<module> (signature.py)
    are inlined with everything they use, in that module's order, in front of
    the first statement that needs them; a `[Note: ...]` in the module's
    docstring becomes a comment block above them.
  * A statement whose definition-time references (bases, decorators,
    annotations, default values, assigned values) are defined later is moved
    right after them.
  * Imports: upstream's lines stay in place; ones only replaced code used are
    dropped; new ones join the matching `from` line or group; our aliases are
    renamed to upstream's (`upstream_config` -> `config`); torch_xla_patches
    imports and imports from upstream's own bridge are dropped.

[Note: Bridge flags live in torch_xla/_dynamo/config.py]
The flags our bridge reads from torch_xla_patches.config (found by looking
for `config.<flag>` in its code) are rendered as a second file, upstream's
torch_xla/_dynamo/config.py with the flags, their comments and their
env-var helpers appended, and a second patch; they are not inlined as module
constants. Upstream keeps its dynamo flags there (skip_input_data_check), and
its tests and users assign them at run time, which a constant in the bridge
would not allow. Flags only apply() reads (automatic_dynamic_shapes,
install_decompositions) are not bridge code and are not rendered.

Only the changed line ranges are formatted, with yapf and this repo's
.style.yapf (google based, indent 2, column 80: pytorch/xla's settings), so
upstream's kept code stays byte-identical.

Exit status 2, with a message, when the installed torch_xla is not 2.9.0, when
an upstream name this tool expects is gone, or when upstream defines a name
it has no decision for.
"""
import argparse
import ast
import builtins
import dataclasses
import difflib
import importlib.metadata
import importlib.util
import io
import os
import re
import sys
import tokenize
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = 'torch_xla_patches'
BRIDGE_PATH = os.path.join(REPO_ROOT, PACKAGE, 'dynamo_bridge.py')
STYLE_PATH = os.path.join(REPO_ROOT, '.style.yapf')
DEFAULT_OUT = os.path.join(REPO_ROOT, 'build', 'upstream')
# Lists the files a run wrote, so the next run can delete them first.
MANIFEST = 'MANIFEST'

SUPPORTED_TORCH_XLA = '2.9.0'
UPSTREAM_BRIDGE_MODULE = 'torch_xla._dynamo.dynamo_bridge'
UPSTREAM_CONFIG_MODULE = 'torch_xla._dynamo.config'
BRIDGE_REPO_PATH = 'torch_xla/_dynamo/dynamo_bridge.py'
CONFIG_REPO_PATH = 'torch_xla/_dynamo/config.py'

# Upstream names our bridge defines again (checked to exist upstream; the
# bridge may define more, it may not drop one without a decision below).
EXPECTED_REPLACED = (
    'dynamo_debug',
    'ptxla_debug',
    'GraphInputMatcher',
    'extract_graph_helper',
    'extract_internal',
    'UnsupportedNodesCollector',
    'InputCollector',
    'partition_fx_graph_for_cpu_fallback',
    'extract_compiled_graph_helper',
    'extract_compiled_graph',
)

# Upstream names our bridge does not define: ('keep' | 'remove', why).
UPSTREAM_ONLY = {
    'get_fallback_ops': ('keep', 'torch_xla/stablehlo.py calls it'),
    'NoneRemover':
        ('keep', 'test/dynamo/test_none_remover.py imports it; the bridge '
         'no longer uses it (OutputPlan restores Nones)'),
    'XLAConstructorMoverPass': ('keep', 'the patched bridge uses it'),
    '_get_input_arg_device': ('remove', 'unused upstream as well'),
    '_split_xla_args_tensor_sym_constant':
        ('remove', 'replaced by ArgLayout.key_function()'),
    'Deduper': ('remove', 'replaced by OutputPlan'),
    'SpecialReturnHandler': ('remove', 'replaced by OutputPlan'),
    'is_xla_tensor': ('remove', 'only replaced code used it'),
    '_clear_pending_irs_on_args': ('remove', 'replaced by _PendingRestore'),
}

# Names upstream's tests import from the bridge module although the bridge
# only imports them; their imports stay even when unused.
KEEP_IMPORTS = {
    'alias_with_buffer_donor_config':
        'test/dynamo/test_dynamo_aliasing.py imports it from the bridge',
}

# Words in our code a PR author should look at (prose about "upstream",
# names and env vars of the patch set).
REVIEW_PATTERN = re.compile(r'torch_xla_patches|XLA_PATCHES_|\bupstream\b',
                            re.IGNORECASE)


class RefusedError(Exception):
  """The tool cannot render a trustworthy patch; the message says why."""


@dataclasses.dataclass
class Stmt:
  """One top-level statement and the comment lines right above it."""
  node: ast.stmt
  # Source text (comments above + statement), no trailing newline.
  text: str
  # Blank lines between the previous statement and this one's first line.
  blank_before: int
  # Source line number of the first line of `text`.
  first_line: int
  # Top-level names it binds.
  names: Tuple[str, ...]
  # 'upstream', 'bridge' or the inlined module's name.
  origin: str

  @property
  def is_def(self) -> bool:
    return isinstance(self.node,
                      (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))


@dataclasses.dataclass
class ParsedModule:
  docstring: Optional[str]
  # Source lines of the docstring (and anything before it), or ''.
  head: str
  imports: List[Stmt]
  body: List[Stmt]
  # Text after the last statement (trailing comments), usually ''.
  tail: str


@dataclasses.dataclass(frozen=True)
class Binding:
  """A name an import binds, and what it binds it to."""
  name: str
  # ('module', 'a.b') for `import a.b as x`, ('from', 'm', 'n') otherwise.
  key: Tuple[str, ...]
  # `import a.b` without alias: imported for the submodule, never dropped.
  submodule_import: bool = False


@dataclasses.dataclass
class FileResult:
  repo_path: str
  rendered_path: str
  patch_path: str
  added: int
  removed: int


@dataclasses.dataclass
class RenderResult:
  files: List[FileResult]
  replaced: List[str]
  unchanged: List[str]
  added: List[str]
  removed: List[Tuple[str, str]]
  kept: List[Tuple[str, str]]
  inlined: Dict[str, List[str]]
  # torch_xla_patches modules rendered as new torch_xla/_dynamo/<name>.py.
  companions: List[str]
  config_flags: List[str]
  conflicts: List[str]
  review: List[str]
  combined_patch: str

  @property
  def lines_added(self) -> int:
    return sum(f.added for f in self.files)

  @property
  def lines_removed(self) -> int:
    return sum(f.removed for f in self.files)


# --- parsing ---------------------------------------------------------------


def _bound_names(node: ast.stmt) -> Tuple[str, ...]:
  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
    return (node.name,)
  if isinstance(node, ast.Assign):
    targets = node.targets
  elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
    targets = [node.target]
  else:
    targets = [node]
  names = []
  for target in targets:
    for sub in ast.walk(target):
      if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
        names.append(sub.id)
  return tuple(dict.fromkeys(names))


def parse_module(source: str, origin: str) -> ParsedModule:
  tree = ast.parse(source)
  lines = source.splitlines()
  docstring = ast.get_docstring(tree, clean=False)
  imports, body = [], []
  prev_end = 0
  head = ''
  for index, node in enumerate(tree.body):
    if (index == 0 and docstring is not None and isinstance(node, ast.Expr)):
      prev_end = node.end_lineno
      head = '\n'.join(lines[:prev_end])
      continue
    chunk = lines[prev_end:node.end_lineno]
    blank = 0
    while chunk and not chunk[0].strip():
      chunk.pop(0)
      blank += 1
    stmt = Stmt(node, '\n'.join(chunk), blank, prev_end + blank + 1,
                _bound_names(node), origin)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      imports.append(stmt)
    else:
      body.append(stmt)
    prev_end = node.end_lineno
  tail = '\n'.join(lines[prev_end:]).strip('\n')
  return ParsedModule(docstring, head, imports, body, tail)


def import_bindings(node: ast.stmt) -> List[Binding]:
  if isinstance(node, ast.Import):
    out = []
    for alias in node.names:
      if alias.asname:
        out.append(Binding(alias.asname, ('module', alias.name)))
      else:
        top = alias.name.split('.')[0]
        out.append(
            Binding(top, ('module', top), submodule_import='.' in alias.name))
    return out
  assert isinstance(node, ast.ImportFrom)
  if node.level:
    raise RefusedError('relative imports are not supported: '
                       f'{ast.unparse(node)}')
  return [
      Binding(alias.asname or alias.name, ('from', node.module, alias.name))
      for alias in node.names
  ]


class _DefinitionTimeNames(ast.NodeVisitor):
  """Names a statement reads while the module executes (not in bodies of
  functions or lambdas, which run later)."""

  def __init__(self):
    self.names: Set[str] = set()

  def visit_Name(self, node):
    if isinstance(node.ctx, ast.Load):
      self.names.add(node.id)

  def _visit_signature(self, node):
    for decorator in getattr(node, 'decorator_list', []):
      self.visit(decorator)
    args = node.args
    for default in args.defaults + [d for d in args.kw_defaults if d]:
      self.visit(default)
    if isinstance(node, ast.Lambda):
      return
    for arg in args.posonlyargs + args.args + args.kwonlyargs + [
        args.vararg, args.kwarg
    ]:
      if arg is not None and arg.annotation is not None:
        self.visit(arg.annotation)
    if node.returns is not None:
      self.visit(node.returns)

  visit_FunctionDef = _visit_signature
  visit_AsyncFunctionDef = _visit_signature
  visit_Lambda = _visit_signature


def definition_time_names(node: ast.AST) -> Set[str]:
  visitor = _DefinitionTimeNames()
  visitor.visit(node)
  return visitor.names


def loaded_names(node: ast.AST) -> Set[str]:
  return {
      sub.id
      for sub in ast.walk(node)
      if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)
  }


def bound_anywhere(tree: ast.AST) -> Set[str]:
  names = set()
  for sub in ast.walk(tree):
    if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
      names.add(sub.id)
    elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(sub.name)
    elif isinstance(sub, ast.arg):
      names.add(sub.arg)
    elif isinstance(sub, (ast.Import, ast.ImportFrom)):
      names.update(b.name for b in import_bindings(sub))
    elif isinstance(sub, ast.ExceptHandler) and sub.name:
      names.add(sub.name)
    elif isinstance(sub, (ast.Global, ast.Nonlocal)):
      names.update(sub.names)
  return names


def rename_names(text: str, renames: Dict[str, str]) -> str:
  """Renames NAME tokens (not comments, strings or attributes)."""
  if not renames:
    return text
  lines = text.split('\n')
  edits = []
  previous = None
  tokens = tokenize.generate_tokens(io.StringIO(text + '\n').readline)
  for token in tokens:
    if (token.type == tokenize.NAME and token.string in renames and
        not (previous is not None and previous.string == '.')):
      edits.append((token.start, token.end, renames[token.string]))
    if token.type not in (tokenize.NL, tokenize.COMMENT):
      previous = token
  for (row, col), (_, end_col), new in reversed(edits):
    line = lines[row - 1]
    lines[row - 1] = line[:col] + new + line[end_col:]
  return '\n'.join(lines)


def _note_as_comment(docstring: Optional[str]) -> Optional[str]:
  """The `[Note: ...]` part of a module docstring, as a comment block."""
  if not docstring or '[Note:' not in docstring:
    return None
  note = docstring[docstring.index('[Note:'):].rstrip()
  return '\n'.join(('# ' + line).rstrip() for line in note.split('\n'))


# --- locating files --------------------------------------------------------


def installed_torch_xla_version() -> str:
  try:
    return importlib.metadata.version('torch_xla')
  except importlib.metadata.PackageNotFoundError:
    raise RefusedError('torch_xla is not installed in this interpreter '
                       f'({sys.executable}).') from None


def installed_upstream_file(name: str) -> str:
  spec = importlib.util.find_spec('torch_xla')
  if spec is None or not spec.submodule_search_locations:
    raise RefusedError('cannot find the torch_xla package')
  path = os.path.join(spec.submodule_search_locations[0], '_dynamo', name)
  if not os.path.exists(path):
    raise RefusedError(f'installed torch_xla has no _dynamo/{name} ({path})')
  return path


def _read(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return f.read()


def _stdlib(module: str) -> bool:
  return module.split('.')[0] in sys.stdlib_module_names


def _group(binding: Binding) -> str:
  module = binding.key[1]
  top = module.split('.')[0]
  if _stdlib(module):
    return 'stdlib'
  return top if top in ('torch', 'torch_xla') else 'other'


def _module_of(stmt: Stmt) -> str:
  node = stmt.node
  return node.module if isinstance(node, ast.ImportFrom) else node.names[0].name


def _common_prefix(a: str, b: str) -> int:
  """Number of leading dotted components `a` and `b` share."""
  count = 0
  for x, y in zip(a.split('.'), b.split('.')):
    if x != y:
      break
    count += 1
  return count


def _import_text(binding: Binding) -> str:
  if binding.key[0] == 'module':
    module = binding.key[1]
    alias = '' if binding.name == module else f' as {binding.name}'
    return f'import {module}{alias}'
  _, module, name = binding.key
  alias = '' if binding.name == name else f' as {binding.name}'
  return f'from {module} import {name}{alias}'


def _from_import_text(module: str, bindings: Sequence[Binding]) -> str:
  parts = []
  for b in bindings:
    name = b.key[2]
    parts.append(name if b.name == name else f'{name} as {b.name}')
  return f'from {module} import {", ".join(parts)}'


# --- the merge -------------------------------------------------------------


class BridgeRenderer:
  """Merges our bridge into upstream's; see the module docstring."""

  def __init__(self, upstream_source: str, bridge_source: str,
               package_dir: str):
    self.upstream = parse_module(upstream_source, 'upstream')
    self.bridge = parse_module(bridge_source, 'bridge')
    self.bridge_tree = ast.parse(bridge_source)
    # torch_xla_patches modules the bridge imports as modules, in order.
    self.companions: List[str] = []
    self.package_dir = package_dir
    self.renames: Dict[str, str] = {}
    self.config_names: Set[str] = set(
    )  # our names for torch_xla_patches.config
    self.upstream_config_names: Set[str] = set()
    self.inlined: Dict[str, List[Stmt]] = {}
    self.inlined_docstrings: Dict[str, Optional[str]] = {}
    self.from_upstream_bridge: Set[str] = set()
    self.new_bindings: List[Binding] = []
    self.kept: List[Tuple[str, str]] = []
    self.removed: List[Tuple[str, str]] = []
    self.replaced: List[str] = []
    self.unchanged: List[str] = []
    self.added: List[str] = []
    self.conflicts: List[str] = []

  # Upstream's import bindings, by name and by key.
  def _upstream_bindings(self) -> List[Tuple[Stmt, Binding]]:
    return [(stmt, b)
            for stmt in self.upstream.imports
            for b in import_bindings(stmt.node)]

  def _scan_package_imports(self) -> None:
    """Sorts the torch_xla_patches modules the bridge reaches into config,
    inlined modules (names imported from them) and companion modules
    (imported as modules; rendered as torch_xla/_dynamo/<module>.py)."""
    wanted: Dict[str, Set[str]] = {}
    queue = [('bridge', self.bridge_tree)]
    while queue:
      origin, tree = queue.pop(0)
      top_level = set(map(id, tree.body))
      for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(
            _in_package(a.name) for a in node.names):
          raise RefusedError(f'unsupported import in {origin}: '
                             f'{ast.unparse(node)}; use `from {PACKAGE} '
                             'import <module>` or `from {PACKAGE}.<module> '
                             f'import <names>`.')
        if not (isinstance(node, ast.ImportFrom) and _in_package(node.module)):
          continue
        if node.module == PACKAGE:
          for alias in node.names:
            if alias.name == 'config':
              continue
            if alias.name not in self.companions:
              path = self._module_path(alias.name)
              if not os.path.exists(path):
                raise RefusedError(f'{origin} imports {PACKAGE}.{alias.name}, '
                                   f'which is not a module file ({path})')
              self.companions.append(alias.name)
              queue.append((alias.name, ast.parse(_read(path))))
          continue
        module = node.module.split('.', 1)[1]
        if module == 'config':
          raise RefusedError('import the config module, not names from it: '
                             f'{ast.unparse(node)} in {origin}')
        if origin == 'bridge' and id(node) not in top_level:
          raise RefusedError('the bridge imports names from '
                             f'{node.module} inside a function; import them '
                             'at the top so they can be inlined')
        wanted.setdefault(module, set()).update(a.name for a in node.names)
        if origin != 'bridge' and module not in self.companions:
          # A companion module needs it: it must stay a module of its own
          # (inlining it into the bridge would make an import cycle).
          path = self._module_path(module)
          if not os.path.exists(path):
            raise RefusedError(f'{origin} imports {node.module}, which is not '
                               f'a module file ({path})')
          self.companions.append(module)
          queue.append((module, ast.parse(_read(path))))
        if origin == 'bridge':
          for alias in node.names:
            if alias.asname and alias.asname != alias.name:
              self.renames[alias.asname] = alias.name
    for module, names in wanted.items():
      if module not in self.companions:
        self._inline(module, names)
    self.config_names = _package_config_names(self.bridge_tree)

  def _bridge_from_imports(self) -> Set[str]:
    return {
        s.node.module.split('.', 1)[1]
        for s in self.bridge.imports
        if isinstance(s.node, ast.ImportFrom) and _in_package(s.node.module) and
        s.node.module != PACKAGE
    }

  def _collect_imports(self) -> None:
    upstream = self._upstream_bindings()
    name_of_key = {b.key: b.name for _, b in upstream}
    key_of_name = {b.name: b.key for _, b in upstream}
    candidates: List[Binding] = []
    for stmt in self.bridge.imports:
      node = stmt.node
      if isinstance(node, ast.ImportFrom) and _in_package(node.module):
        # config and inlined names: see _scan_package_imports; a companion
        # module imported at the top becomes a torch_xla._dynamo import.
        if node.module == PACKAGE:
          candidates.extend(
              Binding(a.asname or a.name, ('from', 'torch_xla._dynamo', a.name))
              for a in node.names
              if a.name in self.companions)
        elif node.module.split('.', 1)[1] in self.companions:
          module = 'torch_xla._dynamo.' + node.module.split('.', 1)[1]
          candidates.extend(
              Binding(a.asname or a.name, ('from', module, a.name))
              for a in node.names)
        continue
      for b in import_bindings(node):
        if b.key[0] == 'from' and b.key[1] == UPSTREAM_BRIDGE_MODULE:
          self.from_upstream_bridge.add(b.key[2])
          if b.name != b.key[2]:
            self.renames[b.name] = b.key[2]
          continue
        if b.key == ('from', 'torch_xla._dynamo',
                     'config') or b.key == ('module', UPSTREAM_CONFIG_MODULE):
          self.upstream_config_names.add(b.name)
        candidates.append(b)
    for module in self.inlined:
      for stmt in parse_module(_read(self._module_path(module)),
                               module).imports:
        for b in import_bindings(stmt.node):
          if _in_package(b.key[1]):
            raise RefusedError(f'{module} imports {b.key[1]}; an inlined '
                               'module cannot import the package.')
          candidates.append(b)
    # Our torch_xla_patches.config becomes upstream's torch_xla._dynamo.config.
    config_key = ('from', 'torch_xla._dynamo', 'config')
    for name in self.config_names:
      candidates.append(Binding(name, config_key))
    seen = set()
    for b in candidates:
      target = name_of_key.get(b.key)
      if target is not None:
        if b.name != target:
          self.renames[b.name] = target
        continue
      if b.name in key_of_name and key_of_name[b.name] != b.key:
        raise RefusedError(f'import name clash: upstream binds {b.name!r} to '
                           f'{key_of_name[b.name]}, ours to {b.key}')
      if b.key not in seen:
        seen.add(b.key)
        self.new_bindings.append(b)
    if 'config' in self.renames.values() and 'config' not in key_of_name:
      raise RefusedError('upstream no longer imports torch_xla._dynamo.config')

  def _module_path(self, module: str) -> str:
    return os.path.join(self.package_dir, module.split('.')[-1] + '.py')

  def _inline(self, module: str, names: Set[str]) -> None:
    parsed = parse_module(_read(self._module_path(module)), module)
    self.inlined_docstrings[module] = parsed.docstring
    defined = {name: stmt for stmt in parsed.body for name in stmt.names}
    wanted = sorted(names)
    for name in wanted:
      if name not in defined:
        raise RefusedError(f'{PACKAGE}.{module} has no top-level {name!r}')
    closure: Set[str] = set()
    while wanted:
      name = wanted.pop()
      if name in closure:
        continue
      closure.add(name)
      for used in loaded_names(defined[name].node):
        if used in defined and used not in closure:
          wanted.append(used)
    self.inlined[module] = [s for s in parsed.body if set(s.names) & closure]

  def upstream_import_text(self, node: ast.ImportFrom) -> str:
    """What a torch_xla_patches import becomes upstream."""
    names = ', '.join(a.name if not a.asname or a.asname == a.name else
                      f'{a.name} as {a.asname}' for a in node.names)
    if node.module == PACKAGE:
      # config and companion modules both live in torch_xla._dynamo.
      return f'from torch_xla._dynamo import {names}'
    module = node.module.split('.', 1)[1]
    if module in self.companions:
      return f'from torch_xla._dynamo.{module} import {names}'
    return f'from {UPSTREAM_BRIDGE_MODULE} import {names}'

  def rewrite_package_imports(self, text: str, first_line: int,
                              tree: ast.AST) -> str:
    """`text` (source from line `first_line` on) with every torch_xla_patches
    import in `tree` replaced by its upstream form."""
    edits = [(node.lineno, node.end_lineno, self.upstream_import_text(node))
             for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and _in_package(node.module)]
    lines = text.split('\n')
    for start, end, new in sorted(edits, reverse=True):
      i, j = start - first_line, end - first_line
      indent = re.match(r'\s*', lines[i]).group(0)
      lines[i:j + 1] = [indent + new]
    return '\n'.join(lines)

  def render_companion(self, module: str) -> Tuple[str, Set[str]]:
    """torch_xla/_dynamo/<module>.py, and the config flags it reads."""
    source = _read(self._module_path(module))
    tree = ast.parse(source)
    text = self.rewrite_package_imports(source, 1, tree)
    return text, _config_flags_read(tree, _package_config_names(tree))

  def config_flags(self) -> Set[str]:
    return _config_flags_read(self.bridge_tree, self.config_names)

  def upstream_config_reads(self) -> List[str]:
    reads = set()
    for stmt in self.bridge.body:
      for sub in ast.walk(stmt.node):
        if (isinstance(sub, ast.Attribute) and
            isinstance(sub.value, ast.Name) and
            sub.value.id in self.upstream_config_names):
          reads.add(sub.attr)
    return sorted(reads)

  def _check_names(self, bridge_names: Set[str]) -> None:
    upstream_names = [n for s in self.upstream.body for n in s.names]
    for stmt in self.upstream.body:
      if not stmt.names:
        raise RefusedError('upstream has a top-level statement this tool has '
                           f'no decision for: {stmt.text.splitlines()[0]!r}')
    expected = set(EXPECTED_REPLACED) | set(UPSTREAM_ONLY)
    gone = sorted(expected - set(upstream_names))
    if gone:
      raise RefusedError(
          'names this tool expects in upstream\'s dynamo_bridge.py are gone: '
          f'{", ".join(gone)}. The installed torch_xla is not the one the '
          'patch was written against.')
    undecided = sorted(
        set(upstream_names) - bridge_names - set(UPSTREAM_ONLY) -
        self.from_upstream_bridge)
    if undecided:
      raise RefusedError(
          'upstream defines names the bridge does not, with no keep/remove '
          f'decision in UPSTREAM_ONLY: {", ".join(undecided)}')
    missing = sorted(self.from_upstream_bridge - set(upstream_names) -
                     {b.name for _, b in self._upstream_bindings()})
    if missing:
      raise RefusedError('the bridge imports names upstream\'s bridge does '
                         f'not define: {", ".join(missing)}')

  def render(self) -> Tuple[str, List[Tuple[int, int]]]:
    """The merged file, and the 1-based line ranges that are ours."""
    self._scan_package_imports()
    self._collect_imports()
    renames = self.renames
    bridge_body = [
        dataclasses.replace(s,
                            text=rename_names(
                                self.rewrite_package_imports(
                                    s.text, s.first_line, s.node), renames))
        for s in self.bridge.body
    ]
    inlined_body = {
        module: [
            dataclasses.replace(s, text=rename_names(s.text, renames))
            for s in stmts
        ] for module, stmts in self.inlined.items()
    }
    bridge_names = {n for s in bridge_body for n in s.names}
    self._check_names(bridge_names)
    inlined_names = {
        n for stmts in inlined_body.values() for s in stmts for n in s.names
    }
    upstream_names = {n for s in self.upstream.body for n in s.names}
    clash = inlined_names & (bridge_names | upstream_names)
    if clash:
      raise RefusedError('inlined names clash with bridge or upstream names: '
                         f'{", ".join(sorted(clash))}')

    # Decide upstream-only names; a removed name still used is kept.
    decision: Dict[str, Tuple[str, str]] = {}
    for stmt in self.upstream.body:
      for name in stmt.names:
        if name in bridge_names:
          continue
        if name in self.from_upstream_bridge:
          decision[name] = ('keep', 'the patched bridge uses it')
        else:
          decision[name] = UPSTREAM_ONLY[name]
    while True:
      kept_stmts = [
          s for s in self.upstream.body if s.names and all(
              decision.get(n, ('', ''))[0] == 'keep' for n in s.names)
      ]
      used = set()
      for s in bridge_body + kept_stmts + [
          s for stmts in inlined_body.values() for s in stmts
      ]:
        used |= loaded_names(s.node)
      revived = [
          n for n, (action, _) in decision.items()
          if action == 'remove' and n in used
      ]
      if not revived:
        break
      for n in revived:
        decision[n] = ('keep', 'remaining code uses it')

    # Order: upstream's, with ours replacing in place.
    anchor: Dict[int, int] = {}  # bridge index -> upstream index
    for bi, b in enumerate(bridge_body):
      for ui, u in enumerate(self.upstream.body):
        if set(b.names) & set(u.names):
          anchor.setdefault(bi, ui)
    order: List[Stmt] = []
    emitted: Set[int] = set()
    upstream_by_name = {n: u for u in self.upstream.body for n in u.names}

    def emit_bridge(bi: int) -> None:
      emitted.add(bi)
      stmt = bridge_body[bi]
      order.append(stmt)
      olds = [upstream_by_name[n] for n in stmt.names if n in upstream_by_name]
      label = ', '.join(stmt.names) or stmt.text.splitlines()[0]
      if not olds:
        self.added.append(label)
      elif all(o.text == stmt.text for o in olds):
        self.unchanged.append(label)
      else:
        self.replaced.append(label)

    for ui, u in enumerate(self.upstream.body):
      replacing = [bi for bi, a in anchor.items() if a == ui]
      if replacing:
        for bi in replacing:
          if bi in emitted:
            continue
          for earlier in range(bi):
            if earlier not in emitted and earlier not in anchor:
              emit_bridge(earlier)
          emit_bridge(bi)
        continue
      if any(n in bridge_names for n in u.names):
        continue  # replaced by a statement anchored earlier
      if all(decision[n][0] == 'keep' for n in u.names):
        order.append(u)
        self.kept.extend((n, decision[n][1]) for n in u.names)
      else:
        self.removed.extend((n, decision[n][1]) for n in u.names)
    for bi in range(len(bridge_body)):
      if bi not in emitted:
        emit_bridge(bi)

    # Inlined modules go in front of the first statement that uses them.
    for module, stmts in inlined_body.items():
      names = {n for s in stmts for n in s.names}
      at = next(
          (i for i, s in enumerate(order) if loaded_names(s.node) & names),
          len(order))
      note = _note_as_comment(self.inlined_docstrings.get(module))
      if note and stmts:
        first = stmts[0]
        stmts[0] = dataclasses.replace(first, text=note + '\n\n' + first.text)
      order[at:at] = stmts

    order = self._fix_definition_order(order)
    return self._assemble(order)

  @staticmethod
  def _fix_definition_order(order: List[Stmt]) -> List[Stmt]:
    defined_in_module = {n for s in order for n in s.names}
    out: List[Stmt] = []
    done: Set[str] = set()
    waiting: List[Tuple[Stmt, Set[str]]] = []

    def flush():
      progress = True
      while progress:
        progress = False
        for item in list(waiting):
          stmt, needs = item
          if needs <= done:
            waiting.remove(item)
            out.append(stmt)
            done.update(stmt.names)
            progress = True

    for stmt in order:
      needs = (definition_time_names(stmt.node) & defined_in_module) - set(
          stmt.names)
      if needs <= done:
        out.append(stmt)
        done.update(stmt.names)
        flush()
      else:
        waiting.append((stmt, needs))
    if waiting:
      raise RefusedError('cannot order definitions: ' + ', '.join(
          f'{s.names} needs {sorted(n - done)}' for s, n in waiting))
    return out

  def _assemble(self, order: List[Stmt]) -> Tuple[str, List[Tuple[int, int]]]:
    # Body text first: its names decide which imports survive.
    pieces: List[Tuple[str, bool]] = []  # (text, ours)
    previous = None
    for stmt in order:
      if previous is None:
        blank = 2 if stmt.is_def else max(1, min(stmt.blank_before, 2))
      elif stmt.is_def or previous.is_def:
        blank = 2
      else:
        blank = min(stmt.blank_before, 2)
      pieces.append(('\n' * blank, False))
      pieces.append((stmt.text + '\n', stmt.origin != 'upstream'))
      previous = stmt
    body_text = ''.join(text for text, _ in pieces)
    used = loaded_names(ast.parse(body_text))
    upstream_used = set()
    for stmt in self.upstream.body:
      upstream_used |= loaded_names(stmt.node)

    import_pieces = self._render_imports(used, upstream_used)
    lines: List[str] = []
    ours: List[Tuple[int, int]] = []
    for text, mine in import_pieces + pieces:
      if not text:
        continue
      start = len(lines) + 1
      chunk = text.split('\n')[:-1] if text.endswith('\n') else text.split('\n')
      lines.extend(chunk)
      if mine and chunk:
        ours.append((start, len(lines)))
    if self.upstream.tail:
      lines.extend(['', self.upstream.tail])
    return '\n'.join(lines) + '\n', ours

  def _render_imports(self, used: Set[str],
                      upstream_used: Set[str]) -> List[Tuple[str, bool]]:
    new = [b for b in self.new_bindings if b.name in used]
    # Upstream's own docstring, then its import lines in place.
    pieces: List[Tuple[str, bool]] = []
    if self.upstream.head:
      pieces.append((self.upstream.head + '\n', False))
    entries: List[Tuple[Stmt, str, bool, str]] = []  # stmt, text, ours, group
    from_stmt_index: Dict[str, int] = {}
    for stmt in self.upstream.imports:
      bindings = import_bindings(stmt.node)
      keep = [
          b for b in bindings if b.submodule_import or b.name in used or
          b.name not in upstream_used or b.name in KEEP_IMPORTS
      ]
      group = _group(bindings[0])
      if len(keep) == len(bindings):
        entries.append((stmt, stmt.text, False, group))
      elif keep:
        entries.append((stmt, self._rewrite(stmt, keep), True, group))
      else:
        entries.append((stmt, None, True, group))
        continue
      if isinstance(stmt.node, ast.ImportFrom):
        from_stmt_index.setdefault(stmt.node.module, len(entries) - 1)
    extra: Dict[int, List[str]] = {}
    merged: Dict[int, List[Binding]] = {}  # entry -> bindings added to it
    for b in sorted(new, key=_import_text):
      if b.key[0] == 'from' and b.key[1] in from_stmt_index:
        index = from_stmt_index[b.key[1]]
        stmt, _, _, group = entries[index]
        current = [
            x for x in import_bindings(stmt.node)
            if x.submodule_import or x.name in used or
            x.name not in upstream_used or x.name in KEEP_IMPORTS
        ]
        added = merged.setdefault(index, [])
        added.append(b)
        entries[index] = (stmt, self._rewrite(stmt,
                                              current + added), True, group)
        continue
      # After the import of the same group with the longest common module
      # prefix (the last one on ties).
      group = _group(b)
      same_group = [(_common_prefix(b.key[1], _module_of(e[0])), i)
                    for i, e in enumerate(entries)
                    if e[1] is not None and e[3] == group]
      index = max(same_group)[1] if same_group else None
      if index is None:
        index = max((i for i, e in enumerate(entries) if e[1] is not None),
                    default=len(entries) - 1)
      extra.setdefault(index, []).append(_import_text(b))
    carried = 0  # blank lines above dropped imports
    for index, (stmt, text, mine, _) in enumerate(entries):
      if text is None:
        carried = max(carried, stmt.blank_before)
        continue
      blank = max(stmt.blank_before, carried)
      carried = 0
      if blank and pieces:
        pieces.append(('\n' * blank, False))
      pieces.append((text + '\n', mine))
      if index in extra:
        pieces.append(('\n'.join(extra[index]) + '\n', True))
    return pieces

  @staticmethod
  def _rewrite(stmt: Stmt, bindings: List[Binding]) -> str:
    node = stmt.node
    comments = [l for l in stmt.text.split('\n') if l.lstrip().startswith('#')]
    prefix = ''.join(c + '\n' for c in comments)
    if isinstance(node, ast.ImportFrom):
      originals = [a.name for a in node.names]
      ordered = sorted(bindings, key=lambda b: b.key[2])
      if originals != sorted(originals):
        ordered = ([b for b in bindings if b.key[2] in originals] + sorted(
            (b for b in bindings if b.key[2] not in originals),
            key=lambda b: b.key[2]))
      return prefix + _from_import_text(node.module, ordered)
    return prefix + '\n'.join(_import_text(b) for b in bindings)

  def signature_conflicts(self, xla_src: Optional[str]) -> List[str]:
    """Replaced functions and classes whose call signature changed, and
    removed names, with the upstream tests/examples that mention them."""
    upstream = {n: s for s in self.upstream.body for n in s.names}
    found = []
    for stmt in self.bridge.body:
      for name in stmt.names:
        old = upstream.get(name)
        if old is None:
          continue
        before, after = _call_params(old.node), _call_params(stmt.node)
        if before is not None and after is not None and before != after:
          found.append((name, f'{name}({", ".join(before)}) -> '
                        f'{name}({", ".join(after or [])})'))
    for name, _ in self.removed:
      found.append((name, f'{name} is removed'))
    out = []
    for name, what in found:
      users = _mentions(xla_src, name) if xla_src else []
      where = (f'; used by {", ".join(users)}' if users else (
          '; no use in test/, examples/ or torch_xla/' if xla_src else ''))
      if users or not xla_src or 'is removed' not in what:
        out.append(what + where)
    return out


def _in_package(module: Optional[str]) -> bool:
  return bool(module) and module.split('.')[0] == PACKAGE


def _package_config_names(tree: ast.AST) -> Set[str]:
  """Names bound to torch_xla_patches.config anywhere in `tree`."""
  return {
      alias.asname or alias.name for node in ast.walk(tree)
      if isinstance(node, ast.ImportFrom) and node.module == PACKAGE
      for alias in node.names if alias.name == 'config'
  }


def _config_flags_read(tree: ast.AST, config_names: Set[str]) -> Set[str]:
  return {
      node.attr
      for node in ast.walk(tree)
      if isinstance(node, ast.Attribute) and
      isinstance(node.value, ast.Name) and node.value.id in config_names
  }


def _call_params(node: ast.stmt) -> Optional[List[str]]:
  if isinstance(node, ast.ClassDef):
    for item in node.body:
      if isinstance(item, ast.FunctionDef) and item.name == '__init__':
        return _call_params(item)[1:]
    return None  # inherited
  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg:
      names.append('*' + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
      names.append('**' + args.kwarg.arg)
    return names
  return None


_BRIDGE_MODULES = (UPSTREAM_BRIDGE_MODULE, 'torch_xla.core.dynamo_bridge')


def _uses_bridge_name(tree: ast.AST, name: str) -> bool:
  """Whether a file imports `name` from a bridge module or reads it as an
  attribute of one."""
  aliases = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name in _BRIDGE_MODULES and a.asname:
          aliases.add(a.asname)
    elif isinstance(node, ast.ImportFrom) and node.module:
      for a in node.names:
        full = f'{node.module}.{a.name}'
        if full in _BRIDGE_MODULES:
          aliases.add(a.asname or a.name)
        elif node.module in _BRIDGE_MODULES and a.name in (name, '*'):
          return True
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr == name:
      base = ast.unparse(node.value)
      if base in aliases or base in _BRIDGE_MODULES:
        return True
  return False


def _mentions(xla_src: str, name: str) -> List[str]:
  """Files of a pytorch/xla checkout that use `name` from the bridge."""
  users = []
  for top in ('test', 'examples', 'torch_xla'):
    for dirpath, _, filenames in os.walk(os.path.join(xla_src, top)):
      for filename in sorted(filenames):
        path = os.path.join(dirpath, filename)
        if not filename.endswith('.py') or path.endswith(
            os.path.join('_dynamo', 'dynamo_bridge.py')):
          continue
        source = _read(path)
        if name not in source:
          continue
        try:
          tree = ast.parse(source)
        except SyntaxError:
          continue
        if _uses_bridge_name(tree, name):
          users.append(os.path.relpath(path, xla_src))
  return sorted(users)


# --- config.py -------------------------------------------------------------


def render_config(upstream_source: str, config_source: str,
                  flags: Sequence[str]) -> Tuple[str, List[Tuple[int, int]]]:
  """Upstream's config.py with `flags` (and what they use) appended."""
  upstream = parse_module(upstream_source, 'upstream')
  ours = parse_module(config_source, 'config')
  existing = {n for s in upstream.body for n in s.names}
  defined = {n: s for s in ours.body for n in s.names}
  missing = [f for f in flags if f not in defined]
  if missing:
    raise RefusedError('the bridge reads config flags that '
                       f'{PACKAGE}/config.py does not define: {missing}')
  clash = sorted(set(flags) & existing)
  if clash:
    raise RefusedError(f'upstream config.py already defines {clash}')
  wanted, closure = list(flags), set()
  while wanted:
    name = wanted.pop()
    if name in closure:
      continue
    closure.add(name)
    wanted.extend(n for n in loaded_names(defined[name].node)
                  if n in defined and n not in closure)
  stmts = [s for s in ours.body if set(s.names) & closure]
  used = set()
  for s in stmts:
    used |= loaded_names(s.node)
  have = {b.key for s in upstream.imports for b in import_bindings(s.node)}
  new_imports = sorted({
      _import_text(b)
      for s in ours.imports
      for b in import_bindings(s.node)
      if b.name in used and b.key not in have
  })
  lines = upstream_source.rstrip('\n').split('\n')
  ours_ranges = []
  if new_imports:
    stdlib = [i for i in new_imports if _stdlib(i.split()[1])]
    others = [i for i in new_imports if i not in stdlib]
    first_import = min((s.node.lineno for s in upstream.imports),
                       default=len(lines) + 1)
    block = stdlib + ([''] if stdlib and others else []) + others
    if upstream.imports and not all(
        _stdlib(b.key[1])
        for s in upstream.imports
        for b in import_bindings(s.node)):
      block.append('')
    lines[first_import - 1:first_import - 1] = block
    ours_ranges.append((first_import, first_import + len(block) - 1))
  for stmt in stmts:
    lines.extend([''] * (2 if stmt.is_def or stmt is stmts[0] else min(
        max(stmt.blank_before, 1), 2)))
    start = len(lines) + 1
    lines.extend(stmt.text.split('\n'))
    ours_ranges.append((start, len(lines)))
  return '\n'.join(lines) + '\n', ours_ranges


# --- output ----------------------------------------------------------------


def yapf_format(source: str, ranges: List[Tuple[int, int]]) -> str:
  try:
    from yapf.yapflib.yapf_api import FormatCode
  except ImportError:
    raise RefusedError(
        'yapf is not installed: pip install yapf==0.40.2') from None
  if not ranges:
    return source
  formatted, _ = FormatCode(source, style_config=STYLE_PATH, lines=ranges)
  return formatted


def unified_diff(before: Optional[str], after: str,
                 repo_path: str) -> Tuple[str, int, int]:
  """A git-applicable diff (before None: a new file), and its added and
  removed line counts."""
  out = [f'diff --git a/{repo_path} b/{repo_path}\n']
  if before is None:
    out.append('new file mode 100644\n')
  added = removed = 0
  for line in difflib.unified_diff(
      (before or '').splitlines(keepends=True),
      after.splitlines(keepends=True),
      fromfile='/dev/null' if before is None else f'a/{repo_path}',
      tofile=f'b/{repo_path}',
      n=3):
    if line.startswith('+') and not line.startswith('+++'):
      added += 1
    elif line.startswith('-') and not line.startswith('---'):
      removed += 1
    if not line.endswith('\n'):
      line += '\n\\ No newline at end of file\n'
    out.append(line)
  if len(out) == 1:
    return '', 0, 0
  return ''.join(out), added, removed


def _review_lines(source: str, repo_path: str) -> List[str]:
  return [
      f'{os.path.basename(repo_path)}:{number}: {line.strip()}'
      for number, line in enumerate(source.split('\n'), 1)
      if REVIEW_PATTERN.search(line)
  ]


def render(out_dir: str = DEFAULT_OUT,
           xla_src: Optional[str] = None,
           bridge_path: str = BRIDGE_PATH) -> RenderResult:
  version = installed_torch_xla_version()
  if version.split('+')[0] != SUPPORTED_TORCH_XLA:
    raise RefusedError(
        f'the patch is written against torch_xla {SUPPORTED_TORCH_XLA}; the '
        f'installed torch_xla is {version}. Re-check the merge decisions '
        '(EXPECTED_REPLACED, UPSTREAM_ONLY) before changing the version.')
  upstream_bridge_path = installed_upstream_file('dynamo_bridge.py')
  upstream_config_path = installed_upstream_file('config.py')
  upstream_bridge = _read(upstream_bridge_path)
  upstream_config = _read(upstream_config_path)
  package_dir = os.path.dirname(bridge_path)

  renderer = BridgeRenderer(upstream_bridge, _read(bridge_path), package_dir)
  bridge_text, bridge_ours = renderer.render()
  bridge_text = yapf_format(bridge_text, bridge_ours)
  _check_rendered(bridge_text)

  flags = set(renderer.config_flags())
  companions = {}
  for module in renderer.companions:
    text, read = renderer.render_companion(module)
    text = yapf_format(text, [(1, text.count('\n') + 1)])
    _check_rendered(text, f'torch_xla/_dynamo/{module}.py')
    companions[module] = text
    flags |= read
  flags = sorted(flags)
  upstream_config_names = {
      n for s in parse_module(upstream_config, 'upstream').body for n in s.names
  }
  unknown = sorted(
      set(renderer.upstream_config_reads()) - upstream_config_names)
  if unknown:
    raise RefusedError(f'the bridge reads upstream config flags that '
                       f'torch_xla/_dynamo/config.py lacks: {unknown}')
  config_text, config_ours = render_config(
      upstream_config, _read(os.path.join(package_dir, 'config.py')), flags)
  config_text = yapf_format(config_text, config_ours)
  compile(config_text, CONFIG_REPO_PATH, 'exec')

  outputs = [('dynamo_bridge', upstream_bridge, bridge_text, BRIDGE_REPO_PATH),
             ('config', upstream_config, config_text, CONFIG_REPO_PATH)]
  for module, text in companions.items():
    outputs.append((module, None, text, f'torch_xla/_dynamo/{module}.py'))
  os.makedirs(out_dir, exist_ok=True)
  _remove_previous_outputs(out_dir)
  files, patches, written = [], [], []
  for name, before, after, repo_path in outputs:
    rendered_path = os.path.join(out_dir, name + '.py')
    patch_path = os.path.join(out_dir, name + '.patch')
    patch, added, removed = unified_diff(before, after, repo_path)
    for path, text in ((rendered_path, after), (patch_path, patch)):
      with open(path, 'w', encoding='utf-8') as f:
        f.write(text)
      written.append(os.path.basename(path))
    patches.append(patch)
    files.append(
        FileResult(repo_path, rendered_path, patch_path, added, removed))
  combined = os.path.join(out_dir, 'upstream.patch')
  with open(combined, 'w', encoding='utf-8') as f:
    f.write(''.join(patches))
  written.append(os.path.basename(combined))
  with open(os.path.join(out_dir, MANIFEST), 'w', encoding='utf-8') as f:
    f.write(''.join(name + '\n' for name in written))

  inlined = {
      module: [n for s in stmts for n in s.names]
      for module, stmts in renderer.inlined.items()
  }
  review = _review_lines(bridge_text, BRIDGE_REPO_PATH)
  review += _review_lines(config_text, CONFIG_REPO_PATH)
  for module, text in companions.items():
    review += _review_lines(text, f'torch_xla/_dynamo/{module}.py')
  return RenderResult(files=files,
                      replaced=renderer.replaced,
                      unchanged=renderer.unchanged,
                      added=renderer.added,
                      removed=renderer.removed,
                      kept=renderer.kept,
                      inlined=inlined,
                      companions=list(companions),
                      config_flags=flags,
                      conflicts=renderer.signature_conflicts(xla_src),
                      review=review,
                      combined_patch=combined)


def _remove_previous_outputs(out_dir: str) -> None:
  """Deletes what the last run wrote (a companion module may be gone)."""
  manifest = os.path.join(out_dir, MANIFEST)
  if not os.path.exists(manifest):
    return
  for name in _read(manifest).split():
    path = os.path.join(out_dir, os.path.basename(name))
    if os.path.exists(path):
      os.remove(path)


def _check_rendered(source: str, repo_path: str = BRIDGE_REPO_PATH) -> None:
  """A rendered file compiles, reads no undefined name and does not import
  torch_xla_patches."""
  tree = ast.parse(source)
  compile(tree, repo_path, 'exec')
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      for b in import_bindings(node):
        if b.key[1].split('.')[0] == PACKAGE:
          raise RefusedError(f'rendered {repo_path} imports {b.key[1]}')
  undefined = loaded_names(tree) - bound_anywhere(tree) - set(dir(builtins))
  if undefined:
    raise RefusedError(f'rendered {repo_path} reads undefined names: '
                       f'{", ".join(sorted(undefined))}')


def _print_report(result: RenderResult, out=None) -> None:
  out = out or sys.stdout

  def section(title: str, items: Iterable[str]) -> None:
    items = list(items)
    print(f'{title} ({len(items)}):', file=out)
    for item in items:
      print(f'  {item}', file=out)

  section('replaced', result.replaced)
  section('unchanged (same text as upstream)', result.unchanged)
  section('added', result.added)
  for module, names in result.inlined.items():
    section(f'inlined from {module}', names)
  section('new modules (torch_xla/_dynamo/<name>.py)', result.companions)
  section('config flags added to torch_xla/_dynamo/config.py',
          result.config_flags)
  section('removed', (f'{n}: {why}' for n, why in result.removed))
  section('kept from upstream', (f'{n}: {why}' for n, why in result.kept))
  section('conflicts with upstream callers', result.conflicts)
  section('lines to reword for the PR (mention the patch set or "upstream")',
          result.review)
  for f in result.files:
    print(f'{f.repo_path}: +{f.added} -{f.removed} -> {f.patch_path}', file=out)
  changed = sum(1 for f in result.files if f.added or f.removed)
  print(
      f'diff: {changed} files changed, {result.lines_added} insertions(+), '
      f'{result.lines_removed} deletions(-); combined patch: '
      f'{result.combined_patch}',
      file=out)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=DEFAULT_OUT, help='output directory')
  parser.add_argument(
      '--xla-src',
      help='a pytorch/xla checkout: list its tests/examples that use names '
      'whose signature changed or that were removed')
  parser.add_argument('--bridge', default=BRIDGE_PATH, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  try:
    result = render(args.out, args.xla_src, args.bridge)
  except RefusedError as error:
    print(f'make_upstream_patch: refused: {error}', file=sys.stderr)
    return 2
  _print_report(result)
  return 0


if __name__ == '__main__':
  sys.exit(main())
