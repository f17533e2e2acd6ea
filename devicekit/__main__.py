"""``python -m devicekit``: the same as the ``devicekit`` command."""

from devicekit._cli import main

raise SystemExit(main())
