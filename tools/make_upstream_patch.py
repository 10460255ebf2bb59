"""Renders the patched dynamo bridge as a pull request onto pytorch/xla.

  python tools/make_upstream_patch.py [--out build/upstream]

torch_xla_patches/dynamo_bridge.py keeps the shape of torch_xla 2.9.0's
_dynamo/dynamo_bridge.py, so rendering it rewrites imports: torch_xla_patches
becomes torch_xla._dynamo (each package module so imported becomes a new file),
the flags the rendered files read are appended to upstream's config.py, and the
definitions the bridge imports from upstream's bridge are copied in where
upstream has them. --out gets each file (yapf-formatted), its diff against the
installed one and upstream.patch with all diffs. Exit status 2 for another
torch_xla version or a failed check: the order of the statements shared with
upstream, CALLERS, REMOVED, rendered files that compile and read only names
they bind. CONTRIBUTING.md has the details.
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
import symtable
import sys
from typing import Dict, List, Optional, Sequence, Set, Tuple

from yapf.yapflib.yapf_api import FormatCode

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = 'torch_xla_patches'
UPSTREAM_PACKAGE = 'torch_xla._dynamo'
UPSTREAM_BRIDGE = 'torch_xla._dynamo.dynamo_bridge'
BRIDGE_PATH = os.path.join(REPO_ROOT, PACKAGE, 'dynamo_bridge.py')
STYLE_PATH = os.path.join(REPO_ROOT, '.style.yapf')
DEFAULT_OUT = os.path.join(REPO_ROOT, 'build', 'upstream')
SUPPORTED_TORCH_XLA = '2.9.0'
# Lists the files a run wrote: the next run deletes them first, and
# test/upstream_mode.py finds the new modules in it.
MANIFEST = 'MANIFEST'
IMPORTS = (ast.Import, ast.ImportFrom)
# Upstream's config imported under an alias: the rendered files have one.
CONFIG_ALIAS = re.compile(r'^from torch_xla\._dynamo import config as (\w+)\n',
                          re.M)

# Names torch, torch_xla and pytorch/xla's test/dynamo take from the bridge
# module; the rendered bridge must bind each.
CALLERS = {
    'extract_compiled_graph': 'torch/_dynamo/backends/torchxla.py, test_bridge',
    'UnsupportedNodesCollector': 'test_bridge.py',
    'GraphInputMatcher': 'test_graph_input_matcher.py, test_num_output.py',
    'NoneRemover': 'test_none_remover.py',
    'get_fallback_ops': 'torch_xla/stablehlo.py',
    'alias_with_buffer_donor_config': 'test_dynamo_aliasing.py',
}

# Upstream's top-level definitions the rendered bridge drops, and why.
REMOVED = {
    '_get_input_arg_device': 'nothing calls it',
    '_split_xla_args_tensor_sym_constant': 'ArgLayout.key_function replaces it',
    'Deduper': 'OutputPlan replaces it',
    'SpecialReturnHandler': 'OutputPlan replaces it',
    'is_xla_tensor': 'only replaced code called it',
    '_clear_pending_irs_on_args': 'pending_ir_restored replaces it',
}

# Package modules rendered as a stand-in rather than carried, and the
# stand-in: the native module builds C++ against torch at run time, which
# torch_xla would do in its own extension (_XLAC) instead.
STAND_INS = {
    'native':
        '''"""The per-call work of a served call in C++: not carried into
torch_xla, whose own extension (_XLAC) is where it would go. The bridge runs
its Python twins."""

unavailable_reason = 'not carried into torch_xla'


def helpers():
  return None


def loaded():
  return None
''',
}

# Lines a PR author should reword: names and variables of the patch set,
# prose about "upstream".
REVIEW_PATTERN = re.compile(r'torch_xla_patches|XLA_PATCHES_|\bupstream\b',
                            re.IGNORECASE)


class RefusedError(Exception):
  """The tool cannot render a trustworthy patch; the message says why."""


@dataclasses.dataclass(frozen=True)
class Comparison:
  """The rendered bridge against upstream's, by the names statements bind."""
  # Upstream's statements with changed text, with the same text, and new
  # ones (those copied from upstream aside).
  replaced: List[str]
  unchanged: List[str]
  added: List[str]
  removed: Dict[str, str]  # upstream definitions and imports dropped -> why
  conflicts: List[str]  # changed parameters, removed definitions


