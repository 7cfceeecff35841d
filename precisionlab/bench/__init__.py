"""Benchmarks run by ``precisionlab bench ...``: each measures against its peers and the physical
limit in the same run and reports ratios."""
