"""Development tools beside the package: the docs build's hooks and griffe extensions
(``docs_ext``), the check against webdataset's own test suite (``devcheck``), and a JuiceFS
volume mounted once per "node" (``juicefs``), which the test suite and benchmark B12 both use."""