@dataclasses.dataclass(frozen=True)
class Rendering(Comparison):
  """What render() wrote and what a reviewer of the pull request reads."""
  diff_sizes: Dict[str, Tuple[int, int]]  # repo path -> (added, removed)
  kept: Dict[str, str]  # upstream definitions copied in -> who needs them
  companions: List[str]  # package modules rendered as new files
  config_flags: List[str]
  review: List[str]


def _read(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return f.read()


def installed_torch_xla_version() -> str:
  try:
    return importlib.metadata.version('torch_xla')
  except importlib.metadata.PackageNotFoundError:
    return 'none'


def installed_upstream_file(name: str) -> str:
  package_dir = importlib.util.find_spec('torch_xla').submodule_search_locations
  path = os.path.join(package_dir[0], '_dynamo', name)
  if not os.path.exists(path):
    raise RefusedError(f'installed torch_xla has no _dynamo/{name} ({path})')
  return path


def bound_names(node: ast.stmt) -> Set[str]:
  """Top-level names a statement binds."""
  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
    return {node.name}
  if isinstance(node, IMPORTS):
    return {(a.asname or a.name).split('.')[0] for a in node.names}
  targets = getattr(node, 'targets', None) or [getattr(node, 'target', node)]
  return {
      sub.id
      for target in targets
      for sub in ast.walk(target)
      if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)
  }


def top_level_names(nodes: List[ast.stmt]) -> Set[str]:
  return set().union(*map(bound_names, nodes))


def loaded_names(node: ast.AST) -> Set[str]:
  return {
      sub.id
      for sub in ast.walk(node)
      if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)
  }


def statement_text(source: str, node: ast.stmt) -> str:
  """The lines of `node`, its decorators and the comment lines above them."""
  lines = source.split('\n')
  start = min([node.lineno] +
              [d.lineno for d in getattr(node, 'decorator_list', [])])
  while start > 1 and lines[start - 2].lstrip().startswith('#'):
    start -= 1
  return '\n'.join(lines[start - 1:node.end_lineno])


def needed_statements(tree: ast.Module, names: Set[str],
                      available: Set[str]) -> List[ast.stmt]:
  """The top-level statements of `tree` that bind `names` and, transitively,
  the names those read, but names in `available`."""
  defined = {name: node for node in tree.body for name in bound_names(node)}
  needed, todo = set(), list(names)
  while todo:
    name = todo.pop()
    if name in defined and name not in needed | available:
      needed.add(name)
      todo += loaded_names(defined[name])
  return [node for node in tree.body if bound_names(node) & needed]


def rewrite_imports(source: str) -> Tuple[str, List[str]]:
  """`source` with `from torch_xla_patches[.<module>] import` renamed to
  `from torch_xla._dynamo[.<module>] import` (both have 17 characters, so
  continuation lines stay aligned) and upstream's config, imported under an
  alias, renamed to `config`; and the package modules `source` imports."""
  lines, modules = source.split('\n'), []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and (node.module or
                                             '').split('.')[0] == PACKAGE:
      lines[node.lineno - 1] = lines[node.lineno - 1].replace(
          f'from {PACKAGE}', f'from {UPSTREAM_PACKAGE}', 1)
      # `from package.module import x` or `from package import module`.
      modules += node.module.split('.')[1:2] or [a.name for a in node.names]
  text = '\n'.join(lines)
  aliases = CONFIG_ALIAS.findall(text)
  if aliases:
    # A module that imports only upstream's config, under an alias, imports
    # it as `config`; one that imports the package's config already has it.
    binds_config = 'config' in top_level_names(
        ast.parse(CONFIG_ALIAS.sub('', text)).body)
    text = CONFIG_ALIAS.sub(
        '' if binds_config else f'from {UPSTREAM_PACKAGE} import config\n',
        text)
    for alias in aliases:
      text = re.sub(rf'(?<![\w.]){alias}\b', 'config', text)
  return text, modules


