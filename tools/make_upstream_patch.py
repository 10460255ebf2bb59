"""Renders the patched dynamo bridge as a pull request onto pytorch/xla.

  python tools/make_upstream_patch.py [--out build/upstream]

torch_xla_patches/dynamo_bridge.py has the shape of torch_xla's
torch_xla/_dynamo/dynamo_bridge.py: the same names, and the top-level
statements both define in the same order. Rendering it is therefore a
rewrite of import lines, not a merge:

  * `from torch_xla_patches[.<module>] import ...` becomes
    `from torch_xla._dynamo[.<module>] import ...`. Every torch_xla_patches
    module reached that way from the bridge (config aside) is written as a
    new file torch_xla/_dynamo/<module>.py, with the same rewrite.
  * `from torch_xla._dynamo import config as <alias>` is dropped and <alias>
    renamed to `config`: the rendered files have one config module,
    torch_xla/_dynamo/config.py, and the flags they read from ours are
    appended to it (with what those flags use). Upstream's tests and users
    assign its flags at run time, which constants in the bridge would not
    allow.
  * `from torch_xla._dynamo.dynamo_bridge import <names>` is replaced by
    upstream's imports those definitions need, and the definitions
    themselves go in after the bridge's statement for the name upstream
    defines before them.

The rendered files are formatted with yapf and this repo's .style.yapf
(pytorch/xla's settings) and compared with upstream's by difflib. Written to
--out: dynamo_bridge.py, config.py and <module>.py for each new module, one
.patch per file (paths a/torch_xla/_dynamo/..., b/torch_xla/_dynamo/...) and
upstream.patch with all of them.

Exit status 2, with a message, when the installed torch_xla is not 2.9.0, an
upstream name the bridge imports is gone, the bridge's order differs from
upstream's, a name upstream's callers use is missing from the rendered
bridge, upstream's bridge has a name the rendering drops without a reason in
REMOVED, or a rendered file does not compile or reads an undefined name.
"""
import argparse
import ast
import builtins
import dataclasses
import difflib
import importlib.metadata
import importlib.util
import os
import re
import sys
import textwrap
from typing import Dict, List, Optional, Sequence, Set, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = 'torch_xla_patches'
UPSTREAM_PACKAGE = 'torch_xla._dynamo'
UPSTREAM_BRIDGE = 'torch_xla._dynamo.dynamo_bridge'
BRIDGE_PATH = os.path.join(REPO_ROOT, PACKAGE, 'dynamo_bridge.py')
STYLE_PATH = os.path.join(REPO_ROOT, '.style.yapf')
DEFAULT_OUT = os.path.join(REPO_ROOT, 'build', 'upstream')
SUPPORTED_TORCH_XLA = '2.9.0'
# Lists the files a run wrote, so the next run can delete them first.
MANIFEST = 'MANIFEST'

# Names torch_xla, torch and pytorch/xla's tests take from the bridge module;
# the rendered bridge must bind each.
CALLERS = {
    'extract_compiled_graph':
        'torch/_dynamo/backends/torchxla.py, test/dynamo/test_bridge.py',
    'UnsupportedNodesCollector':
        'test/dynamo/test_bridge.py',
    'GraphInputMatcher':
        'test/dynamo/test_graph_input_matcher.py, test_num_output.py',
    'NoneRemover':
        'test/dynamo/test_none_remover.py',
    'get_fallback_ops':
        'torch_xla/stablehlo.py',
    'alias_with_buffer_donor_config':
        'test/dynamo/test_dynamo_aliasing.py',
}

# Upstream's top-level definitions the rendered bridge drops, and why.
REMOVED = {
    '_get_input_arg_device':
        'nothing calls it',
    '_split_xla_args_tensor_sym_constant':
        'ArgLayout.key_function() replaces it',
    'Deduper':
        'OutputPlan replaces it',
    'SpecialReturnHandler':
        'OutputPlan replaces it',
    'is_xla_tensor':
        'only replaced code called it',
    '_clear_pending_irs_on_args':
        '_PendingRestore replaces it',
}

