"""``python -m shardcache`` is the ``shardcache`` command."""

from ._cli import main

raise SystemExit(main())