def render_bridge(upstream: str, bridge: str) -> Tuple[str, List[str]]:
  """The bridge (imports rewritten), formatted, with the definitions it
  imports from upstream's bridge copied in; and the names copied."""
  upstream_tree, tree = ast.parse(upstream), ast.parse(bridge)
  upstream_index = {
      name: i for i, n in enumerate(upstream_tree.body)
      if not isinstance(n, IMPORTS) for name in bound_names(n)
  }
  body = [n for n in tree.body if not isinstance(n, IMPORTS)]
  shared = [(upstream_index[name], name)
            for n in body
            for name in sorted(bound_names(n))
            if name in upstream_index]
  for (i, earlier), (j, later) in zip(shared, shared[1:]):
    if j < i:
      raise RefusedError(
          f'the bridge defines {later} after {earlier}; upstream defines it '
          'before. Keep the top-level statements the bridge shares with '
          'upstream in upstream\'s order: nothing here reorders.')

  kept_import = next(
      (n for n in tree.body if getattr(n, 'module', None) == UPSTREAM_BRIDGE),
      None)
  if kept_import is None:
    return FormatCode(bridge, style_config=STYLE_PATH)[0], []
  kept = {a.name for a in kept_import.names}
  if kept - set(upstream_index):
    raise RefusedError(
        'names the bridge imports from upstream\'s dynamo_bridge.py are '
        f'gone: {", ".join(sorted(kept - set(upstream_index)))}. The installed '
        'torch_xla is not the one the patch was written against.')

  # What the imported definitions need, transitively, goes in: definitions
  # after the bridge's statement for the last name upstream defines before
  # them (so where upstream has them), imports in place of the import from
  # upstream's bridge.
  lines = bridge.split('\n')
  ends = {name: n.end_lineno for n in body for name in bound_names(n)}
  inserts: Dict[int, List[str]] = {}
  new_imports, copied = [], []
  for node in needed_statements(upstream_tree, kept,
                                top_level_names(tree.body) - kept):
    if isinstance(node, IMPORTS):
      new_imports += statement_text(upstream, node).split('\n')
      continue
    copied += sorted(bound_names(node))
    index = upstream_index[sorted(bound_names(node))[0]]
    at = max(
        (ends[n] for n, i in upstream_index.items() if n in ends and i < index),
        default=kept_import.end_lineno)
    inserts.setdefault(
        at, []).extend(['', ''] + statement_text(upstream, node).split('\n'))
  # Bottom up, so that the line numbers above each insert still hold.
  for at in sorted(inserts, reverse=True):
    lines[at:at] = inserts[at]
  text = '\n'.join(lines).replace(statement_text(bridge, kept_import),
                                  '\n'.join(new_imports), 1)
  return FormatCode(text, style_config=STYLE_PATH)[0], copied


def render_config(upstream: str, ours: str, flags: Set[str]) -> str:
  """Upstream's config.py, formatted, with our config.py's [Note: ...] as a
  comment and the statements of ours `flags` need appended (imports on top)."""
  tree = ast.parse(ours)
  missing = sorted(flags - top_level_names(tree.body))
  if missing:
    raise RefusedError('the rendered modules read config flags that '
                       f'{PACKAGE}/config.py does not define: {missing}')
  picked = needed_statements(tree, flags, set())
  imports = [statement_text(ours, n) for n in picked if isinstance(n, IMPORTS)]
  docstring = ast.get_docstring(tree) or ''
  note = docstring[docstring.find('[Note:'):] if '[Note:' in docstring else ''
  appended = [('# ' + line).rstrip() for line in note.splitlines()]
  appended += [
      statement_text(ours, n) + '\n'
      for n in picked
      if not isinstance(n, IMPORTS)
  ]
  # Upstream's config.py starts with its imports: ours go before them.
  text = '\n'.join(imports + ['', upstream.rstrip('\n'), '', ''] + appended)
  return FormatCode(text, style_config=STYLE_PATH)[0]


def check_rendered(source: str, repo_path: str) -> None:
  """A rendered file compiles, does not import torch_xla_patches, and each
  global name it reads is a builtin or bound in the module."""
  compile(source, repo_path, 'exec')
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, IMPORTS) and PACKAGE in ast.unparse(node):
      raise RefusedError(f'rendered {repo_path} imports {PACKAGE}')
  tables = [symtable.symtable(source, repo_path, 'exec')]
  read, bound = set(), set(dir(builtins))
  while tables:
    table = tables.pop()
    tables += table.get_children()
    for symbol in table.get_symbols():
      if symbol.is_global() and (symbol.is_assigned() or symbol.is_imported()):
        bound.add(symbol.get_name())
      if symbol.is_global() and symbol.is_referenced():
        read.add(symbol.get_name())
  if read - bound:
    raise RefusedError(f'rendered {repo_path} reads undefined names: '
                       f'{", ".join(sorted(read - bound))}')