# Lines a PR author should reword: names and variables of the patch set,
# prose about "upstream".
REVIEW_PATTERN = re.compile(r'torch_xla_patches|XLA_PATCHES_|\bupstream\b',
                            re.IGNORECASE)


class RefusedError(Exception):
  """The tool cannot render a trustworthy patch; the message says why."""


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
  # Upstream names the bridge defines again, with changed or same text.
  replaced: List[str]
  unchanged: List[str]
  # The bridge's top-level names upstream does not have.
  added: List[str]
  # (name, why): upstream definitions dropped, and upstream imports dropped.
  removed: List[Tuple[str, str]]
  # (name, why): upstream definitions copied in.
  kept: List[Tuple[str, str]]
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


def _read(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return f.read()


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


# --- reading modules -------------------------------------------------------


def bound_names(node: ast.stmt) -> Set[str]:
  """Top-level names a statement binds."""
  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
    return {node.name}
  if isinstance(node, (ast.Import, ast.ImportFrom)):
    return {(a.asname or a.name).split('.')[0] for a in node.names}
  targets = getattr(node, 'targets', None) or [getattr(node, 'target', node)]
  return {
      sub.id
      for target in targets
      for sub in ast.walk(target)
      if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)
  }


def loaded_names(node: ast.AST) -> Set[str]:
  return {
      sub.id
      for sub in ast.walk(node)
      if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)
  }


def first_line(lines: List[str], node: ast.stmt) -> int:
  """1-based first line of `node`, its decorators and the comment lines right
  above them."""
  start = min([node.lineno] +
              [d.lineno for d in getattr(node, 'decorator_list', [])])
  while start > 1 and lines[start - 2].lstrip().startswith('#'):
    start -= 1
  return start


def statement_text(source: str, node: ast.stmt) -> str:
  lines = source.split('\n')
  return '\n'.join(lines[first_line(lines, node) - 1:node.end_lineno])


def _replace_lines(source: str, edits: List[Tuple[int, int, str]]) -> str:
  """Replaces 1-based inclusive line ranges by text ('' deletes; end =
  start - 1 inserts before start). The ranges must not overlap."""
  lines = source.split('\n')
  for start, end, text in sorted(edits, reverse=True):
    lines[start - 1:end] = text.split('\n') if text else []
  return '\n'.join(lines)


def package_import_edits(source: str) -> List[Tuple[int, int, str]]:
  """Edits that turn torch_xla_patches imports into torch_xla._dynamo ones.

  Both prefixes have 17 characters, so continuation lines stay aligned."""
  edits = []
  lines = source.split('\n')
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import) and any(
        a.name.split('.')[0] == PACKAGE for a in node.names):
      raise RefusedError(f'unsupported import: {ast.unparse(node)}; use '
                         f'`from {PACKAGE}[.<module>] import ...`')
    if isinstance(node, ast.ImportFrom) and (node.module or
                                             '').split('.')[0] == PACKAGE:
      line = lines[node.lineno - 1]
      new = line.replace(f'from {PACKAGE}', f'from {UPSTREAM_PACKAGE}', 1)
      edits.append((node.lineno, node.lineno, new))
  return edits


