"""One module per ``layout-prop`` command, each declaring its flags (``add_parser(subparsers)``) and
running (``run(args) -> exit code``): it reads its flags, calls the library (most often a function
of :mod:`layout_prop.workflows`) and prints what it returns.

:mod:`layout_prop.cli` assembles the parsers and dispatches; nothing else imports a command.
:mod:`.flags` holds the flag types the parsers share, :mod:`.printing` the JSON printer.
"""