def call_parameters(node: ast.stmt) -> Optional[List[str]]:
  """Parameter names of a function, or of a class's __init__."""
  if isinstance(node, ast.ClassDef):
    node = next((n for n in node.body if getattr(n, 'name', '') == '__init__'),
                None)
  if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
    return None
  args = node.args
  names = [a.arg for a in args.posonlyargs + args.args]
  names += ['*' + args.vararg.arg] if args.vararg else []
  names += [a.arg for a in args.kwonlyargs]
  return names + (['**' + args.kwarg.arg] if args.kwarg else [])


def compare(upstream: str, bridge: str, kept: List[str]) -> Comparison:
  """Checks the rendered bridge against CALLERS and REMOVED, and compares it
  with upstream's; `kept` are the names copied from upstream."""
  upstream_tree, tree = ast.parse(upstream), ast.parse(bridge)
  names = top_level_names(tree.body)
  missing = sorted(set(CALLERS) - names)
  if missing:
    raise RefusedError('the rendered bridge lacks names upstream callers '
                       'use: ' +
                       ', '.join(f'{n} ({CALLERS[n]})' for n in missing))
  upstream_nodes = {
      name: n for n in upstream_tree.body if not isinstance(n, IMPORTS)
      for name in bound_names(n)
  }
  removed = {n: REMOVED.get(n) for n in upstream_nodes if n not in names}
  if set(removed) != set(REMOVED):
    raise RefusedError(
        'REMOVED must list the upstream definitions the rendering drops; '
        f'without a reason: {sorted(set(removed) - set(REMOVED))}, listed but '
        f'kept: {sorted(set(REMOVED) - set(removed))}')
  upstream_imports = [n for n in upstream_tree.body if isinstance(n, IMPORTS)]
  for name in sorted(top_level_names(upstream_imports) - names):
    removed[name] = 'import nothing uses any more'

  replaced, unchanged, added, conflicts = [], [], [], []
  for node in tree.body:
    bound = [] if isinstance(node, IMPORTS) else sorted(bound_names(node))
    shared = [n for n in bound if n in upstream_nodes]
    if not bound or set(bound) & set(kept):
      continue
    if not shared:
      added.append(', '.join(bound))
    elif {statement_text(upstream, upstream_nodes[n]) for n in shared
         } == {statement_text(bridge, node)}:
      unchanged.append(', '.join(bound))
    else:
      replaced.append(', '.join(bound))
    for name in shared:
      old, new = call_parameters(upstream_nodes[name]), call_parameters(node)
      if None not in (old, new) and old != new:
        conflicts.append(f'{name}({", ".join(old)}) -> '
                         f'{name}({", ".join(new)})')
  conflicts += [f'{n} is removed' for n in REMOVED]
  return Comparison(replaced=replaced,
                    unchanged=unchanged,
                    added=added,
                    removed=removed,
                    conflicts=conflicts)


def unified_diff(before: Optional[str], after: str,
                 repo_path: str) -> Tuple[str, int, int]:
  """A diff git applies (before None: a new file), and the numbers of lines
  it adds and removes."""
  lines = list(
      difflib.unified_diff(
          (before or '').splitlines(keepends=True),
          after.splitlines(keepends=True),
          fromfile='/dev/null' if before is None else f'a/{repo_path}',
          tofile=f'b/{repo_path}'))
  if not lines:
    return '', 0, 0
  head = f'diff --git a/{repo_path} b/{repo_path}\n'
  head += 'new file mode 100644\n' if before is None else ''
  patch = head + ''.join(
      l if l.endswith('\n') else l + '\n\\ No newline at end of file\n'
      for l in lines)
  hunks = lines[2:]  # after the ---/+++ file names
  return patch, sum(l[0] == '+' for l in hunks), sum(l[0] == '-' for l in hunks)


