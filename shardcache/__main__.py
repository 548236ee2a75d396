"""``python -m shardcache`` is the ``shardcache`` command."""

from .cli import main

raise SystemExit(main())
