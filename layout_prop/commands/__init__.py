"""One module per ``layout-prop`` command, each with ``run(args) -> exit code``.

:mod:`layout_prop.cli` parses the command line and dispatches here, importing a command's
module only when that command runs (so ``layout-prop --help`` stays fast).
:mod:`.model_input` is shared by the commands that take ``SPEC`` or ``MODEL --plan PLAN``.
"""