def render(out_dir: str = DEFAULT_OUT,
           bridge_path: str = BRIDGE_PATH) -> Rendering:
  version = installed_torch_xla_version()
  if version.split('+')[0] != SUPPORTED_TORCH_XLA:
    raise RefusedError(
        f'the patch is written against torch_xla {SUPPORTED_TORCH_XLA}; the '
        f'installed torch_xla is {version}. Re-check CALLERS, REMOVED and '
        'the bridge\'s statement order before changing the version.')
  upstream_bridge = _read(installed_upstream_file('dynamo_bridge.py'))
  upstream_config = _read(installed_upstream_file('config.py'))
  package_dir = os.path.dirname(bridge_path)
  bridge, queue = rewrite_imports(_read(bridge_path))
  bridge, kept = render_bridge(upstream_bridge, bridge)

  # New modules: what the bridge imports from the package, transitively.
  companions = {}
  while queue:
    module = queue.pop(0)
    if module in STAND_INS:
      companions[module] = STAND_INS[module]
    elif module not in companions and module not in ('config', 'dynamo_bridge'):
      companions[module], imported = rewrite_imports(
          _read(os.path.join(package_dir, module + '.py')))
      queue += imported
  flags = {  # attributes read off `config`, upstream's aside
      node.attr
      for text in [bridge, *companions.values()]
      for node in ast.walk(ast.parse(text))
      if isinstance(node, ast.Attribute) and
      isinstance(node.value, ast.Name) and node.value.id == 'config'
  } - top_level_names(ast.parse(upstream_config).body)
  config = render_config(upstream_config,
                         _read(os.path.join(package_dir, 'config.py')), flags)
  rendered = {'dynamo_bridge': bridge, 'config': config, **companions}
  for module, text in rendered.items():
    check_rendered(text, f'torch_xla/_dynamo/{module}.py')

  comparison = compare(upstream_bridge, rendered['dynamo_bridge'], kept)

  # Output files: each module and its diff, then all the diffs.
  before = {'dynamo_bridge': upstream_bridge, 'config': upstream_config}
  files, diff_sizes = {}, {}
  for module, text in rendered.items():
    repo_path = f'torch_xla/_dynamo/{module}.py'
    patch, plus, minus = unified_diff(before.get(module), text, repo_path)
    files[module + '.py'], files[module + '.patch'] = text, patch
    diff_sizes[repo_path] = (plus, minus)
  files['upstream.patch'] = ''.join(files[m + '.patch'] for m in rendered)
  os.makedirs(out_dir, exist_ok=True)
  manifest = os.path.join(out_dir, MANIFEST)
  for name in _read(manifest).split() if os.path.exists(manifest) else []:
    if os.path.exists(os.path.join(out_dir, name)):
      os.remove(os.path.join(out_dir, name))
  files[MANIFEST] = ''.join(name + '\n' for name in files)
  for name, text in files.items():
    with open(os.path.join(out_dir, name), 'w', encoding='utf-8') as f:
      f.write(text)

  review = [
      f'{module}.py:{number}: {line.strip()}'
      for module, text in rendered.items()
      for number, line in enumerate(text.split('\n'), 1)
      if REVIEW_PATTERN.search(line)
  ]
  return Rendering(**vars(comparison),
                   diff_sizes=diff_sizes,
                   kept={n: CALLERS.get(n, 'the bridge uses it') for n in kept},
                   companions=list(companions),
                   config_flags=sorted(flags),
                   review=review)


def print_report(result: Rendering) -> None:
  for title, items in [
      ('replaced', result.replaced),
      ('unchanged (same text as upstream)', result.unchanged),
      ('added', result.added),
      ('new modules (torch_xla/_dynamo/<name>.py)', result.companions),
      ('config flags appended to config.py', result.config_flags),
      ('removed', [f'{n}: {why}' for n, why in result.removed.items()]),
      ('kept from upstream', [f'{n}: {why}' for n, why in result.kept.items()]),
      ('conflicts with upstream callers', result.conflicts),
      ('lines to reword (patch set names, "upstream")', result.review),
  ]:
    print(f'{title} ({len(items)}):')
    for item in items:
      print(f'  {item}')
  for repo_path, (added, removed) in result.diff_sizes.items():
    print(f'{repo_path}: +{added} -{removed}')
  added, removed = map(sum, zip(*result.diff_sizes.values()))
  print(f'diff: {len(result.diff_sizes)} files, {added} insertions(+), '
        f'{removed} deletions(-)')


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
  print(f'written to {args.out}; upstream.patch has every diff')
  return 0


if __name__ == '__main__':
  sys.exit(main())