def package_modules_imported(source: str) -> List[str]:
  """torch_xla_patches modules `source` imports (config aside), in order."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
      found += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and (node.module or
                                               '').startswith(PACKAGE + '.'):
      found.append(node.module.split('.')[1])
  return [m for m in dict.fromkeys(found) if m != 'config']


def config_reads(source: str) -> Set[str]:
  """Attributes read off the name `config` (after rendering, the merged
  torch_xla/_dynamo/config.py)."""
  return {
      node.attr
      for node in ast.walk(ast.parse(source))
      if isinstance(node, ast.Attribute) and
      isinstance(node.value, ast.Name) and node.value.id == 'config'
  }


# --- the bridge ------------------------------------------------------------


@dataclasses.dataclass
class BridgeRendering:
  text: str
  replaced: List[str]
  unchanged: List[str]
  added: List[str]
  kept: List[Tuple[str, str]]


def render_bridge(upstream: str, bridge: str) -> BridgeRendering:
  upstream_tree = ast.parse(upstream)
  upstream_imports = [
      n for n in upstream_tree.body
      if isinstance(n, (ast.Import, ast.ImportFrom))
  ]
  upstream_body = [
      n for n in upstream_tree.body
      if n not in upstream_imports and not isinstance(n, ast.Expr)
  ]
  upstream_index = {
      name: i for i, n in enumerate(upstream_body) for name in bound_names(n)
  }
  tree = ast.parse(bridge)
  lines = bridge.split('\n')
  body = [
      n for n in tree.body
      if not isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr))
  ]
  imports = [
      n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
  ]

  # Shared names must come in upstream's order: nothing here reorders.
  shared = [(upstream_index[name], name)
            for n in body
            for name in sorted(bound_names(n))
            if name in upstream_index]
  for (i, earlier), (j, later) in zip(shared, shared[1:]):
    if j < i:
      raise RefusedError(
          f'the bridge defines {later} after {earlier}; upstream defines it '
          'before. Keep the top-level statements the bridge shares with '
          'upstream in upstream\'s order.')

  edits = package_import_edits(bridge)
  renames: Dict[str, str] = {}
  kept_names: List[str] = []
  kept_imports_at = None
  for node in imports:
    names = [(a.name, a.asname) for a in node.names]
    module = getattr(node, 'module', None)
    if module == UPSTREAM_BRIDGE:
      kept_names += [name for name, _ in names]
      kept_imports_at = (first_line(lines, node), node.end_lineno)
    elif module == UPSTREAM_PACKAGE and len(
        names) == 1 and names[0][0] == 'config' and names[0][1]:
      # Upstream's config, under an alias: the rendered files have one.
      renames[names[0][1]] = 'config'
      edits.append((first_line(lines, node), node.end_lineno, ''))

  gone = sorted(n for n in kept_names if n not in upstream_index)
  if gone:
    raise RefusedError(
        'names the bridge imports from upstream\'s dynamo_bridge.py are '
        f'gone: {", ".join(gone)}. The installed torch_xla is not the one the '
        'patch was written against.')

  # Upstream's definitions of the imported names, after the bridge's
  # statement for the nearest upstream name before each.
  bridge_names = {name for n in body for name in bound_names(n)}
  kept: List[Tuple[str, str]] = []
  needed_imports: Set[str] = set()
  inserts: Dict[int, List[str]] = {}
  for name in sorted(kept_names, key=upstream_index.get):
    node = upstream_body[upstream_index[name]]
    anchor = next((upstream_body[i]
                   for i in range(upstream_index[name] - 1, -1, -1)
                   if bound_names(upstream_body[i]) & bridge_names), None)
    if anchor is None:
      at = first_line(lines, body[0]) - 1
    else:
      anchor_name = sorted(bound_names(anchor) & bridge_names)[0]
      at = next(n.end_lineno for n in body if anchor_name in bound_names(n))
    inserts.setdefault(at, []).append(statement_text(upstream, node))
    needed_imports |= loaded_names(node)
    kept.append((name, CALLERS.get(name, 'the bridge uses it')))
  for at, texts in inserts.items():
    chunk = []
    for text in texts:
      chunk += ['', ''] + text.split('\n')
    edits.append((at + 1, at, '\n'.join(chunk)))

  # Upstream's imports the copied definitions need and the bridge lacks.
  bound_by_bridge = {name for n in imports for name in bound_names(n)}
  if kept_imports_at:
    edits.append((*kept_imports_at, '\n'.join(
        statement_text(upstream, n)
        for n in upstream_imports
        if bound_names(n) & needed_imports - bound_by_bridge)))
  text = _replace_lines(bridge, edits)
  for alias, name in renames.items():
    text = re.sub(rf'(?<![\w.]){re.escape(alias)}\b', name, text)

  upstream_texts = {
      name: statement_text(upstream, n) for n in upstream_body
      for name in bound_names(n)
  }
  result = BridgeRendering(text, [], [], [], kept)
  for n in body:
    label = ', '.join(sorted(bound_names(n)))
    if not label:
      continue
    old = {upstream_texts[x] for x in bound_names(n) if x in upstream_texts}
    if not old:
      result.added.append(label)
    elif old == {statement_text(bridge, n)}:
      result.unchanged.append(label)
    else:
      result.replaced.append(label)
  return result


# --- config.py -------------------------------------------------------------


def render_config(upstream: str, ours: str, flags: Set[str]) -> str:
  """Upstream's config.py with `flags`, and what they use, appended."""
  upstream_tree, tree = ast.parse(upstream), ast.parse(ours)
  clash = sorted(flags &
                 {n for s in upstream_tree.body for n in bound_names(s)})
  if clash:
    raise RefusedError(f'upstream config.py already defines {clash}')
  defined = {
      name: node for node in tree.body
      if not isinstance(node, (ast.Import, ast.ImportFrom))
      for name in bound_names(node)
  }
  missing = sorted(flags - set(defined))
  if missing:
    raise RefusedError('the rendered modules read config flags that '
                       f'{PACKAGE}/config.py does not define: {missing}')
  wanted, closure = list(flags), set()
  while wanted:
    name = wanted.pop()
    if name not in closure:
      closure.add(name)
      wanted += loaded_names(defined[name]) & set(defined)
  statements = [
      node for node in tree.body
      if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr)) and
      (bound_names(node) &
       closure or not bound_names(node) and loaded_names(node) & closure)
  ]
  used = set().union(*(loaded_names(node) for node in statements))
  imports = [
      statement_text(ours, node)
      for node in tree.body
      if isinstance(node, (ast.Import, ast.ImportFrom)) and bound_names(node) &
      used
  ]
  # The module docstring's Note travels with the flags, as a comment.
  docstring = ast.get_docstring(tree) or ''
  note = docstring[docstring.find('[Note:'):] if '[Note:' in docstring else ''
  title, _, note = note.partition('\n')
  appended = [f'# {title}'] * bool(title) + [
      textwrap.fill(paragraph, 80, initial_indent='# ', subsequent_indent='# ')
      for paragraph in note.split('\n\n')
      if paragraph.strip()
  ]
  appended += [statement_text(ours, node) + '\n' for node in statements]
  lines = upstream.rstrip('\n').split('\n')
  first_import = next((node.lineno
                       for node in upstream_tree.body
                       if isinstance(node, (ast.Import, ast.ImportFrom))), 1)
  lines[first_import - 1:first_import - 1] = imports + [''] * bool(imports)
  return '\n'.join(lines) + '\n\n\n' + '\n'.join(appended)


