"""shardcache's benchmarks against its peers, and the studies behind the benchmarks page.

- ``harness``: ``python -m bench`` (``scripts/bench`` runs it): the scenario registry, the run
  loop and the report (``results.json``, ``results.md``).
- ``scenarios``: one module a scenario (``b1_warm`` ... ``b16_stage_check``); B12 mounts
  JuiceFS and runs as a script of its own.
- ``support``: what the scenarios share: the server and shaped link, peers' readers,
  CPU meters, shards, processes started together.
- ``studies``: counts rather than timings (``python -m bench.studies``), and the at-scale model.
- ``docs_tables``: the benchmarks page's tables, generated from ``results.json``.
- ``stubs``: torchvision stand-ins for Mosaic Streaming's import.

Layers: ``harness`` -> ``scenarios`` -> ``support``; nothing imports the harness but B12's
script and ``python -m bench``; no module imports a private name of ``shardcache``.
"""
