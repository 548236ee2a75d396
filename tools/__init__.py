"""Development tools beside the package: the docs build's hooks and griffe extensions
(``docs_ext``), the check against webdataset's own test suite (``devcheck``), and what the
test suite and the benchmarks share: a JuiceFS volume mounted once per "node" (``juicefs``)
and processes started to race (``processes``)."""