# --- checks and output -----------------------------------------------------


def check_rendered(source: str, repo_path: str) -> None:
  """A rendered file compiles, does not import torch_xla_patches and reads
  no name it does not bind."""
  tree = ast.parse(source)
  compile(tree, repo_path, 'exec')
  bound = set(dir(builtins))
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      modules = [a.name for a in node.names] if isinstance(
          node, ast.Import) else [node.module or '']
      if any(m.split('.')[0] == PACKAGE for m in modules):
        raise RefusedError(f'rendered {repo_path} imports {PACKAGE}')
      bound |= bound_names(node)
    elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
      bound.add(node.id)
    elif isinstance(node,
                    (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      bound.add(node.name)
    elif isinstance(node, ast.arg):
      bound.add(node.arg)
    elif isinstance(node, ast.ExceptHandler) and node.name:
      bound.add(node.name)
  undefined = sorted(loaded_names(tree) - bound)
  if undefined:
    raise RefusedError(f'rendered {repo_path} reads undefined names: '
                       f'{", ".join(undefined)}')


def call_parameters(node: ast.stmt) -> Optional[List[str]]:
  if isinstance(node, ast.ClassDef):
    init = next(
        (item for item in node.body
         if isinstance(item, ast.FunctionDef) and item.name == '__init__'),
        None)
    return call_parameters(init)[1:] if init else None
  if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
    return None
  args = node.args
  names = [a.arg for a in args.posonlyargs + args.args]
  names += ['*' + args.vararg.arg] if args.vararg else []
  names += [a.arg for a in args.kwonlyargs]
  return names + (['**' + args.kwarg.arg] if args.kwarg else [])


def conflicts(upstream: str, bridge: str, removed: Sequence[str]) -> List[str]:
  """Shared functions and classes whose parameters changed, and removed
  names."""
  old = {
      name: call_parameters(n) for n in ast.parse(upstream).body
      for name in bound_names(n)
  }
  found = []
  for node in ast.parse(bridge).body:
    for name in bound_names(node) & set(old):
      new = call_parameters(node)
      if None not in (old[name], new) and old[name] != new:
        found.append(f'{name}({", ".join(old[name])}) -> '
                     f'{name}({", ".join(new)})')
  return found + [f'{name} is removed' for name in removed]


def unified_diff(before: Optional[str], after: str,
                 repo_path: str) -> Tuple[str, int, int]:
  """A git-applicable diff (before None: a new file), and its added and
  removed line counts."""
  body = list(
      difflib.unified_diff(
          (before or '').splitlines(keepends=True),
          after.splitlines(keepends=True),
          fromfile='/dev/null' if before is None else f'a/{repo_path}',
          tofile=f'b/{repo_path}'))
  if not body:
    return '', 0, 0
  head = f'diff --git a/{repo_path} b/{repo_path}\n'
  if before is None:
    head += 'new file mode 100644\n'
  added = sum(1 for l in body[2:] if l.startswith('+'))
  removed = sum(1 for l in body[2:] if l.startswith('-'))
  body = [
      l if l.endswith('\n') else l + '\n\\ No newline at end of file\n'
      for l in body
  ]
  return head + ''.join(body), added, removed


def yapf_format(source: str) -> str:
  try:
    from yapf.yapflib.yapf_api import FormatCode
  except ImportError:
    raise RefusedError(
        'yapf is not installed: pip install yapf==0.40.2') from None
  return FormatCode(source, style_config=STYLE_PATH)[0]


def render(out_dir: str = DEFAULT_OUT,
           bridge_path: str = BRIDGE_PATH) -> RenderResult:
  version = installed_torch_xla_version()
  if version.split('+')[0] != SUPPORTED_TORCH_XLA:
    raise RefusedError(
        f'the patch is written against torch_xla {SUPPORTED_TORCH_XLA}; the '
        f'installed torch_xla is {version}. Re-check CALLERS, REMOVED and '
        'the bridge\'s statement order before changing the version.')
  upstream_bridge = _read(installed_upstream_file('dynamo_bridge.py'))
  upstream_config = _read(installed_upstream_file('config.py'))
  package_dir = os.path.dirname(bridge_path)
  bridge_source = _read(bridge_path)
  bridge = render_bridge(upstream_bridge, bridge_source)

  # New modules: what the bridge imports from the package, transitively.
  rendered = {'dynamo_bridge': yapf_format(bridge.text)}
  queue = package_modules_imported(bridge_source)
  companions = []
  while queue:
    module = queue.pop(0)
    path = os.path.join(package_dir, module + '.py')
    if module in companions or not os.path.exists(path):
      if module not in companions:
        raise RefusedError(f'{PACKAGE}.{module} is not a module file ({path})')
      continue
    companions.append(module)
    source = _read(path)
    rendered[module] = _replace_lines(source, package_import_edits(source))
    queue += package_modules_imported(source)
  upstream_config_names = {
      n for node in ast.parse(upstream_config).body for n in bound_names(node)
  }
  flags = set().union(
      *map(config_reads, rendered.values())) - upstream_config_names
  rendered['config'] = yapf_format(
      render_config(upstream_config,
                    _read(os.path.join(package_dir, 'config.py')), flags))
  for module, text in rendered.items():
    check_rendered(text, f'torch_xla/_dynamo/{module}.py')

  # What upstream callers need, and what the rendering drops.
  bridge_tree = ast.parse(rendered['dynamo_bridge'])
  rendered_names = {n for node in bridge_tree.body for n in bound_names(node)}
  missing = sorted(set(CALLERS) - rendered_names)
  if missing:
    raise RefusedError('the rendered bridge lacks names upstream callers '
                       'use: ' +
                       ', '.join(f'{n} ({CALLERS[n]})' for n in missing))
  upstream_tree = ast.parse(upstream_bridge)
  dropped = [
      n for node in upstream_tree.body
      if not isinstance(node, (ast.Import, ast.ImportFrom))
      for n in sorted(bound_names(node)) if n not in rendered_names
  ]
  if set(dropped) != set(REMOVED):
    raise RefusedError(
        'REMOVED must list the upstream definitions the rendering drops; '
        f'without a reason: {sorted(set(dropped) - set(REMOVED))}, listed but '
        f'kept: {sorted(set(REMOVED) - set(dropped))}')
  removed = [(n, REMOVED[n]) for n in dropped]
  removed += [(n, 'import nothing uses any more') for node in upstream_tree.body
              if isinstance(node, (ast.Import, ast.ImportFrom))
              for n in sorted(bound_names(node) - rendered_names)]

  os.makedirs(out_dir, exist_ok=True)
  manifest = os.path.join(out_dir, MANIFEST)
  if os.path.exists(manifest):
    for name in _read(manifest).split():
      if os.path.exists(os.path.join(out_dir, os.path.basename(name))):
        os.remove(os.path.join(out_dir, os.path.basename(name)))
  before = {'dynamo_bridge': upstream_bridge, 'config': upstream_config}
  files, patches, written = [], [], []
  for module in ['dynamo_bridge', 'config'] + companions:
    repo_path = f'torch_xla/_dynamo/{module}.py'
    patch, added, removed_lines = unified_diff(before.get(module),
                                               rendered[module], repo_path)
    paths = [os.path.join(out_dir, module + ext) for ext in ('.py', '.patch')]
    for path, text in zip(paths, (rendered[module], patch)):
      with open(path, 'w', encoding='utf-8') as f:
        f.write(text)
      written.append(os.path.basename(path))
    patches.append(patch)
    files.append(FileResult(repo_path, *paths, added, removed_lines))
  combined = os.path.join(out_dir, 'upstream.patch')
  with open(combined, 'w', encoding='utf-8') as f:
    f.write(''.join(patches))
  with open(manifest, 'w', encoding='utf-8') as f:
    f.write(''.join(name + '\n' for name in written + ['upstream.patch']))

  review = [
      f'{module}.py:{number}: {line.strip()}'
      for module, text in rendered.items()
      for number, line in enumerate(text.split('\n'), 1)
      if REVIEW_PATTERN.search(line)
  ]
  return RenderResult(files=files,
                      replaced=bridge.replaced,
                      unchanged=bridge.unchanged,
                      added=bridge.added,
                      removed=removed,
                      kept=bridge.kept,
                      companions=companions,
                      config_flags=sorted(flags),
                      conflicts=conflicts(upstream_bridge, bridge_source,
                                          dropped),
                      review=review,
                      combined_patch=combined)


def print_report(result: RenderResult, out=None) -> None:
  out = out or sys.stdout

  def section(title: str, items: Sequence[str]) -> None:
    print(f'{title} ({len(items)}):', file=out)
    for item in items:
      print(f'  {item}', file=out)

  section('replaced', result.replaced)
  section('unchanged (same text as upstream)', result.unchanged)
  section('added', result.added)
  section('new modules (torch_xla/_dynamo/<name>.py)', result.companions)
  section('config flags added to torch_xla/_dynamo/config.py',
          result.config_flags)
  section('removed', [f'{n}: {why}' for n, why in result.removed])
  section('kept from upstream', [f'{n}: {why}' for n, why in result.kept])
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
  parser.add_argument('--bridge', default=BRIDGE_PATH, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  try:
    result = render(args.out, args.bridge)
  except RefusedError as error:
    print(f'make_upstream_patch: refused: {error}', file=sys.stderr)
    return 2
  print_report(result)
  return 0


if __name__ == '__main__':
  sys.exit(main())
