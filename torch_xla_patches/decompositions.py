"""SymInt-safe tracing rules for XLA kernels that break dynamic tracing.

Filled in by the module-survey work (issue 3); install()/uninstall() are the
hooks apply()/revert() call.
"""


def install() -> None:
  pass


def uninstall() -> None:
  pass
