"""``python -m devicekit``: the same as the ``devicekit`` command."""

from devicekit._clirun import run

run()
